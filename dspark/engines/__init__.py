"""Inference engines that run outside the main venv, driven over HTTP (vLLM)."""

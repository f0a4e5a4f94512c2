"""Serving: the batched engine, confidence-scheduled verification (issue 6)."""

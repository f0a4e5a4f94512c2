"""Speculative decoding against the real target: our batched Llama forward and its cache."""

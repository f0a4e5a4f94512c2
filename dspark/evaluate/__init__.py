"""The acceptance evaluation: speculative decoding per category and method."""

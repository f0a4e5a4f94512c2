"""Serving: the serving engine (continuous batching), confidence-scheduled verification
(issue 6)."""

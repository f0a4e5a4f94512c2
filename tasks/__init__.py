"""Prefect tasks: thin wrappers over dspark, where retries, tracking and lineage live."""

"""Prefect flows: one per stage, and `dspark` (deployment `full`) chaining them."""

"""Hidden-state capture from the target (the inference plane's half of extraction)."""

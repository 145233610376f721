"""Engines: generation (sampling with log-probs) and training (policy model + optimizer)."""

"""Orchestration: builds the roles a config needs and drives a run."""

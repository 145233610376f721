"""Test helpers that stand in for outside services (an SGLang-compatible HTTP server)."""

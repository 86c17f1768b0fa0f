"""Runnable Koochak examples (`python -m examples.<name>.main` from the repository root)."""

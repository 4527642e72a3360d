"""The data collection tests share the session fixtures of tests/conftest.py (a tiny pair for collection)."""

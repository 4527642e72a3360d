"""Tests of selector/expander/."""

"""Tests of selector/acceptance/."""

"""Tests of selector/root/."""

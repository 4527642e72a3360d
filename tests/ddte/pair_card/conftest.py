"""The pair card's fixtures: the tiny `ddte train-pair` folder of the pair tests (offline Hugging Face included)."""

from tests.ddte.train_pair.conftest import tiny_pair  # noqa: F401  (a fixture, shared by name)

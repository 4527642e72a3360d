"""Test-wide settings (offline hubs, a private HF cache, one torch thread) and the session fixtures several test
folders share: a synthetic selector data set and one tiny training run on it.

Verifier work is many small vector operations; on a shared 2-core machine a multi-threaded pool spends
more time waking threads than computing, so tests pin one thread.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="ddte-hf-"))
# the machine's latency tables that --latency machine measures for the test pairs stay out of the user's cache
os.environ["DDTE_LATENCY_CACHE"] = tempfile.mkdtemp(prefix="ddte-latency-")

import torch  # noqa: E402

torch.set_num_threads(1)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.factories import TINY_TRAIN_CONFIG, TRAINED_EPOCHS  # noqa: E402


@pytest.fixture(autouse=True)
def _lightning_logs_to_this_tests_stderr():
    """Point Lightning's console handlers at the sys.stderr of the test about to run.

    Importing ``lightning`` adds a ``StreamHandler`` bound to the sys.stderr of that moment. When the import
    happens inside a test that uses ``capsys``, that stream is closed at the test's end, and a later test that
    logs through Lightning (``Seed set to 0``) prints a "Logging error" traceback into its own stderr. In the
    console script sys.stderr lives as long as the process, so this is the test harness's business alone."""
    for name in ("lightning", "lightning.fabric", "lightning.pytorch"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:
                handler.stream = sys.stderr


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    """20 prompts x 12 roots, labels for specinfer, traversal and gbv (NaN on delayed trees), 18 actions."""
    from selector.root.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "synthetic", n_prompts=20, roots_per_prompt=12,
                                   seed=0, verifiers=("specinfer", "traversal", "gbv"))


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def trained(synthetic_dir, tracking_uri, tmp_path_factory):
    """One tiny training run (with baselines) on the synthetic set; returns its TrainResult.

    TRAINED_EPOCHS epochs: against the position-weighted best static action (decode/cost/throughput.py) the tiny net
    needs more than 8 to learn the synthetic task (8 epochs: 0.994x the static action, 20: 1.046x)."""
    from selector.root.train import train_selector

    out = tmp_path_factory.mktemp("runs")
    return train_selector(TINY_TRAIN_CONFIG, [f"data.data_dir={synthetic_dir}", f"run.output_dir={out}",
                                              f"run.tracking_uri={tracking_uri}", "run.baselines=true",
                                              f"trainer.max_epochs={TRAINED_EPOCHS}"], verbose=False)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> Path:
    """A pair YAML pointing at two tiny random models with the shipped tokenizer's vocabulary (data collection)."""
    from tests.factories import save_collect_pair

    return save_collect_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def tiny_collected(tiny_pair, tmp_path_factory) -> Path:
    """A small schema-2 collection on the tiny pair (specinfer, traversal, gbv; T 0.7 and 1.0)."""
    from data_gen.collection import collect
    from data_gen.config import load_collect_config
    from tests.factories import collect_overrides

    out = tmp_path_factory.mktemp("collected") / "data"
    collect(load_collect_config(None, collect_overrides(tiny_pair, out)), progress=False)
    return out

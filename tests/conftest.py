"""Test-wide settings: offline hubs, a private HF cache, and one torch thread.

Verifier work is many small vector operations; on a shared 2-core machine a multi-threaded pool spends
more time waking threads than computing, so tests pin one thread.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="ddte-hf-"))

import torch  # noqa: E402

torch.set_num_threads(1)

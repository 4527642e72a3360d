"""What machine a figure was measured on: the CPU's model and whether bf16 matrix products run natively on it."""

from __future__ import annotations

import platform


def _cpuinfo() -> str | None:
    """/proc/cpuinfo's text, None where the file is absent."""
    try:
        with open("/proc/cpuinfo") as handle:
            return handle.read()
    except OSError:
        return None


def native_bf16_cpu() -> bool:
    """Whether this CPU runs bf16 matrix products natively (AVX-512 BF16 or AMX). Without it, a bf16 pass over n
    tokens costs about n one-token passes on CPU."""
    info = _cpuinfo() or ""
    return "avx512_bf16" in info or "amx_bf16" in info


def cpu_flags_digest() -> str:
    """8 hex digits of the CPU's feature flags: two machines that report one model name (a hypervisor's generic
    "Intel Xeon Processor") but differ in AVX-512, VNNI or BF16 get different digests."""
    import hashlib

    info = _cpuinfo() or ""
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]


def cpu_model() -> str:
    """The CPU's model name and whether it has native bf16, from /proc/cpuinfo; ``platform.processor()`` where that
    file is absent."""
    info = _cpuinfo()
    if info is None:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'with' if native_bf16_cpu() else 'without'} AVX-512 BF16)"


def environment() -> dict[str, str | int | None]:
    """What a measurement ran on, as result files record it: Python, torch, transformers (None where it is not
    installed), the machine's architecture, its CPU model (:func:`cpu_model`), its cores and torch's threads. A
    caller adds its own keys on top (the device, the GPU, the load average)."""
    import os
    from importlib.util import find_spec

    import torch

    transformers = None
    if find_spec("transformers") is not None:
        import transformers as module

        transformers = module.__version__
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers,
            "machine": platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads()}

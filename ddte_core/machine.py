"""What machine a figure was measured on: the CPU's model and whether bf16 matrix products run natively on it."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 BF16 (without it, a bf16 pass over n tokens costs about n
    one-token passes on CPU), from /proc/cpuinfo; ``platform.processor()`` where that file is absent."""
    try:
        with open("/proc/cpuinfo") as handle:
            info = handle.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'with' if 'avx512_bf16' in info else 'without'} AVX-512 BF16)"

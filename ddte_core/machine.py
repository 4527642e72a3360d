"""What machine a figure was measured on: the CPU's model, the limits put on the kernels that run on it, and whether
bf16 matrix products run natively there.

The kernels a process runs are not only the CPU's: ``ONEDNN_MAX_CPU_ISA`` caps the instructions oneDNN's kernels use,
``ATEN_CPU_CAPABILITY`` ATen's own (a Zen 3's refusal of bf16 prepacking is reproduced on a newer CPU so). A machine's
measurement and its bf16 question are therefore asked of the kernels under those limits, not of ``/proc/cpuinfo``
alone.
"""

from __future__ import annotations

import functools
import os
import platform

# the environment variables that limit which kernel paths torch runs (oneDNN reads the DNNL_ spelling too)
KERNEL_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_DEFAULT_FPMATH_MODE",
                 "DNNL_DEFAULT_FPMATH_MODE")
# oneDNN ISA limits below AVX512_CORE_BF16: under one, oneDNN runs bf16 products by converting to fp32 (emulated)
_ISA_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def _cpuinfo() -> str | None:
    """/proc/cpuinfo's text, None where the file is absent."""
    try:
        with open("/proc/cpuinfo") as handle:
            return handle.read()
    except OSError:
        return None


def cpu_has_bf16() -> bool:
    """Whether the CPU reports AVX-512 BF16 or AMX-BF16 (/proc/cpuinfo): what it could run, whatever the limits."""
    info = _cpuinfo() or ""
    return "avx512_bf16" in info or "amx_bf16" in info


def native_bf16_cpu() -> bool:
    """Whether bf16 matrix products run natively here: the CPU has the instructions (:func:`cpu_has_bf16`) and the
    kernels that will run them may use them under this process's limits (:func:`bf16_kernels_native`). Without it, a
    bf16 pass over n tokens costs about n one-token passes on CPU."""
    return cpu_has_bf16() and bf16_kernels_native()


@functools.cache
def bf16_kernels_native() -> bool:
    """Whether torch's bf16 matrix products go through oneDNN's native bf16 kernels in this process: no
    ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) below ``AVX512_CORE_BF16``, and oneDNN's bf16 path answers a
    tiny product (it refuses one where its limit leaves no bf16 kernel). Asked once per process."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        if os.environ.get(name, "").strip().upper() in _ISA_WITHOUT_BF16:
            return False
    import torch

    try:
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=torch.bfloat16))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16), weight, None, "none", [],
                                                 "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return out.shape == (2, 8) and bool((out == 16).all())


def kernel_limits() -> str:
    """The limits set on this process's kernels (:data:`KERNEL_LIMITS`), as ``NAME=VALUE`` joined by commas, with
    the ATen capability they leave in effect; empty where none is set."""
    limits = [f"{name}={os.environ[name].strip()}" for name in KERNEL_LIMITS if os.environ.get(name, "").strip()]
    if not limits:
        return ""
    import torch

    return ", ".join([*limits, f"ATen {torch.backends.cpu.get_cpu_capability()}"])


def cpu_flags_digest() -> str:
    """8 hex digits of the CPU's feature flags: two machines that report one model name (a hypervisor's generic
    "Intel Xeon Processor") but differ in AVX-512, VNNI or BF16 get different digests."""
    import hashlib

    info = _cpuinfo() or ""
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:8]


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512 BF16, from /proc/cpuinfo; ``platform.processor()`` where that
    file is absent."""
    info = _cpuinfo()
    if info is None:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'with' if cpu_has_bf16() else 'without'} AVX-512 BF16)"


def environment() -> dict[str, str | int | None]:
    """What a measurement ran on, as result files record it: Python, torch, transformers (None where it is not
    installed), the machine's architecture, its CPU model (:func:`cpu_model`), its cores and torch's threads. A
    caller adds its own keys on top (the device, the GPU, the load average)."""
    from importlib.util import find_spec

    import torch

    transformers = None
    if find_spec("transformers") is not None:
        import transformers as module

        transformers = module.__version__
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers,
            "machine": platform.machine(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads()}

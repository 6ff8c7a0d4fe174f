"""Whether this hardware computes in bf16 faster than in fp32: the choice behind the
``best`` settings (a policy's ``dtype: best`` for its engines and evaluator, a trainer's
``autocast: best``).

bf16 pays where matrix units take it natively: a CUDA GPU of compute capability 8 or more
(Ampere on), or a CPU with AMX-BF16 or AVX512-BF16 (Intel Sapphire Rapids on, AMD Zen 4
on). Elsewhere torch emulates bf16 matmuls and they run several times slower than fp32
(about 7x on an AVX2-only CPU), so ``best`` stays in fp32. Measured: bench/matmul_dtypes.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("astraflow.precision")

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
BEST = "best"


@dataclass(frozen=True)
class Precision:
    """The choice: ``bf16`` or not, and why (one line, for the log)."""

    bf16: bool
    reason: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (Linux); empty where ``/proc/cpuinfo`` is missing."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def choose(device: str, flags: set[str], cuda_capability: tuple[int, int] | None) -> Precision:
    """The decision alone: ``device`` (``cpu``, ``cuda``, ``cuda:N``), the CPU's flags, and
    the GPU's compute capability (None without one)."""
    if device.startswith("cuda"):
        if cuda_capability is None:
            return Precision(False, f"{device}: no CUDA device answers, fp32")
        major, minor = cuda_capability
        if major >= 8:
            return Precision(True, f"{device}: compute capability {major}.{minor} "
                             "has bf16 tensor cores")
        return Precision(False, f"{device}: compute capability {major}.{minor} "
                         "has no bf16 tensor cores, fp32")
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if native:
        return Precision(True, f"CPU has {' and '.join(native)}: bf16 matmuls run natively")
    return Precision(False, f"CPU has neither {' nor '.join(BF16_CPU_FLAGS)}: bf16 would be "
                     "emulated, slower than fp32")


def best_precision(device: str = "cpu") -> Precision:
    """``choose`` for this machine (logged)."""
    capability = None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(torch.device(device))
    p = choose(device, cpu_flags(), capability)
    log.info("precision %s: %s", "bf16" if p.bf16 else "fp32", p.reason)
    return p


def resolve_best(dtype: str | None, device: str = "cpu") -> str | None:
    """``dtype`` as given, or for ``best`` ``"bfloat16"`` / ``"float32"`` by
    ``best_precision(device)`` (logged)."""
    if dtype != BEST:
        return dtype
    return "bfloat16" if best_precision(device).bf16 else "float32"


__all__ = ["BEST", "BF16_CPU_FLAGS", "Precision", "best_precision", "choose", "cpu_flags",
           "resolve_best"]

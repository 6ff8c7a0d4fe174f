"""megatron-core on a CPU: the pinned version, the checks that name a fix, and three shims.

megatron-core is written for CUDA. On the path the megatron trainer backend takes (a
``GPTModel`` with the local layer spec, tensor and pipeline parallel size 1, our own
training loop with torch AdamW) three places assume a GPU; each gets a small replacement
here, installed only when the model runs on a CPU (``install_cpu_shims``):

- the RNG tracker: ``CudaRNGStatesTracker.add`` reads ``torch.cuda.get_rng_state`` and
  attention always enters ``get_cuda_rng_tracker().fork()``; ``CpuRNGStatesTracker``
  keeps named CPU generator states instead;
- ``GlobalMemoryBuffer.get_tensor`` allocates on the current CUDA device; the shim
  allocates on the CPU;
- ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to CUDA; the shim leaves it where it is.

The shims replace internals of one release, so they are tied to ``PINNED_VERSION``: a
different installed version is refused on a CPU with the command that installs the pinned
one. On a GPU nothing is patched.

Everything else (``parallel_state.initialize_model_parallel``, the model) is untouched.
``causal_mask`` builds the attention mask on the inputs' device, so megatron's own
``get_default_causal_mask`` (which allocates on CUDA) is never reached.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

# the megatron-core release the shims are written against (the newest one for Python 3.11;
# 0.17 and later need Python >= 3.12)
PINNED_VERSION = "0.16.1"
# the oldest Python the pinned release installs on (its Requires-Python)
MIN_PYTHON = (3, 10)
INSTALL = f"pip install 'astraflow[megatron]' (megatron-core=={PINNED_VERSION})"


class MegatronUnavailable(RuntimeError):
    """megatron-core cannot be used here; the message names the fix."""


def installed_version() -> str | None:
    """The installed megatron-core version, None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_megatron(cpu: bool = True) -> str:
    """The installed megatron-core version, or ``MegatronUnavailable`` naming the fix:
    Python too old for the pinned release, megatron-core missing, or (``cpu``: the shims
    are needed) another release than the pinned one."""
    if sys.version_info[:2] < MIN_PYTHON:
        have = ".".join(map(str, sys.version_info[:3]))
        need = ".".join(map(str, MIN_PYTHON))
        raise MegatronUnavailable(
            f"trainer backend megatron: megatron-core {PINNED_VERSION} needs Python >= "
            f"{need}, this is Python {have}; run the trainer under Python >= {need} "
            "or use trainer.backend: torch")
    version = installed_version()
    if version is None:
        raise MegatronUnavailable(
            f"trainer backend megatron: megatron-core is not installed; {INSTALL}, "
            "or use trainer.backend: torch")
    if cpu and version != PINNED_VERSION:
        raise MegatronUnavailable(
            f"trainer backend megatron on a CPU: megatron-core {version} is installed, the "
            f"CPU shims are written for {PINNED_VERSION}; "
            f"pip install megatron-core=={PINNED_VERSION}")
    return version


class CpuRNGStatesTracker:
    """Named CPU generator states in place of megatron's CUDA ones: ``add`` seeds one,
    ``fork`` runs its body under it and leaves the default CPU state as it was."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        """Whether a state was added (megatron asks before forking)."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget every state."""
        self.states_, self.seeds_, self._is_initialized = {}, set(), False

    def get_states(self) -> dict[str, torch.Tensor]:
        """The named states (a copy of the mapping)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the named states."""
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """A new state ``name`` seeded with ``seed`` (both must be new)."""
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the body with the CPU generator in state ``name``, then restore it."""
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str,
                    mem_alloc_context: Any = None) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` allocating on the CPU (a view of a reused buffer
    of at least the requested size)."""
    need = 1
    for d in tensor_shape:
        need *= int(d)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < need:
        buf = self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype)
    return buf[:need].view(*tensor_shape)


def _cpu_get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` with ``inv_freq`` left on its device:
    ``[seq, 1, 1, dim]`` angles, halves (or interleaved pairs) repeated."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


_INSTALLED = False


def install_cpu_shims() -> None:
    """Patch the three CUDA assumptions (idempotent); needs the pinned version."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_megatron(cpu=True)
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random

    tracker = CpuRNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER = tracker
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_get_emb
    _INSTALLED = True


def rng_tracker() -> Any:
    """megatron's current RNG tracker (the CPU one once the shims are installed)."""
    from megatron.core.tensor_parallel import random

    return random.get_cuda_rng_tracker()


def quiet_megatron() -> None:
    """Silence what megatron-core says on import and per forward that is no news here:
    the missing TransformerEngine/Apex fallbacks, the ``tp_group`` deprecation (tensor
    parallel size 1), its INFO logs. Filters only warnings raised in megatron's modules."""
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\.")
    logging.getLogger("megatron").setLevel(logging.WARNING)


def init_parallel(cpu: bool, seed: int = 0) -> None:
    """One-process model parallel state (tensor and pipeline size 1), on gloo for a CPU
    or nccl for a GPU, with megatron's model-parallel RNG state seeded."""
    import torch.distributed as dist

    quiet_megatron()
    from megatron.core import parallel_state

    if cpu:
        install_cpu_shims()
    if not dist.is_initialized():
        # one process: an in-memory store, no network rendezvous
        dist.init_process_group("gloo" if cpu else "nccl", store=dist.HashStore(),
                                world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tracker = rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        tracker.add("model-parallel-rng", seed + 2718)


def causal_mask(n: int, device: torch.device | str) -> torch.Tensor:
    """megatron's attention mask for ``n`` positions: ``[1, 1, n, n]``, True where a query
    may not see a key (the future)."""
    ones = torch.ones(n, n, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)[None, None]


__all__ = [
    "INSTALL",
    "MIN_PYTHON",
    "PINNED_VERSION",
    "CpuRNGStatesTracker",
    "MegatronUnavailable",
    "causal_mask",
    "check_megatron",
    "init_parallel",
    "install_cpu_shims",
    "installed_version",
    "quiet_megatron",
]

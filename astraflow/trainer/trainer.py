"""The policy-gradient step on a causal LM, without Kafka.

The network is a ``PolicyModel`` (``astraflow.trainer.backend``): a transformers model
(``backend="torch"``) or a megatron-core ``GPTModel`` built from the Hugging Face config
(``backend="megatron"``). Everything below is the same code for both; weights go in and
out with Hugging Face names and layouts whatever the backend.

``Trainer.train_step(batch)`` takes one ``Batch`` (token ids, loss masks and behaviour
log-probs as the rollout recorded them; nothing is tokenized here), computes GRPO group
advantages from the sequence rewards, the new log-probs of every token given its prefix,
the clipped/truncated loss of ``astraflow.trainer.loss`` on the loss-mask tokens, and takes
one AdamW step with gradient-norm clipping. Micro-batching bounds memory: either
``micro_batch_size`` sequences per forward/backward, or ``micro_batch_tokens`` padded tokens
(sequences sorted by length, so little is padding); gradients are accumulated to one step
per batch, the same step as one full-batch pass, because the loss is normalised by the
token count of the whole batch. The model computes logits only from the first column a
micro-batch trains (``logits_to_keep``): prompt positions need none.

Log-probs are those of the distribution the rollouts sample from
(``astraflow.models.sampling``): ``log_softmax(logits / temperature)``, renormalised over
the top-p nucleus when ``top_p < 1``, as the engines record the behaviour log-probs. The
nucleus is taken on the trainer's own logits; a trained token outside it (its probability
under the trained policy is 0) gets ``LOGPROB_FLOOR`` (-50) instead of ``-inf``, so its
ratio is about 0 and the loss stays finite (``trainer/outside_nucleus_frac`` counts them).

Real models: ``autocast="bf16"`` runs forward and backward under ``torch.autocast`` in
bfloat16 while the master weights, gradients, optimizer and the log-softmax/loss stay fp32;
``gradient_checkpointing`` recomputes each layer's activations in the backward pass.

Determinism: the model runs in eval mode (no dropout), so a step depends only on weights,
optimizer state and batch; with the same torch thread count a resumed trainer reproduces an
uninterrupted one bit for bit.

Published weights: the model trains in ``dtype`` (the master weights, fp32 by default) and
``published_state()`` rounds them to ``publish_dtype`` (bf16 by default; ``same``: as
trained). Consecutive bf16 roundings differ only where an update crossed a bf16 step, so
the deltas between published versions are sparse even though AdamW moves every fp32
weight. The master weights cannot be rebuilt from the published ones: ``master_bytes()``
/ ``load_master_bytes()`` save and restore them, like the optimizer state.

With such a rounding, forward and backward run on the published weights
(``forward_on="published"``, the default): the model's parameters hold the master rounded
to ``publish_dtype`` and the optimizer steps a separate fp32 copy (one more copy of the
weights in memory). The trainer's log-probs are then those of the very policy the engines
sample from; on the master weights (``"master"``) they drift from it, since the rounding
drops most single AdamW steps, and PPO clipping zeroes the gradient of many tokens.

Every trainer is one rank of a group (``group``, ``astraflow.trainer.parallel``); without
one it is a group of one (``parallel.solo``), whose collectives are identities, so one
process runs the same step as several. Several processes: the model is sharded with
FSDP2 (``fully_shard`` on each decoder layer and on the root): parameters, gradients,
fp32 masters and the AdamW moments are ``DTensor`` shards along dim 0. Every rank gets the
whole batch and trains its share of every (mini)batch: whole groups, dealt to the ranks
balanced by tokens (deterministically); the loss is still divided by the token count of the
whole (mini)batch and the gradients are summed over the ranks (not averaged), so the update
is the one of a single process, up to the order of the float sums. FSDP2's collectives pair
up across ranks: every rank makes the same number of forward (and backward) passes, a rank
with fewer runs passes on a dummy input whose loss is 0 times its logits. The figures a loss
takes from the whole batch (``batch_stats``) are computed from every rank's tokens; the
metrics are reduced over the ranks (every rank returns the same ones) and ``grad_norm`` is
the global norm. A shared prompt is not run once for its rows under a group (its two
forward passes would pair FSDP2's collectives differently across ranks); only
``backend="torch"`` can be sharded. With the same world size and thread counts, runs are
bit-identical; across world sizes they agree up to float summation order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from astraflow.models.precision import best_precision
from astraflow.models.sampling import LOGPROB_FLOOR, picked_logprobs
from astraflow.trainer.backend import (
    LoraPolicy,
    PolicyModel,
    TorchPolicy,
    make_policy_model,
)
from astraflow.trainer.loss import (
    BATCH_STATS,
    EPISODE_META,
    SUM_KEYS,
    get_loss,
    unit_advantages,
)
from astraflow.trainer.parallel import Group, shard_rows, solo
from astraflow.trainer.parallel import rows as make_rows
from astraflow.trainer.schedule import LrSchedule
from astraflow.trainer.state import StateSnapshot
from astraflow.wire.records import Batch, Sequence

if TYPE_CHECKING:  # the step imports no configuration: it reads the spec it is given
    from astraflow.config.lora import LoraSpec
    from astraflow.config.sections import PolicySpec, TrainerSpec
    from astraflow.weights.blob import Rows

log = logging.getLogger("astraflow.trainer")

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


# the id the padding positions of a pass hold: they are masked out of every pass and loss
PAD_TOKEN_ID = 0


def lr_schedule(spec: TrainerSpec) -> LrSchedule:
    """The learning rate of each step, as ``spec`` declares it."""
    return LrSchedule(lr=spec.lr, warmup_steps=spec.lr_warmup_steps, decay=spec.lr_decay,
                      final=spec.lr_final, decay_steps=spec.lr_decay_steps)


def chosen_autocast(spec: TrainerSpec) -> tuple[str, str]:
    """``(autocast, why)``: ``spec.autocast`` as set, or for ``best`` what this machine's
    device computes fastest (megatron's CPU path takes no autocast: none there)."""
    if spec.autocast != "best":
        return spec.autocast, "as configured"
    if spec.backend == "megatron" and spec.device.startswith("cpu"):
        return "none", "megatron on a CPU takes no autocast"
    p = best_precision(spec.device)
    return ("bf16" if p.bf16 else "none"), p.reason


def bf16_forward_blocker(spec: TrainerSpec, *, lora: bool = False,
                         grouped: bool = False) -> str | None:
    """Why the forward's weights cannot be held in bf16 (``forward_dtype``), or None;
    ``lora``: the trainer trains adapters; ``grouped``: it is one rank of a process group
    of several. ``TrainerSpec`` refuses ``forward_dtype: bf16`` on the same grounds."""
    if grouped:
        return "needs one process, not a process group"
    needs = [("forward_on", "published"), ("publish_dtype", "bf16"), ("dtype", "fp32"),
             ("backend", "torch")]
    for name, value in needs:
        if getattr(spec, name) != value:
            return f"needs {name} {value}, not {getattr(spec, name)}"
    return "needs no LoRA (lora: trains adapters)" if lora else None


def chosen_forward_dtype(spec: TrainerSpec, *, lora: bool = False,
                         grouped: bool = False) -> tuple[str, str]:
    """``(forward_dtype, why)``: as set, or for ``best`` bf16 where the device computes it
    natively and ``bf16_forward_blocker`` finds nothing, else fp32."""
    if spec.forward_dtype != "best":
        return spec.forward_dtype, "as configured"
    blocker = bf16_forward_blocker(spec, lora=lora, grouped=grouped)
    if blocker is not None:
        return "fp32", f"bf16 {blocker}"
    p = best_precision(spec.device)
    return ("bf16" if p.bf16 else "fp32"), p.reason


@dataclass
class _Row:
    seq: Sequence
    advantage: float
    group: int = 0  # the index of its group in the batch


def _prompt_len(row: _Row) -> int:
    """The tokens of ``row`` before its first loss-mask token (at least 1: the first token
    is never trained, it has no prefix); all of them when it has none."""
    mask = row.seq.loss_mask
    return max(1, mask.index(1)) if 1 in mask else len(mask)


class Trainer:
    """One policy's model and optimizer; ``train_step`` per batch."""

    def __init__(
        self,
        model_path: str,
        spec: TrainerSpec,
        policy: str | None = None,
        model: Any = None,
        group: Group | None = None,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_staleness: int | None = None,
        lora: LoraSpec | None = None,
    ):
        """``spec``: the policy's typed ``trainer:`` section (``astraflow.config.sections.
        TrainerSpec``), validated where it was built; the keywords are the policy's own
        settings the step reads (``for_policy`` takes them from its ``PolicySpec``), here
        with the values that change nothing: log-probs of the unscaled, untruncated
        distribution (``temperature`` 0, greedy, counts as 1), no staleness bound, the
        whole model trained rather than LoRA adapters. ``model``: a ``PolicyModel`` or a
        transformers model to train instead of the one in ``model_path`` (loaded by
        ``spec.backend``). ``group``: the processes (``astraflow.trainer.parallel.join``)
        the model is sharded over with FSDP2 when there are several; it then trains on
        ``group.device`` (see the module docstring). None: this process alone (``solo``
        on ``spec.device``). Every rank of a group must make the same calls
        (``train_step``, ``published_state``, ...) in the same order."""
        self.spec = c = spec
        self.policy = policy
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_p = top_p
        self.max_staleness = max_staleness
        self.lora = lora
        self.group = group = group if group is not None else solo(c.device)
        # several ranks shard the model (FSDP2); a group of one holds it whole
        self.sharded = group.world > 1
        _check_group(self, group)
        self.dtype = DTYPES[c.dtype]
        self.publish_dtype = None if c.publish_dtype == "same" else DTYPES[c.publish_dtype]
        grouped, lora_on = self.sharded, self.lora is not None
        if c.forward_dtype == "bf16":  # what the spec could not see: adapters, a group
            blocker = bf16_forward_blocker(c, lora=lora_on, grouped=grouped)
            if blocker is not None:
                raise ValueError(f"forward_dtype (--forward-dtype) bf16 holds the published "
                                 f"weights: {blocker}")
        self.forward_dtype, why = chosen_forward_dtype(c, lora=lora_on, grouped=grouped)
        if c.forward_dtype == "best":
            log.info("%s: forward weights %s (%s)", policy or "trainer", self.forward_dtype,
                     why)
        self.autocast, why = chosen_autocast(c)
        if self.forward_dtype == "bf16":
            self.autocast, why = "none", "the forward's weights are bf16 themselves"
        if c.autocast == "best":
            log.info("%s: autocast %s (%s)", policy or "trainer", self.autocast, why)
        self.device = group.device
        # sharded, a model directory is read in rows: each rank its own (sharded_load)
        files = None if not self.sharded or model is not None else _weight_files(model_path)
        self.load_seconds = 0.0  # reading the weights in rows (sharded_load); 0: not so
        # eval mode: no dropout, deterministic, and log-probs match the rollout's
        self.backend: PolicyModel = (
            make_policy_model(c.backend, model_path, self.dtype, str(self.device), model)
            if files is None else TorchPolicy(_meta_model(model_path, self.dtype)))
        if self.lora is not None:
            self.backend = LoraPolicy(self.backend.module, self.lora)
        self.model = self.backend.module
        if c.gradient_checkpointing:
            self.backend.enable_checkpointing()
        if self.sharded:
            _fully_shard(self.model, group, self._mixed_precision())
        if files is not None:
            self._sharded_load(files)
        # True when the published weights are a rounding of the trained ones, which then
        # have to be saved apart (master_bytes) for an exact resume
        self.keeps_master = self.publish_dtype is not None and any(
            v.is_floating_point() and v.dtype != self.publish_dtype
            for v in self.backend.named_state().values()
        )
        # forward_on="published": model parameter -> its fp32 master (what the optimizer
        # steps); the parameter holds the master rounded to publish_dtype
        self._masters: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        if self.keeps_master and c.forward_on == "published":
            self._masters = [(p, p.detach().clone().requires_grad_(True))
                             for p in self.model.parameters() if p.requires_grad]
            self._round_params()
            if self.forward_dtype == "bf16":
                self._hold_published()
        self._master_of = {id(p): m for p, m in self._masters}
        trained = ([m for _, m in self._masters] or
                   [p for p in self.model.parameters() if p.requires_grad])
        self.optimizer = torch.optim.AdamW(
            trained, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
            weight_decay=c.weight_decay, **adam_kwargs(c.adam_impl, trained))
        self.steps = 0
        self.schedule = lr_schedule(c)
        # blocks until a checkpoint's copy of the trained tensors is done (hold_updates)
        self._update_guard: Callable[[], Any] | None = None
        # the loss reads a proximal policy apart from this step's (decoupled_ppo): with
        # several minibatches, its log-probs are taken before the first step
        self._reads_proximal = "logprobs_proximal" in inspect.signature(
            get_loss(c.loss)).parameters

    @classmethod
    def for_policy(cls, spec: PolicySpec, policy: str | None = None, model: Any = None,
                   group: Group | None = None) -> Trainer:
        """The trainer of a policy as its typed section ``spec`` declares it: its
        ``trainer:``, and the policy's model, sampling, ``max_staleness`` and ``lora``."""
        return cls(spec.model, spec.trainer, policy, model, group,
                   temperature=spec.temperature, top_p=spec.top_p,
                   max_staleness=spec.max_staleness, lora=spec.lora)

    # --- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's (master) weights, detached, by their Hugging Face names and in
        their layouts (whatever the backend). Under a group: full tensors gathered from
        every rank (a collective, expensive: ``published_part`` is the sharded way)."""
        trained = {k: self._master_of.get(id(v), v)
                   for k, v in self.backend.named_state(keep_vars=True).items()}
        full: dict[int, torch.Tensor] = {}  # tied weights are gathered once
        for v in trained.values():
            if id(v) not in full:
                full[id(v)] = (v.detach().full_tensor() if _is_dtensor(v) else v.detach())
        return self.backend.to_hf({k: full[id(v)] for k, v in trained.items()})

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors training updates, by Hugging Face name: each parameter's master (or
        the parameter itself when it has none) and the persistent buffers; the tensors
        themselves, not detached: the optimizer's own (this rank's ``DTensor`` shards under
        a group), each once (tied weights under their first name). Write into them under
        ``torch.no_grad()``, then ``refresh_published()``. ``backend="torch"`` only
        (megatron's names are not Hugging Face's)."""
        if not isinstance(self.backend, TorchPolicy):
            raise ValueError(f"trained_state needs backend 'torch', this trainer runs "
                             f"{self.spec.backend!r}")
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for k, v in self.backend.named_state(keep_vars=True).items():
            if id(v) not in seen:
                seen.add(id(v))
                out[k] = self._master_of.get(id(v), v)
        return out

    def refresh_published(self) -> None:
        """After the masters were written in place (``trained_state``): each parameter :=
        its master rounded to ``publish_dtype`` again."""
        self._round_params()

    def _hold_published(self) -> None:
        """Each parameter becomes a ``publish_dtype`` tensor (its published value, exactly:
        it holds the rounding already), whose gradient of each backward pass is summed into
        its master and cleared (``forward_dtype`` bf16)."""
        for p, m in self._masters:
            p.data = p.data.to(self.publish_dtype)
            p.register_post_accumulate_grad_hook(functools.partial(_add_grad_to, m))

    def _round_params(self) -> None:
        """Each parameter := its master rounded to ``publish_dtype`` (the published value)."""
        with torch.no_grad():
            for p, m in self._masters:
                p.copy_(m.to(self.publish_dtype))

    def _load_model_state(self, state: dict[str, torch.Tensor], part: bool = False) -> None:
        self._before_update()
        if self.forward_dtype == "bf16":  # the parameters cannot hold the fp32 masters
            self._load_masters(state)
        else:
            if part:
                self._load_part(state)
            elif self.sharded:
                self._load_rows(state)
            else:
                self.backend.load_hf(state)
            with torch.no_grad():
                for p, m in self._masters:
                    m.copy_(p)
        self._round_params()

    def _load_masters(self, state: dict[str, torch.Tensor]) -> None:
        """Every weight of ``state`` (Hugging Face names, as ``state_dict`` gives them)
        into its master, or into the tensor itself where it has none."""
        with torch.no_grad():
            for k, v in self._named_to_load(state).items():
                self._master_of.get(id(v), v).copy_(state[k])

    def _load_rows(self, state: dict[str, torch.Tensor]) -> None:
        """Under a group: each weight's rows of this rank from the full tensors of
        ``state`` (every weight, by Hugging Face name), into the parameters."""
        with torch.no_grad():
            for k, v in self._named_to_load(state).items():
                if _is_dtensor(v):
                    start, stop = self._rows_of(v)
                    v.to_local().copy_(state[k][start:stop])
                else:
                    v.copy_(state[k])

    def _load_part(self, part: dict[str, torch.Tensor]) -> None:
        """Under a group: this rank's part of the weights (``published_part``'s names and
        shapes: its rows of each sharded tensor) into the parameters. Needs every tensor
        sharded (``fully_sharded``): a rank above 0 holds no whole tensor's part."""
        if not self.fully_sharded:
            raise ValueError("loading a rank's part needs every tensor sharded")
        with torch.no_grad():
            for k, v in self.backend.named_state(keep_vars=True).items():
                start, stop = self._rows_of(v)
                if stop == start:
                    continue
                local = v.to_local()
                got = part.get(k)
                if got is None or tuple(got.shape) != tuple(local.shape):
                    raise ValueError(
                        f"loading weights: {k} is {None if got is None else tuple(got.shape)} "
                        f"in this rank's part, its rows {start}..{stop} are "
                        f"{tuple(local.shape)}")
                local.copy_(got)

    @property
    def fully_sharded(self) -> bool:
        """Whether every weight is sharded over the group (FSDP2 leaves none whole), so
        each rank's published part holds all it needs of every tensor."""
        return self.sharded and all(_is_dtensor(v) for v in
                                    self.backend.named_state(keep_vars=True).values())

    def _named_to_load(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's tensors by name (the parameters themselves), once ``state`` is
        found to hold each of them, in its full shape, and nothing else."""
        mine = self.backend.named_state(keep_vars=True)
        missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        if missing or unexpected:
            raise ValueError(f"loading weights: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]} (of {len(missing)}, {len(unexpected)})")
        for k, v in mine.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"loading weights: {k} has shape {tuple(state[k].shape)}, "
                                 f"the model's is {tuple(v.shape)}")
        return mine

    def _sharded_load(self, files: dict[str, str]) -> None:
        """Under a group, the model built on the meta device and sharded: each rank
        allocates its rows alone and reads them from the safetensors ``files`` (tensor name
        -> file), in ``dtype``; no rank ever holds a whole weight (memory ~1/N from the
        start). Non-persistent buffers (rotary frequencies) are computed again on the
        device; the model is then in eval mode, as ``make_policy_model`` leaves it."""
        from safetensors import safe_open

        t0 = time.perf_counter()
        buffers = _rebuilt_buffers(self.model, self.device)
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            for name, value in buffers.items():
                self.model.get_buffer(name).copy_(value)
            done: set[int] = set()  # tied weights are one tensor: read once
            by_file: dict[str, list[tuple[str, torch.Tensor]]] = {}
            for k, v in self.backend.named_state(keep_vars=True).items():
                if k in buffers or id(v) in done:
                    continue
                if k not in files:
                    raise ValueError(f"loading weights: {k} is in no safetensors file of the "
                                     "model directory")
                done.add(id(v))
                by_file.setdefault(files[k], []).append((k, v))
            for path, tensors in by_file.items():
                with safe_open(path, framework="pt", device="cpu") as f:
                    for k, v in tensors:
                        stored = f.get_slice(k)
                        if tuple(stored.get_shape()) != tuple(v.shape):
                            raise ValueError(f"loading weights: {k} has shape "
                                             f"{tuple(stored.get_shape())} in {path}, the "
                                             f"model's is {tuple(v.shape)}")
                        if _is_dtensor(v):
                            start, stop = self._rows_of(v)
                            v.to_local().copy_(stored[start:stop])
                        else:
                            v.copy_(stored[:])
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0

    def _mixed_precision(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` under a group where the trainer computes in bf16
        (``autocast`` bf16, or bf16 weights): layers are all-gathered in bf16 (half the
        bytes; autocast would cast each weight to bf16 for its matmul anyway) and gradients
        reduce-scattered in fp32, so the sum over ranks loses nothing to bf16. None (fp32
        all-gathers and reductions) where the trainer computes in fp32: an fp32 run stays
        fp32."""
        if self.autocast != "bf16" and self.dtype != torch.bfloat16:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def _rows_of(self, v: torch.Tensor) -> tuple[int, int]:
        """The rows of dim 0 of the sharded ``v`` this rank holds."""
        start, stop = shard_rows(v.shape[0], self.group.rank, self.group.world)
        if v.to_local().shape[0] != stop - start:  # FSDP2 split other than torch.chunk's
            raise RuntimeError(f"a shard of {tuple(v.shape)} has {v.to_local().shape[0]} "
                               f"rows, expected {stop - start}")
        return start, stop

    def published_state(self) -> dict[str, torch.Tensor]:
        """What is published: the weights with floating tensors cast to ``publish_dtype``
        (the tensors themselves, not copies, where nothing is cast). Under a group: full
        tensors on every rank (gathered, a collective, expensive)."""
        dt = self.publish_dtype
        return {
            k: v.to(dt) if dt is not None and v.is_floating_point() else v
            for k, v in self.state_dict().items()
        }

    def published_part(self) -> tuple[dict[str, torch.Tensor], dict[str, Rows]]:
        """This rank's part of the published weights, by Hugging Face name (cast to
        ``publish_dtype``, contiguous, on the device; the tensors themselves where nothing
        is cast), and the rows (``astraflow.weights.blob.Rows``) of those that are parts
        of a sharded tensor; a name without rows is a whole tensor (``WeightPublisher``'s
        convention). Under a group every parameter is sharded along dim 0: a rank holding no
        row of one leaves it out; tensors that are not sharded (buffers, if any) are whole
        in rank 0's part only. Across the ranks the parts cover each tensor of
        ``published_state()`` exactly once. Without a group: ``published_state()``, no
        rows."""
        if not self.sharded:
            return {k: v.contiguous() for k, v in self.published_state().items()}, {}
        dt = self.publish_dtype
        tensors: dict[str, torch.Tensor] = {}
        rows: dict[str, Rows] = {}
        for k, v in self.backend.named_state(keep_vars=True).items():
            v = self._master_of.get(id(v), v).detach()
            if _is_dtensor(v):
                start, stop = self._rows_of(v)
                if stop == start:
                    continue
                local = v.to_local()
                rows[k] = make_rows(start, stop, tuple(v.shape))
            elif self.group.rank == 0:
                local = v
            else:
                continue
            if dt is not None and local.is_floating_point():
                local = local.to(dt)
            tensors[k] = local.contiguous()
        return tensors, rows

    def published_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of each tensor of ``published_state()``, by Hugging Face name, read
        from the tensors' metadata: nothing is gathered or cast."""
        dt = self.publish_dtype
        return {k: dt if dt is not None and v.is_floating_point() else v.dtype
                for k, v in self.backend.to_hf(self.backend.named_state()).items()}

    def published_difference(self, state: dict[str, torch.Tensor],
                             part: bool = False) -> str | None:
        """The name of the first tensor of ``published_state()`` whose bytes (dtype,
        shape, values) differ from ``state``'s (full tensors by Hugging Face name, any
        device), or that one side lacks; None when they are equal. Under a group each rank
        compares its own part (``published_part``) with the same rows of ``state`` and the
        ranks agree on the answer (a collective: every rank calls it); nothing is
        gathered, so a rank holds no more than its part beside ``state``. ``part``:
        ``state`` is this rank's part alone, as ``published_part`` gives it (what a
        follower of this rank's part holds: ``WeightFollower(part=...)``)."""
        if not self.sharded:
            mine, rows = self.published_state(), {}
            names = list(mine)
        else:
            mine, rows = self.published_part()
            names = list(self.backend.named_state())
        expected = set(mine) if part else set(names)
        unknown = sorted(set(state) - set(names))  # a name no tensor has: told first
        # else the first name one side lacks, in names' order
        first = 0 if unknown else min((names.index(k) for k in expected ^ set(state)),
                                      default=len(names))
        for i, k in enumerate(names[:first]):
            if k not in mine:  # a rank holding none of its rows
                continue
            want = state[k]
            if k in rows and not part:
                if tuple(want.shape) != tuple(rows[k].shape):
                    first = i
                    break
                want = want[rows[k].start:rows[k].stop]
            if not _same_bytes(mine[k], want):
                first = i
                break
        # the lowest index any rank found
        first = -int(self.group.max_floats({"first": -float(first)})["first"])
        if first == len(names):
            return None
        return unknown[0] if unknown else names[first]

    def load_weights(self, state: dict[str, torch.Tensor], part: bool = False) -> None:
        """Every weight from ``state`` (full tensors by Hugging Face name, any device):
        parameters and masters; under a group each rank takes its own rows. ``part``:
        ``state`` is this rank's part alone (``published_part``'s names and shapes)."""
        self._load_model_state(state, part)

    def snapshot(self, version: int) -> StateSnapshot:
        """CPU copies of the optimizer state and (when ``keeps_master``) the master weights,
        to be serialized while training goes on."""
        self._no_group("snapshot")
        master = self.state_dict() if self.keeps_master else None
        return StateSnapshot.of(version, self.optimizer.state_dict(), master)

    def _no_group(self, what: str) -> None:
        if self.sharded:
            raise ValueError(f"{what} holds one process's whole state: with a process group "
                             "the trainer state goes through astraflow.trainer.checkpoint")

    def master_bytes(self) -> bytes:
        """The trained weights, serialized bit-exactly (``torch.save``)."""
        buf = io.BytesIO()
        torch.save({k: v.cpu() for k, v in self.state_dict().items()}, buf)
        return buf.getvalue()

    def load_master_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        mine = self.state_dict()
        bad = [k for k, v in state.items() if k in mine and mine[k].dtype != v.dtype]
        if bad:
            raise ValueError(
                f"master weights are {state[bad[0]].dtype} ({bad[0]}), the model trains in "
                f"{mine[bad[0]].dtype}: restart with the --dtype the run was started with"
            )
        self._load_model_state(state)

    def optimizer_bytes(self) -> bytes:
        self._no_group("optimizer_bytes")
        buf = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buf)
        return buf.getvalue()

    def load_optimizer_bytes(self, data: bytes) -> None:
        self._no_group("load_optimizer_bytes")
        state = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)

    # --- the step ------------------------------------------------------------------------
    def _rows(self, batch: Batch) -> list[_Row]:
        policy = self.policy or batch.policy
        rows: list[_Row] = []
        for gi, g in enumerate(batch.groups):
            seqs = [s for s in g.sequences if not s.policy or not policy or s.policy == policy]
            if not seqs:
                continue
            adv = unit_advantages([s.reward for s in seqs], self._units(seqs),
                                  self.spec.std_normalize)
            for s, a in zip(seqs, adv.tolist()):
                n = len(s.token_ids)
                if len(s.loss_mask) != n or len(s.logprobs) != n:
                    raise ValueError(
                        f"batch {batch.batch_id} group {g.group_id}: token_ids ({n}), "
                        f"loss_mask ({len(s.loss_mask)}) and logprobs ({len(s.logprobs)}) "
                        "must have the same length"
                    )
                rows.append(_Row(s, a, gi))
        return rows

    def _units(self, seqs: list[Sequence]) -> list[tuple[str, str | int]]:
        """The member of its group's statistics each of one policy's ``seqs`` is
        (``group_unit``): with ``episode``, the sequences an episode was recorded as share
        one (a workflow names a sequence's episode in ``meta["episode"]``, as the agent
        workflow does; a sequence without it is an episode of its own); with
        ``sequence``, each sequence is one."""
        if self.spec.group_unit == "sequence":
            return [("sequence", i) for i in range(len(seqs))]
        return [("episode", s.meta[EPISODE_META]) if EPISODE_META in s.meta
                else ("sequence", i) for i, s in enumerate(seqs)]

    def micro_batches(self, rows: list[_Row]) -> list[list[_Row]]:
        """``rows`` cut into forward/backward passes: ``micro_batch_size`` sequences in
        order, or, with ``micro_batch_tokens``, sorted longest first and packed while the
        padded size (sequences x longest) stays within the budget (a longer one alone)."""
        c = self.spec
        if c.micro_batch_tokens is None:
            size = max(1, c.micro_batch_size)
            return [rows[i : i + size] for i in range(0, len(rows), size)]
        parts: list[list[_Row]] = []
        for r in sorted(rows, key=lambda r: len(r.seq.token_ids), reverse=True):
            # the first row of a part is its longest: the padded width
            if parts and len(parts[-1][0].seq.token_ids) * (len(parts[-1]) + 1) <= (
                c.micro_batch_tokens
            ):
                parts[-1].append(r)
            else:
                parts.append([r])
        return parts

    def passes(self, rows: list[_Row]) -> list[tuple[bool, list[_Row]]]:
        """The forward/backward passes over ``rows``: ``(shared, micro_batch)``.

        With ``share_prompt``, rows are ordered by their prompt (the tokens before the first
        loss-mask token), and a pass runs each of its prompts once for all of its rows
        (``shared`` true). Its rows are cut as ``micro_batch_size`` says, across prompts: a
        batch of 4 prompts x 8 samples and ``micro_batch_size: 32`` is one pass of 4
        prompts, cheaper for a trainer with its cores to itself than 4 passes of one (each
        pass reads every weight about 3 times; docs/trainer.md). With
        ``micro_batch_tokens`` each prompt's rows are packed apart.
        Otherwise ``shared`` is false and the micro-batches are ``micro_batches(rows)``.

        Under a group: the passes of this rank's share of ``rows`` (``share``), never a
        shared prompt."""
        c = self.spec
        if self.sharded:
            return [(False, part) for part in self.micro_batches(self.share(rows))]
        if not c.share_prompt or c.gradient_checkpointing or not self.backend.shares_prompt:
            return [(False, part) for part in self.micro_batches(rows)]
        by_prompt: dict[tuple[int, ...], list[_Row]] = {}
        for r in rows:
            by_prompt.setdefault(tuple(r.seq.token_ids[:_prompt_len(r)]), []).append(r)
        if c.micro_batch_tokens is not None:
            return [(True, part) for group in by_prompt.values()
                    for part in self.micro_batches(group)]
        return [(True, part) for part in self.micro_batches(
            [r for group in by_prompt.values() for r in group])]

    def share(self, rows: list[_Row]) -> list[_Row]:
        """The rows this rank trains (all of them without a group): whole groups, each
        given, the groups with most tokens first, to the rank with the fewest tokens so far
        (the lowest rank on a tie); in their order in ``rows``."""
        if not self.sharded:
            return rows
        owner = deal_groups(rows, self.group.world)
        return [r for r in rows if owner[r.group] == self.group.rank]

    def shared_prompt_logprobs(self, ids: torch.Tensor, attn: torch.Tensor,
                               prompt_lens: list[int]) -> torch.Tensor:
        """``token_logprobs`` of right-padded rows (as ``_tensors`` makes them) whose first
        ``prompt_lens[i]`` tokens are a prompt, each distinct prompt run once: its keys and
        values are repeated for its rows, and their own tokens attend to them. Columns
        before a row's prompt end are 0; the gradient is the one of ``token_logprobs``."""
        k, n = ids.shape
        lengths = attn.sum(1).tolist()
        if any(not 1 <= p < m for p, m in zip(prompt_lens, lengths)):
            raise ValueError(f"prompt lengths {prompt_lens} outside 1..row length - 1 "
                             f"({lengths})")
        index: dict[tuple[int, ...], int] = {}
        owner = [index.setdefault(tuple(ids[i, :p].tolist()), len(index))
                 for i, p in enumerate(prompt_lens)]
        width = max(prompt_lens)
        prompts = torch.full((len(index), width), PAD_TOKEN_ID, dtype=torch.long)
        prompt_attn = torch.zeros((len(index), width), dtype=torch.long)
        for g, prompt in enumerate(index):  # in the order of their indices
            prompts[g, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            prompt_attn[g, :len(prompt)] = 1
        span = max(m - p for p, m in zip(prompt_lens, lengths))
        tails = torch.full((k, span), PAD_TOKEN_ID, dtype=torch.long)
        tail_attn = torch.zeros((k, span), dtype=torch.long)
        for i, (p, m) in enumerate(zip(prompt_lens, lengths)):
            tails[i, :m - p] = ids[i, p:m]
            tail_attn[i, :m - p] = 1
        dev = self.device
        tails = tails.to(dev)
        with self._autocast():
            first, tail = self.backend.shared_prompt_logits(
                prompts.to(dev), prompt_attn.to(dev), tails, tail_attn.to(dev),
                torch.tensor(owner, device=dev))
        lp = self._picked_logprobs(torch.cat([first, tail[:, :-1]], dim=1), tails)
        # each row's tail back to its own columns, past a scratch width that the padding of
        # the shorter rows' tails lands in
        cols = torch.tensor(prompt_lens, device=dev)[:, None] + torch.arange(span, device=dev)
        return lp.new_zeros((k, n + span)).scatter(1, cols, lp)[:, :n]

    def _tensors(self, rows: list[_Row]):
        """Right-padded ids, attention mask, behaviour log-probs, loss mask, advantages."""
        n = max(len(r.seq.token_ids) for r in rows)
        b = len(rows)
        ids = torch.full((b, n), PAD_TOKEN_ID, dtype=torch.long)
        attn = torch.zeros((b, n), dtype=torch.long)
        behaviour = torch.zeros((b, n), dtype=torch.float32)
        mask = torch.zeros((b, n), dtype=torch.float32)
        for i, r in enumerate(rows):
            k = len(r.seq.token_ids)
            ids[i, :k] = torch.tensor(r.seq.token_ids, dtype=torch.long)
            attn[i, :k] = 1
            behaviour[i, :k] = torch.tensor(r.seq.logprobs, dtype=torch.float32)
            mask[i, :k] = torch.tensor(r.seq.loss_mask, dtype=torch.float32)
        mask[:, 0] = 0.0  # the first token has no prefix to be predicted from
        mask = (mask > 0).float()
        adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)[:, None]
        return ids, attn, behaviour, mask, adv

    def _autocast(self):
        if self.autocast == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def token_logprobs(
        self, ids: torch.Tensor, attn: torch.Tensor, start: int = 0
    ) -> torch.Tensor:
        """The sampling distribution's log-prob of each token given its prefix (temperature,
        top-p; see the module doc), in float32, for tokens ``t > start``; columns
        ``0..start`` are 0. ``start`` lets the model compute logits only from that column on
        (``logits_to_keep``): prompts need none."""
        n = ids.shape[1]
        start = max(0, min(start, n - 1))
        with self._autocast():
            logits = self.backend.logits(ids.to(self.device), attn.to(self.device), start)
        lp = self._picked_logprobs(logits[:, :-1], ids[:, start + 1 :].to(self.device))
        return torch.cat([lp.new_zeros((lp.shape[0], start + 1)), lp], dim=1)

    def _picked_logprobs(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The sampling distribution's log-prob at ``target`` (temperature, top-p; see the
        module doc), in float32 (the loss side stays in float32, outside autocast)."""
        return picked_logprobs(logits, target, self.temperature, self.top_p)

    def _pass_logprobs(self, shared: bool, part: list[_Row],
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(new log-probs, behaviour, loss mask, advantages)`` of one pass on the
        device, or None when it has no loss token."""
        ids, attn, behaviour, mask, adv = self._tensors(part)
        cols = mask.any(0).nonzero()
        if len(cols) == 0:
            return None
        # a row without a loss token trains nothing: its last token stands in as its tail
        prompt_lens = [min(_prompt_len(r), len(r.seq.token_ids) - 1) for r in part]
        if shared and min(prompt_lens) >= 1:
            new = self.shared_prompt_logprobs(ids, attn, prompt_lens)
        else:
            new = self.token_logprobs(ids, attn, start=int(cols[0]) - 1)
        dev = self.device
        return new, behaviour.to(dev), mask.to(dev), adv.to(dev)

    def _each_pass(self, passes: list[tuple[bool, list[_Row]]], backward: bool = False,
                   ) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
        """``(index, _pass_logprobs(...))`` of each of ``passes`` that has a loss token.
        Under a group, every rank makes as many forward passes as the rank with most
        (FSDP2's collectives pair up across ranks): where this rank has none left, or a
        pass without a loss token, it runs ``_dummy_pass`` (with its backward pass when
        ``backward``: the caller runs the backward pass of what it is given)."""
        n = int(self.group.max_floats({"passes": float(len(passes))})["passes"])
        try:
            for i in range(n):
                if self.sharded and backward:
                    # gradients stay unsharded and summed on each rank until the step's
                    # last backward pass, which reduce-scatters them once (the same pass on
                    # every rank: all make n); the cost, an unsharded gradient per layer
                    self.model.set_requires_gradient_sync(i == n - 1)
                got = self._pass_logprobs(*passes[i]) if i < len(passes) else None
                if got is not None:
                    yield i, got
                elif self.sharded:
                    self._dummy_pass(backward)
        finally:
            if self.sharded and backward:
                self.model.set_requires_gradient_sync(True)

    def _dummy_pass(self, backward: bool) -> None:
        """A forward (and backward) pass that changes nothing: two pad tokens, loss 0 times
        their logits (a zero gradient), for the collectives of the other ranks' pass."""
        ids = torch.full((1, 2), PAD_TOKEN_ID, dtype=torch.long, device=self.device)
        with self._autocast():
            logits = self.backend.logits(ids, torch.ones_like(ids), 0)
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _loss_options(self, live: list[_Row]) -> dict[str, float]:
        """The keyword arguments of every loss call: the hyperparameters, and what the
        loss's ``batch_stats`` computes from the whole batch (``m2po``'s cut). That takes a
        no-grad forward pass over ``live`` first: the gradient of the first micro-batch
        already depends on the tokens of all of them."""
        c = self.spec
        options = {"clip_low": c.clip_low, "clip_high": c.clip_high, "tis_cap": c.tis_cap,
                   "m2_threshold": c.m2_threshold, "tis_mask": c.tis_mask}
        stats = BATCH_STATS.get(c.loss)
        if stats is None:
            return options
        ratios = []
        with torch.no_grad():
            for _, (new, behaviour, mask, _) in self._each_pass(self.passes(live)):
                ratios.append((new - behaviour)[mask > 0])
        log_ratio = torch.cat(ratios) if ratios else torch.zeros(0, device=self.device)
        # the statistics of the whole batch: every rank's tokens
        log_ratio = self.group.all_gather_rows(log_ratio)
        return {**options, **stats(log_ratio, **options)}

    def _accumulate(self, live: list[_Row], total_tokens: int,
                    proximal: list[torch.Tensor | None] | None = None) -> dict[str, Any]:
        """Forward/backward of every micro-batch of ``live``, gradients summed.
        ``proximal``: per pass of ``passes(live)``, the proximal policy's log-probs (a loss
        that reads ``logprobs_proximal``); None: the policy of this step itself."""
        loss_fn = get_loss(self.spec.loss)
        options = self._loss_options(live)
        acc = _new_acc()
        for i, (new, behaviour, mask, adv) in self._each_pass(self.passes(live), backward=True):
            extra = {} if proximal is None else {"logprobs_proximal": proximal[i]}
            out = loss_fn(new, behaviour, adv, mask, num_tokens=total_tokens, **options,
                          **extra)
            out.loss.backward()
            acc["loss"] += float(out.loss.detach())
            acc["micro_batches"] += 1
            acc["padded_tokens"] += new.numel()
            for k, v in out.sums.items():
                if k != "ratio_max":
                    acc["sums"][k] = acc["sums"].get(k, 0.0) + v
            acc["ratio_max"] = max(acc["ratio_max"], out.sums.get("ratio_max", 0.0))
            outside = (new.detach() <= LOGPROB_FLOOR) & (mask > 0)
            acc["sums"]["outside_nucleus_frac"] += float(outside.sum())
        # every rank reports the figures of the whole batch
        total = self.group.sum_floats({
            "loss": acc["loss"], "micro_batches": acc["micro_batches"],
            "padded_tokens": acc["padded_tokens"],
            **{f"sums/{k}": v for k, v in acc["sums"].items()}})
        acc["loss"] = total["loss"]
        acc["micro_batches"] = int(total["micro_batches"])
        acc["padded_tokens"] = int(total["padded_tokens"])
        acc["sums"] = {k: total[f"sums/{k}"] for k in acc["sums"]}
        acc["ratio_max"] = self.group.max_floats({"r": acc["ratio_max"]})["r"]
        return acc

    def minibatches(self, rows: list[_Row]) -> list[list[_Row]]:
        """``rows`` cut into ``spec.minibatches`` parts of whole groups, in order, as
        even in groups as they divide (fewer parts when the batch has fewer groups)."""
        groups: dict[int, list[_Row]] = {}
        for r in rows:
            groups.setdefault(r.group, []).append(r)
        parts = list(groups.values())
        k = min(self.spec.minibatches, len(parts))
        if k <= 1:
            return [rows]
        return [[r for g in parts[i * len(parts) // k:(i + 1) * len(parts) // k] for r in g]
                for i in range(k)]

    def _proximal(self, parts: list[list[_Row]]) -> list[list[torch.Tensor | None] | None]:
        """Per minibatch, the log-probs of its live rows' passes under the current weights
        (no gradient), taken before the first step: the proximal policy of a loss that
        reads one. None for the first (its own forward is that policy) and for every part
        when the loss reads none."""
        if len(parts) == 1 or not self._reads_proximal:
            return [None] * len(parts)
        out: list[list[torch.Tensor | None] | None] = [None]
        with torch.no_grad():
            for part in parts[1:]:
                passes = self.passes([r for r in part if r.advantage != 0.0])
                logprobs: list[torch.Tensor | None] = [None] * len(passes)
                for i, got in self._each_pass(passes):
                    logprobs[i] = got[0].detach()
                out.append(logprobs)
        return out

    def _optimizer_step(self, total_tokens: int) -> float:
        """Clip and apply the accumulated gradients; the gradient norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = 0.0
        if total_tokens > 0:
            if self._masters:
                if self.forward_dtype != "bf16":  # bf16: each pass summed them in already
                    for p, m in self._masters:
                        m.grad, p.grad = p.grad, None
                params = [m for _, m in self._masters]
            for p in params:  # a step on zero gradients still moves Adam's moments
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            norm = torch.nn.utils.clip_grad_norm_(params, self.spec.max_grad_norm)
            # DTensor gradients (a group): the norm of the whole gradient, on every rank
            grad_norm = float(norm.full_tensor() if _is_dtensor(norm) else norm)
            self._before_update()
            self.optimizer.step()
            self._round_params()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        return grad_norm

    def hold_updates(self, until: Callable[[], Any]) -> None:
        """Call ``until`` (it blocks) before the trained tensors next change: a checkpoint
        (``astraflow.trainer.checkpoint``) is copying them meanwhile."""
        self._update_guard = until

    def _before_update(self) -> None:
        guard, self._update_guard = self._update_guard, None
        if guard is not None:
            guard()

    def _sync(self) -> float:
        """``perf_counter`` after the device finished its queued work (for timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def train_step(self, batch: Batch, current_version: int | None = None) -> dict[str, float]:
        """One batch: ``spec.minibatches`` optimizer steps (one by default); returns
        ``trainer/*`` metrics.

        ``current_version``: the weight version being trained from (only for the staleness
        metrics: how many versions behind it the batch's generated tokens are).
        """
        t0 = time.perf_counter()
        stale_dropped = 0
        if self.max_staleness is not None and current_version is not None:
            kept = [g for g in batch.groups
                    if _group_staleness(g, self.policy, current_version) <= self.max_staleness]
            stale_dropped = len(batch.groups) - len(kept)
            batch = dataclasses.replace(batch, groups=kept)
        rows = self._rows(batch)
        with self._dropout_rng():
            acc = self._steps(rows)
        # the schedule (and LoRA's dropout seed) counts trained batches, i.e. published
        # versions: a batch that trains nothing (every group stale) leaves it as it is
        self.steps += int(acc["tokens"] > 0)
        rewards = [r.seq.reward for r in rows]
        metrics = {
            "trainer/loss": acc["loss"],
            "trainer/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "trainer/grad_norm": acc["grad_norm"],
            "trainer/lr": acc["lr"],
            "trainer/sequences": float(len(rows)),
            "trainer/loss_tokens": float(acc["tokens"]),
            "trainer/zero_advantage_frac": 1.0 - acc["live"] / len(rows) if rows else 0.0,
            "trainer/ratio_max": acc["ratio_max"],
            "trainer/micro_batches": float(acc["micro_batches"]),
            "trainer/minibatches": float(acc["minibatches"]),
            "trainer/padded_tokens": float(acc["padded_tokens"]),
            "trainer/forward_backward_seconds": acc["forward_backward_seconds"],
            "trainer/optimizer_seconds": acc["optimizer_seconds"],
            "trainer/step_seconds": time.perf_counter() - t0,
            "trainer/stale_dropped_groups": float(stale_dropped),
        }
        denom = max(acc["live_tokens"], 1)  # the ratio and clipping figures: of trained tokens
        for k, total in acc["sums"].items():
            metrics[f"trainer/{k}"] = total / denom
        metrics.update(_staleness_metrics(rows, current_version))
        return metrics

    @contextlib.contextmanager
    def _dropout_rng(self) -> Iterator[None]:
        """With LoRA dropout, the step's random draws come from torch's generator seeded by
        the step number (restored after): a resumed or replayed step drops the same
        units, so it trains the same adapter bit for bit. Nothing without dropout."""
        if self.lora is None or self.lora.dropout <= 0:
            yield
            return
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(self.steps)
            yield

    def _steps(self, rows: list[_Row]) -> dict[str, Any]:
        """The optimizer steps on ``rows``, one per minibatch, with their figures summed
        (``loss`` and ``grad_norm``: their means)."""
        total = _new_acc()
        total.update(tokens=0, live=0, live_tokens=0, grad_norm=0.0, minibatches=0,
                     forward_backward_seconds=0.0, optimizer_seconds=0.0)
        t0 = time.perf_counter()
        total["lr"] = self.schedule.at(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = total["lr"]
        parts = self.minibatches(rows)
        proximal = self._proximal(parts)
        for part, prox in zip(parts, proximal):
            tokens = [sum(1 for m in r.seq.loss_mask[1:] if m) for r in part]
            # A sequence with advantage 0 (every one of a group whose rewards are all
            # equal) adds exactly 0 to the loss and its gradient: it is left out of the
            # passes. The loss is still divided by the tokens of all sequences, so the
            # update is the one the whole part gives.
            live = [r for r in part if r.advantage != 0.0]
            self.optimizer.zero_grad(set_to_none=True)
            acc = self._accumulate(live, sum(tokens), prox)
            t1 = self._sync()
            total["grad_norm"] += self._optimizer_step(sum(tokens)) / len(parts)
            t2 = self._sync()
            total["forward_backward_seconds"] += t1 - t0
            total["optimizer_seconds"] += t2 - t1
            t0 = t2
            total["tokens"] += sum(tokens)
            total["live"] += len(live)
            total["live_tokens"] += sum(t for t, r in zip(tokens, part) if r.advantage != 0.0)
            total["minibatches"] += 1
            total["loss"] += acc["loss"] / len(parts)  # each part's loss is a token mean
            for k in ("micro_batches", "padded_tokens"):
                total[k] += acc[k]
            total["ratio_max"] = max(total["ratio_max"], acc["ratio_max"])
            for k, v in acc["sums"].items():
                total["sums"][k] = total["sums"].get(k, 0.0) + v
        return total


def _add_grad_to(master: torch.Tensor, param: torch.Tensor) -> None:
    """A bf16-held parameter's gradient of one backward pass, summed into its fp32 master
    (the sum over micro-batches stays in fp32) and cleared."""
    if master.grad is None:
        master.grad = param.grad.to(master.dtype)
    else:
        master.grad.add_(param.grad)
    param.grad = None


def adam_kwargs(impl: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """``torch.optim.AdamW``'s keyword for implementation ``impl`` of ``ADAM_IMPLS``.
    "auto" picks fused when torch has a fused kernel for every parameter's device and
    dtype (CPU and CUDA do: one kernel over all tensors), else torch's own default
    (foreach on CUDA, a loop elsewhere); the choice is logged."""
    if impl == "auto":
        devices = set(_get_fused_kernels_supported_devices())
        fusable = all(p.device.type in devices and p.is_floating_point() for p in params)
        log.info("AdamW: %s", "fused (adam_impl auto: a fused kernel for the parameters' "
                 "device)" if fusable else "torch's default (adam_impl auto: no fused "
                 "kernel for some parameter's device or dtype)")
        return {"fused": True} if fusable else {}
    return {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for-loop": {"foreach": False}}[impl]


def deal_groups(rows: list[_Row], world: int) -> dict[int, int]:
    """Group index -> the rank that trains it: the groups with most tokens first, each to
    the rank with the fewest tokens so far (the lowest rank on a tie)."""
    tokens: dict[int, int] = {}
    for r in rows:
        tokens[r.group] = tokens.get(r.group, 0) + len(r.seq.token_ids)
    load = [0] * world
    owner: dict[int, int] = {}
    for g, n in sorted(tokens.items(), key=lambda kv: (-kv[1], kv[0])):
        rank = min(range(world), key=lambda i: (load[i], i))
        owner[g] = rank
        load[rank] += n
    return owner


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _check_group(trainer: Trainer, group: Group) -> None:
    """``ValueError`` (one line) for a configuration that cannot train in ``group``: one
    that cannot be sharded over several ranks, or a device other than the group's."""
    c = trainer.spec
    if not isinstance(group, Group):
        raise TypeError(f"group must be an astraflow.trainer.parallel.Group (join()), got "
                        f"{type(group).__name__}")
    if torch.device(c.device).type != group.device.type:
        raise ValueError(f"device (--device) {c.device!r} does not match the process group's "
                         f"device {group.device} (join(device=...))")
    if not trainer.sharded:  # a group of one trains as one process does
        return
    if c.backend != "torch":
        raise ValueError(f"backend (--backend) must be 'torch' with a process group (FSDP2 "
                         f"shards transformers models), got {c.backend!r}")
    if trainer.lora is not None:
        raise ValueError("lora: an adapter trains in one process, not over a process group")
    if c.forward_dtype == "bf16":
        raise ValueError("forward_dtype (--forward-dtype) bf16 holds the weights in one "
                         "process, not over a process group: fp32 or best (fp32 there)")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and raw bytes (NaNs compare by
    their bits), on ``a``'s device."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().reshape(-1).view(bits),
                       b.detach().to(a.device).reshape(-1).view(bits))


def _weight_files(model_path: str) -> dict[str, str] | None:
    """Tensor name -> the safetensors file of ``model_path`` holding it, when its weights
    are all in safetensors files (``model.safetensors``, or the shards an index names);
    None otherwise (the model is then loaded whole, as without a group)."""
    import json
    from pathlib import Path

    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text()).get("weight_map", {})
        files = {k: str(root / f) for k, f in names.items()}
        return files if files and all(Path(f).is_file() for f in files.values()) else None
    single = root / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), str(single))


def _meta_model(model_path: str, dtype: torch.dtype) -> Any:
    """The transformers causal LM of ``model_path`` (its config) built on the meta device:
    no memory, no initialisation; ``Trainer._sharded_load`` allocates and fills it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from astraflow.models.loading import check_model_dir

    check_model_dir(model_path, tokenizer=False)
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def _rebuilt_buffers(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The non-persistent buffers of a model built on the meta device, computed on
    ``device``: each module holding one is built again from its ``config`` (what
    transformers' rotary embeddings are made from), its buffers taken. ``ValueError`` for
    a module that cannot be (its buffers would be garbage)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in model.named_modules():
        names = [n for n in m._non_persistent_buffers_set if m._buffers.get(n) is not None]
        if not names:
            continue
        config = getattr(m, "config", None)
        try:
            with torch.device(device):
                fresh = type(m)(config)
        except Exception as e:  # noqa: BLE001 - any failure: say which module
            raise ValueError(f"{prefix or type(m).__name__}: its buffers {names} cannot be "
                             f"computed again for a sharded load ({e})") from e
        for n in names:
            out[f"{prefix}.{n}" if prefix else n] = fresh.get_buffer(n).to(device)
    return out


def _fully_shard(model: torch.nn.Module, group: Group, mp_policy: Any = None) -> None:
    """FSDP2 on each decoder layer (the classes transformers names in
    ``_no_split_modules``) and on the root; gradients summed over the ranks, not averaged:
    each rank's loss is already divided by the token count of the whole batch.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (None: gathers and reductions in the
    parameters' dtype)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layer to shard (none of the "
                         f"classes in _no_split_modules {sorted(names)})")
    mp = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in layers:
        fully_shard(layer, mesh=group.mesh, **mp)
    # the root too frees its gathered weights after each forward pass (FSDP2 keeps them by
    # default until the backward pass): a no-grad pass (batch statistics, the proximal
    # policy) not followed by a backward pass before the optimizer step would otherwise
    # leave stale weights for the next forward pass
    fully_shard(model, mesh=group.mesh, reshard_after_forward=True, **mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
                m.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no PREMUL_SUM


def _new_acc() -> dict[str, Any]:
    """The figures ``_accumulate`` sums over passes."""
    sums = dict.fromkeys(SUM_KEYS, 0.0)
    sums["outside_nucleus_frac"] = 0.0
    return {"loss": 0.0, "ratio_max": 0.0, "micro_batches": 0, "padded_tokens": 0,
            "sums": sums}


def _staleness_metrics(rows: list[_Row], current_version: int | None) -> dict[str, float]:
    """How many versions behind ``current_version`` the trained tokens were generated."""
    if current_version is None:
        return {}
    lags = [current_version - v for r in rows
            for v, m in zip(r.seq.versions, r.seq.loss_mask) if m and v >= 0]
    if not lags:
        return {}
    return {"trainer/staleness_mean": sum(lags) / len(lags),
            "trainer/staleness_max": float(max(lags))}


def _group_staleness(group, policy: str, current_version: int) -> int:
    """Versions between ``current_version`` and the group's oldest generated token."""
    versions = [v for s in group.sequences if s.policy == policy for v in s.versions if v >= 0]
    return current_version - min(versions) if versions else 0


__all__ = ["DTYPES", "PAD_TOKEN_ID", "Trainer", "bf16_forward_blocker", "chosen_autocast",
           "chosen_forward_dtype", "deal_groups", "lr_schedule"]

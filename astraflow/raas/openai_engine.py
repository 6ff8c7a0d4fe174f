"""``OpenAIEngine``: a policy served elsewhere behind an OpenAI-compatible completions
endpoint (``vllm serve``, SGLang, llama.cpp server), as an ``Engine``.

One ``generate`` call is one ``POST <base_url>/completions`` with the prompts as token
ids (a list of lists), ``n`` samples each and ``logprobs: 0`` (the sampled token's
log-probability). The generated token ids come from the response's ``token_ids`` (vLLM's
``return_token_ids``) or from ``logprobs.tokens`` written as ``token_id:N`` (vLLM's
``return_tokens_as_token_ids``); a server that returns neither is refused with a clear
error, since re-tokenising text does not give back the sampled ids.

Log-probabilities are what the server reports. For the convention of ``TorchEngine`` and
the trainer (the sampled distribution: ``softmax(logits / T)``, renormalised over the
top-p nucleus; ``astraflow.models.sampling``), start vLLM with ``--logprobs-mode
processed_logprobs`` (its default, ``raw_logprobs``, ignores temperature and top-p).
Sampling settings the server would take from the model's ``generation_config`` (top-k,
penalties) are sent neutral.

The policy is frozen: every token carries the fixed ``version``, and new weights are
ignored (with one warning), unless a reload hook is configured. ``reload``: a URL that
gets ``POST {"policy", "version"}`` and must answer 2xx once the server holds that
version (how the server gets the weights is its business), a ``"module:function"``
import path, or (from Python) a callable; a callable is called as ``hook(state,
version)``. After a successful hook the engine's version is the new one.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from astraflow.config.options import OpenAIEngineOptions
from astraflow.config.sections import engine_options
from astraflow.raas.engine import Generation, SamplingParams
from astraflow.raas.hf_text import HFText, load_tokenizer

log = logging.getLogger("astraflow.raas.openai")


class OpenAIEngine(HFText):
    """An ``Engine`` on an OpenAI-compatible completions server (see the module
    docstring), as its typed ``options`` say. ``tokenizer``: the served model's Hugging
    Face tokenizer; ``hook``: a callable reload hook, given from Python (instead of
    ``options.reload``)."""

    def __init__(self, options: OpenAIEngineOptions, tokenizer: Any, policy: str = "actor",
                 hook: Callable[[Mapping[str, torch.Tensor], int], Any] | None = None):
        import httpx

        self.options = options
        self.tokenizer = tokenizer
        self.policy = policy
        self.version = options.version
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.http = httpx.Client(base_url=options.base_url.rstrip("/"), headers=headers,
                                 timeout=options.timeout_s)
        self.model = options.model or self._first_model()
        self._hook = hook if hook is not None else _resolve_hook(options.reload)
        self._lock = threading.Lock()
        self._warned_frozen = False
        self.tokens_generated = 0
        self.seconds_generating = 0.0

    def _first_model(self) -> str:
        r = self.http.get("/models")
        r.raise_for_status()
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.options.base_url}/models lists no model")
        return str(data[0]["id"])

    # --- weights ---------------------------------------------------------------------------
    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Run the reload hook, then hold ``version``; without a hook the policy is frozen
        and the new weights are ignored."""
        if self._hook is None:
            if not self._warned_frozen:
                log.warning("%s: frozen policy (openai engine without a reload hook): "
                            "ignoring version %d, tokens keep version %d",
                            self.policy, version, self.version)
                self._warned_frozen = True
            return
        with self._lock:
            if isinstance(self._hook, str):
                r = self.http.post(self._hook, json={"policy": self.policy, "version": version})
                r.raise_for_status()
            else:
                self._hook(state, version)
            self.version = version

    # --- generation ------------------------------------------------------------------------
    def request_body(self, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
        """The completions request for ``prompts``."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [list(p) for p in prompts],
            "n": params.n,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
            "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "stop_token_ids": list(params.stop_token_ids),
            "include_stop_str_in_output": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            # one request carries every prompt, and the API takes one seed for it: keyed
            # seeds (SamplingParams.keys) cannot be honoured per prompt here, so the call
            # is seeded as a whole
            body["seed"] = params.seed
        return body

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        """``params.n`` samples for each prompt: ``out[i][j]`` is sample j of prompt i."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: give at least one token")
        t0 = time.perf_counter()
        with self._lock:
            version = self.version
            r = self.http.post("/completions", json=self.request_body(prompts, params))
        if r.status_code >= 400:
            raise RuntimeError(f"{self.options.base_url}/completions: HTTP {r.status_code}: "
                               f"{r.text[:300]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * params.n:
            raise RuntimeError(f"{self.options.base_url}: {len(choices)} choices for "
                               f"{len(prompts)} prompts x n={params.n}")
        gens = [_generation(p, c, version) for p, c in
                zip((p for p in prompts for _ in range(params.n)), choices)]
        self.tokens_generated += sum(len(g.token_ids) for g in gens)
        self.seconds_generating += time.perf_counter() - t0
        return [gens[i * params.n: (i + 1) * params.n] for i in range(len(prompts))]

    def close(self) -> None:
        self.http.close()


def _token_ids(choice: dict[str, Any]) -> list[int]:
    ids = choice.get("token_ids")
    if ids is not None:
        return [int(t) for t in ids]
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    if all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    raise RuntimeError("the server returned no token ids (needs vLLM's return_token_ids or "
                       "return_tokens_as_token_ids)")


def _generation(prompt: list[int], choice: dict[str, Any], version: int) -> Generation:
    ids = _token_ids(choice)
    lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(lps) != len(ids):
        raise RuntimeError(f"the server returned {len(lps)} log-probs for {len(ids)} tokens")
    return Generation(
        prompt_ids=list(prompt),
        token_ids=ids,
        logprobs=[float(x) for x in lps],
        finish_reason="stop" if choice.get("finish_reason") == "stop" else "length",
        versions=[version] * len(ids),
    )


def _resolve_hook(hook: Any) -> str | Callable | None:
    """The reload hook: a URL (kept as a string), an imported ``module:function``, a
    callable, or None."""
    if hook is None or callable(hook):
        return hook
    if isinstance(hook, str) and hook.startswith(("http://", "https://")):
        return hook
    if isinstance(hook, str) and ":" in hook:
        module, _, name = hook.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"openai engine option 'reload': cannot import {hook!r}: {e}") from e
        if callable(fn):
            return fn
    raise ValueError(f"openai engine option 'reload': {hook!r} is not a URL, "
                     "a module:function path or a callable")


def load_openai_engine(path: str | Path, policy: str,
                       options: OpenAIEngineOptions | None = None,
                       **given: Any) -> OpenAIEngine:
    """An ``OpenAIEngine`` for the model whose tokenizer is in ``path`` (a local model
    directory); ``options``: its typed options, else the fields of
    ``OpenAIEngineOptions`` as keywords ``given`` (a refused or missing one raises
    ``ValueError`` naming it; from Python, ``reload`` may be a callable)."""
    if options is not None and given:
        raise TypeError("load_openai_engine: options or their fields as keywords, not both")
    hook = given.pop("reload") if callable(given.get("reload")) else None
    opts = options if options is not None else engine_options("openai", given)
    if hook is None:
        _resolve_hook(opts.reload)  # a bad hook fails before anything else
    return OpenAIEngine(opts, load_tokenizer(path), policy=policy, hook=hook)


__all__ = ["OpenAIEngine", "load_openai_engine"]

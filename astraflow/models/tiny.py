"""The tiny local causal LM for CPU runs: a small Llama-architecture model with a
character-level tokenizer, written in Hugging Face format so that
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
load it like any checkpoint. The prompt is fed as is (no chat template); the completion
is the answer text followed by the end-of-sequence token."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

from astraflow.models.errors import ModelError

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
    with seeded(seed):
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        do_sample=False,
    )
    model.to(torch.float32)
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    free = shutil.disk_usage(out).free
    if free < need + (16 << 20):  # the weights, the tokenizer and some room to spare
        raise ModelError(f"too little disk for the model in {out}: {need / 1e6:.0f} MB "
                         f"needed, {free / 1e6:.0f} MB free; free some space, or point the "
                         "policy's model (policies.<name>.model) at a disk with room")
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


def save_trained(model, tokenizer, dir: str | Path) -> None:
    """Save a trained ``model`` over ``dir``, and its tokenizer when ``dir`` has a fast one."""
    model.save_pretrained(dir)
    if (Path(dir) / "tokenizer.json").is_file():
        save_tokenizer(tokenizer, dir)


class seeded:
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


__all__ = [
    "CHARSET",
    "MAX_POSITIONS",
    "SIZES",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "init_model",
    "save_tokenizer",
    "save_trained",
    "seeded",
]

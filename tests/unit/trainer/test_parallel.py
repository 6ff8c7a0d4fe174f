"""The trainer over N processes (FSDP2, gloo, 2 local processes) and its state through
``torch.distributed.checkpoint``: the same training as one process, shards that cover the
published weights exactly, bit-identical reruns, checkpoints across world sizes.

Tolerances: 2 processes sum each gradient in another order than 1 (each rank's share, then
the reduce-scatter across ranks) and shard the gradient norm, so results agree with a
single process up to float rounding, not bit for bit. With lr 1e-3 and a handful of steps,
a master weight moves by about 1e-3 a step and the rounding moves it by about 1e-6: the
masters must agree within ``MASTER_ATOL`` (1e-4, a tenth of a step). A published (bf16)
weight is that master rounded: where the two masters straddle a bf16 rounding boundary the
published values differ by one bf16 step (relative 2**-8), so they must agree within
``MASTER_ATOL`` plus one bf16 step. Counts (sequences, loss tokens) agree exactly. Runs of
the same world size are compared bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from astraflow.config.lora import LoraSpec
from astraflow.config.sections import TrainerSpec
from astraflow.trainer import checkpoint
from astraflow.trainer.parallel import Group, join, shard_rows, solo, spawn_local
from astraflow.trainer.trainer import Trainer, _Row, deal_groups
from astraflow.weights.blob import Rows
from astraflow.wire.records import Batch
from tests.unit.trainer import parallel_workers as workers
from tests.unit.trainer.test_trainer import VOCAB, make_batch

MASTER_ATOL = 1e-4
BF16_STEP = 2.0 ** -8
TIMEOUT_S = 300  # a hang fails the test instead of blocking the suite
CONFIG = {"lr": 1e-3, "micro_batch_size": 3}
BATCHES = [(0,), (1,), (2,)]
EXACT_METRICS = ("trainer/sequences", "trainer/loss_tokens", "trainer/reward_mean",
                 "trainer/zero_advantage_frac", "trainer/minibatches",
                 "trainer/stale_dropped_groups", "trainer/staleness_mean")
CLOSE_METRICS = ("trainer/loss", "trainer/grad_norm", "trainer/ratio_max", "trainer/ratio_mean",
                 "trainer/approx_kl", "trainer/objective", "trainer/m2")


def _save(tmp_path_factory, name: str, model) -> str:
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    """test_trainer.py's tiny Qwen2 (hidden 64, 2 layers, untied)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=128)
    return _save(tmp_path_factory, "tiny-qwen2", Qwen2ForCausalLM(cfg))


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory) -> str:
    """A tiny Llama whose output layer is its embedding (as SmolLM2's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=128, tie_word_embeddings=True)
    return _save(tmp_path_factory, "tiny-tied-llama", LlamaForCausalLM(cfg))


def single(model_path: str, config: dict, batches: list[tuple]) -> dict:
    """``workers.run`` in this process, without a group."""
    torch.set_num_threads(1)
    return workers.run(model_path, config, batches)


@pytest.fixture(scope="module")
def one(qwen) -> dict:
    """3 steps in this process, without a group."""
    return single(qwen, CONFIG, BATCHES)


@pytest.fixture(scope="module")
def runs(qwen, one) -> list[list[dict]]:
    """On 2 processes, each rank's result (rank order) of: 3 steps; a fresh trainer given
    the weights ``one`` ended with (``load_weights``)."""
    got = spawn_local(2, workers.train, (qwen, [(CONFIG, BATCHES),
                                                (CONFIG, [], one["state"]["weights"])]),
                      timeout_s=TIMEOUT_S)
    return [[rank[i] for rank in got] for i in range(2)]


@pytest.fixture(scope="module")
def two(runs) -> list[dict]:
    """Each rank's result of 3 steps on 2 processes (rank order)."""
    return runs[0]


def assert_close_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                        rtol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        diff = (a[k].float() - b[k].float()).abs()
        bound = MASTER_ATOL + rtol * b[k].float().abs()
        assert bool((diff <= bound).all()), f"{k}: off by {float((diff - bound).max())}"


def assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_like_single(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in EXACT_METRICS:
            assert g.get(k) == w.get(k), k
        for k in CLOSE_METRICS:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6), k


def timeless(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.endswith("_seconds")} for m in metrics]


def assert_parts_cover(results: list[dict], published: dict[str, torch.Tensor]) -> None:
    """The ranks' published parts: each tensor's rows exactly once, in order, bit for bit
    the gathered published state (a tensor without rows: whole, in one part)."""
    assert set().union(*(r["part"] for r in results)) == set(published)
    for k, full in published.items():
        whole = [r["part"][k] for r in results if k in r["part"] and k not in r["rows"]]
        if whole:
            assert len(whole) == 1 and not any(k in r["rows"] for r in results), k
            assert torch.equal(whole[0], full), k
            continue
        pieces = sorted(((r["rows"][k], r["part"][k]) for r in results if k in r["rows"]),
                        key=lambda p: p[0].start)
        assert all(isinstance(rows, Rows) for rows, _ in pieces)
        assert [rows.shape for rows, _ in pieces] == [tuple(full.shape)] * len(pieces)
        starts = [rows.start for rows, _ in pieces] + [full.shape[0]]
        assert starts[0] == 0 and all(rows.stop == nxt for (rows, _), nxt
                                      in zip(pieces, starts[1:])), k
        for rows, t in pieces:
            assert t.is_contiguous() and t.shape == rows.part_shape and rows.stop > rows.start
        joined = torch.cat([t for _, t in pieces])
        assert joined.dtype == full.dtype and torch.equal(joined, full), k


# --------------------------------------------------------------------------- in-process
def test_join_names_what_the_environment_lacks(monkeypatch):
    for var in ("RANK", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="needs RANK, .*MASTER_PORT in the environment") as e:
        join("cpu")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="RANK must be an integer"):
        join("cpu")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        join("tpu")


def test_a_group_refuses_what_fsdp_cannot_shard(qwen):
    # rank 0 of 2: refused before any collective, so no other rank is needed
    group = Group(rank=0, world=2, local_rank=0, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"backend \(--backend\) must be 'torch' with a "):
        Trainer(qwen, TrainerSpec(backend="megatron"), group=group)
    with pytest.raises(ValueError, match=r"device \(--device\) 'cuda' does not match"):
        Trainer(qwen, TrainerSpec(device="cuda"), group=group)


def test_a_group_of_one_is_one_process_with_every_one_process_feature(qwen):
    initialized = torch.distributed.is_initialized()  # by an earlier test, or not
    alone = solo("cpu")
    assert (alone.rank, alone.world, alone.backend) == (0, 1, "none")
    assert alone.command("step") == "step" and alone.broadcast(3) == 3
    assert alone.gather({"a": 1}) == [{"a": 1}]
    assert alone.sum_floats({"x": 2.5, "n": 3}) == {"x": 2.5, "n": 3}
    assert alone.max_floats({"x": -1.0}) == {"x": -1.0}
    t = torch.arange(3.0)
    assert torch.equal(alone.all_gather_rows(t), t)
    alone.wait_for_all()
    alone.barrier()
    alone.close()  # it joined nothing, so it leaves any process group as it was
    assert torch.distributed.is_initialized() == initialized

    assert Trainer(qwen, TrainerSpec()).group.world == 1  # no group given: a group of one
    # torchrun's group of one (rank 0 of 1) shards nothing and refuses nothing a single
    # process may do: megatron, bf16-held forward weights, LoRA
    gloo_one = Group(rank=0, world=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
    held = Trainer(qwen, TrainerSpec(forward_dtype="bf16", publish_dtype="bf16"),
                   group=gloo_one)
    assert not held.sharded and held.forward_dtype == "bf16"
    assert not any(type(p).__name__ == "DTensor" for p in held.model.parameters())
    lora = Trainer(qwen, TrainerSpec(), group=gloo_one,
                   lora=LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert lora.lora is not None and not lora.sharded


def test_groups_are_dealt_whole_and_balanced_by_tokens():
    batch = make_batch(0, groups=5)
    rows = [_Row(s, 1.0, gi) for gi, g in enumerate(batch.groups) for s in g.sequences]
    tokens = {gi: sum(len(s.token_ids) for s in g.sequences) for gi, g in enumerate(batch.groups)}
    owner = deal_groups(rows, 2)
    assert sorted(owner) == list(range(5))
    load = [sum(n for g, n in tokens.items() if owner[g] == r) for r in range(2)]
    # greedy, largest first: no rank ends more than the largest group ahead
    assert abs(load[0] - load[1]) <= max(tokens.values())
    assert deal_groups(list(reversed(rows)), 2) == owner  # by tokens, not row order
    assert deal_groups(rows[:4], 2) == {0: 0}  # one group: rank 1 gets none
    assert [shard_rows(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [shard_rows(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]


@pytest.mark.parametrize("model", ["qwen", "tied_llama"])
def test_a_trainer_without_group_saves_and_resumes_exactly(model, request, tmp_path):
    path = request.getfixturevalue(model)
    torch.set_num_threads(1)
    batches = [make_batch(i) for i in range(3)]
    a = Trainer(path, TrainerSpec(**CONFIG), policy="actor")
    for b in batches[:2]:
        a.train_step(b)
    handle = checkpoint.save(a, tmp_path / "ckpt", async_=True, version=41)
    saved = workers.full_state(a)
    # the copy to CPU memory runs in the stager's thread: the next update must wait for it
    staging = a._update_guard.__self__
    step, seen = a.optimizer.step, []
    a.optimizer.step = lambda *args, **kw: (seen.append(staging.done()), step(*args, **kw))[1]
    a.train_step(batches[2])  # while the files are written
    assert seen == [True]
    assert handle.result() == tmp_path / "ckpt" and handle.done()
    assert checkpoint.read_meta(tmp_path / "ckpt")["version"] == 41
    b = Trainer(path, TrainerSpec(**CONFIG), policy="actor")
    meta = checkpoint.load(b, tmp_path / "ckpt")
    assert meta["world"] == 1 and b.steps == 2
    loaded = workers.full_state(b)
    assert_equal_states(loaded["weights"], saved["weights"])
    for name, state in saved["optim"].items():
        assert_equal_states(loaded["optim"][name], state)
    b.train_step(batches[2])
    assert_equal_states(b.state_dict(), a.state_dict())
    assert_equal_states(b.published_state(), a.published_state())
    with pytest.raises(ValueError, match="the trainer state is float32, the model trains in "
                                         "bfloat16"):
        checkpoint.load(Trainer(path, TrainerSpec(dtype="bf16"), policy="actor"),
                        tmp_path / "ckpt")
    with pytest.raises(ValueError, match="no complete trainer checkpoint"):
        checkpoint.load(b, tmp_path / "none")


# --------------------------------------------------------------------------- 2 processes
def test_two_processes_train_as_one_within_float_rounding(one, two):
    want = one
    for rank in two:  # every rank returns the same metrics and gathered state
        assert timeless(rank["metrics"]) == timeless(two[0]["metrics"])
        assert_equal_states(rank["published"], two[0]["published"])
    got = two[0]
    assert_like_single(got["metrics"], want["metrics"])
    assert_close_states(got["state"]["weights"], want["state"]["weights"])
    assert_close_states(got["published"], want["published"], rtol=BF16_STEP)
    assert got["published"]["lm_head.weight"].dtype == torch.bfloat16
    for name, state in want["state"]["optim"].items():
        assert float(got["state"]["optim"][name]["step"]) == float(state["step"]) == 3.0


def test_full_weights_load_into_each_ranks_rows(qwen, one, runs):
    loaded = runs[1]
    assert_equal_states(loaded[0]["state"]["weights"], one["state"]["weights"])
    # the parameters are the masters rounded again: what one process publishes
    tr = Trainer(qwen, TrainerSpec(**CONFIG), policy="actor")
    tr.load_weights(one["state"]["weights"])
    assert_equal_states(loaded[0]["published"], tr.published_state())
    assert_parts_cover(loaded, loaded[0]["published"])


def test_the_published_parts_of_the_ranks_are_the_published_state_exactly(two):
    assert_parts_cover(two, two[0]["published"])
    rows = two[1]["rows"]["model.embed_tokens.weight"]
    assert rows == Rows(VOCAB // 2, VOCAB, (VOCAB, 64))


@pytest.mark.slow
def test_two_identical_runs_on_two_processes_are_bit_identical(qwen, two):
    again = [r[0] for r in spawn_local(2, workers.train, (qwen, [(CONFIG, BATCHES)]),
                                       timeout_s=TIMEOUT_S)]
    for a, b in zip(again, two):
        assert timeless(a["metrics"]) == timeless(b["metrics"])
        assert_equal_states(a["state"]["weights"], b["state"]["weights"])
        assert_equal_states(a["part"], b["part"])
        for name, state in b["state"]["optim"].items():
            assert_equal_states(a["state"]["optim"][name], state)


def test_tied_embeddings_and_a_rank_with_no_group_in_a_step(tied_llama):
    # batch 1 has one group: rank 1 trains nothing in that step and runs dummy passes
    batches = [(0,), (1, 1), (2, 3)]
    got = spawn_local(2, workers.train, (tied_llama, [(CONFIG, batches)]),
                      timeout_s=TIMEOUT_S)
    got = [r[0] for r in got]
    want = single(tied_llama, CONFIG, batches)
    assert want["metrics"][1]["trainer/sequences"] == 4.0
    assert_like_single(got[0]["metrics"], want["metrics"])
    assert_close_states(got[0]["state"]["weights"], want["state"]["weights"])
    assert_close_states(got[0]["published"], want["published"], rtol=BF16_STEP)
    # one tensor, published under both names, each covered once by the parts
    pub = got[0]["published"]
    assert torch.equal(pub["lm_head.weight"], pub["model.embed_tokens.weight"])
    assert_parts_cover(got, pub)


VARIANTS = {
    "m2po": {"loss": "m2po", "m2_threshold": 0.01},
    "decoupled_ppo_minibatches": {"loss": "decoupled_ppo", "minibatches": 2},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "token_budget_forward_on_master": {"micro_batch_tokens": 24, "forward_on": "master"},
}


def flat_first_group(i: int) -> Batch:
    """``make_batch(i)`` whose first group has equal rewards (zero advantages): with 2
    minibatches the first trains no token, and its step follows the second's proximal
    passes (no backward pass in between)."""
    b = make_batch(i)
    g = b.groups[0]
    seqs = [dataclasses.replace(s, reward=1.0) for s in g.sequences]
    flat = dataclasses.replace(g, sequences=seqs, rewards=[1.0] * len(seqs))
    return dataclasses.replace(b, groups=[flat, *b.groups[1:]])


@pytest.mark.slow
def test_losses_and_options_on_two_processes_train_as_one(qwen):
    # a token budget replaces micro_batch_size (the spec takes one of the two)
    runs = [({**{k: x for k, x in CONFIG.items()
                 if not ("micro_batch_tokens" in v and k == "micro_batch_size")}, **v},
             [(0, 3), (1, 3)]) for v in VARIANTS.values()]
    runs.append(({**CONFIG, "loss": "decoupled_ppo", "minibatches": 2},
                 [flat_first_group(0), flat_first_group(1)]))
    got = spawn_local(2, workers.train, (qwen, runs), timeout_s=TIMEOUT_S)[0]
    for name, g, (config, batches) in zip([*VARIANTS, "flat_first_minibatch"], got, runs):
        want = single(qwen, config, batches)
        try:
            assert_like_single(g["metrics"], want["metrics"])
            # the m2 cut is taken over both ranks' tokens: the same tokens are masked
            assert [m["trainer/m2_masked_frac"] for m in g["metrics"]] == pytest.approx(
                [m["trainer/m2_masked_frac"] for m in want["metrics"]])
            assert_close_states(g["state"]["weights"], want["state"]["weights"])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
    assert any(m["trainer/m2_masked_frac"] > 0 for m in got[0]["metrics"])


def test_bf16_autocast_on_two_processes_trains_as_one_within_bf16_rounding(qwen):
    """Under bf16 autocast each rank's matmuls run on other shapes (its own micro-batches)
    and round in bf16 (relative 2**-8): the figures agree within 1e-2 relative. A gradient
    element near 0 may change sign, and AdamW then moves that weight the other way (at most
    about lr a step): all but 1% of the masters agree within MASTER_ATOL, and none differ by
    more than two such steps a step."""
    config = {**CONFIG, "autocast": "bf16"}
    batches = [(0, 3), (1, 3)]
    got = spawn_local(2, workers.train, (qwen, [(config, batches)]), timeout_s=TIMEOUT_S)[0][0]
    want = single(qwen, config, batches)
    for g, w in zip(got["metrics"], want["metrics"]):
        for k in EXACT_METRICS:
            assert g.get(k) == w.get(k), k
        for k in CLOSE_METRICS:
            assert g[k] == pytest.approx(w[k], rel=1e-2, abs=1e-5), k
    a, b = got["state"]["weights"], want["state"]["weights"]
    diffs = torch.cat([(a[k] - b[k]).abs().reshape(-1) for k in b])
    assert float((diffs > MASTER_ATOL).float().mean()) < 0.01
    assert float(diffs.max()) <= 2 * CONFIG["lr"] * len(batches) * 1.01


@pytest.fixture(scope="module")
def saved(qwen, tmp_path_factory) -> dict:
    """Checkpoints after 2 of 3 steps, and what the runs did around them: ``one`` (this
    process, no group: 2 steps, a synchronous save into ``one_dir``, a third step) and
    ``two`` (2 processes: 2 steps, an asynchronous save into ``two_dir`` while the third
    step runs; then ``one_dir`` loaded and the third step again)."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    out = {"one_dir": tmp / "one", "two_dir": tmp / "two"}
    torch.set_num_threads(1)
    one = Trainer(qwen, TrainerSpec(**CONFIG), policy="actor")
    workers.steps(one, BATCHES[:2])
    out["one_saved"] = workers.full_state(one)
    checkpoint.save(one, out["one_dir"], async_=False)
    out["one_metrics"] = workers.steps(one, BATCHES[2:])
    out["one_end"] = workers.full_state(one)
    out["two"] = spawn_local(2, workers.checkpoints,
                             (qwen, CONFIG, BATCHES, 2, str(out["two_dir"]),
                              str(out["one_dir"])), timeout_s=TIMEOUT_S)[0]
    return out


def assert_equal_full_states(a: dict, b: dict) -> None:
    """Weights and AdamW state bit for bit."""
    assert_equal_states(a["weights"], b["weights"])
    assert a["optim"].keys() == b["optim"].keys()
    for name, state in b["optim"].items():
        assert_equal_states(a["optim"][name], state)


def test_a_checkpoint_of_one_process_loads_into_two(saved):
    two = saved["two"]
    assert two["meta"]["world"] == 1 and two["loaded"]["steps"] == 2
    assert_equal_full_states(two["loaded"], saved["one_saved"])
    assert_like_single(two["resumed_metrics"], saved["one_metrics"])
    assert_close_states(two["resumed"]["weights"], saved["one_end"]["weights"])


def test_a_checkpoint_of_two_processes_loads_into_one_without_a_group(qwen, saved):
    torch.set_num_threads(1)
    tr = Trainer(qwen, TrainerSpec(**CONFIG), policy="actor")
    assert checkpoint.load(tr, saved["two_dir"])["world"] == 2
    assert_equal_full_states(workers.full_state(tr), saved["two"]["saved"])
    assert_like_single(workers.steps(tr, BATCHES[2:]), saved["two"]["metrics"][2:])
    assert_close_states(tr.state_dict(), saved["two"]["end"]["weights"])


def test_a_checkpoint_of_two_processes_resumes_two_bit_for_bit(qwen, saved):
    two = saved["two"]
    # fresh processes: from scratch they repeat the first run bit for bit; loaded with the
    # state saved after 2 steps, their third step is the one of the run that never stopped
    again = spawn_local(2, workers.checkpoints,
                        (qwen, CONFIG, BATCHES, 2, None, str(saved["two_dir"])),
                        timeout_s=TIMEOUT_S)[0]
    assert timeless(again["metrics"]) == timeless(two["metrics"])
    assert_equal_full_states(again["end"], two["end"])
    assert_equal_full_states(again["loaded"], two["saved"])
    assert timeless(again["resumed_metrics"]) == timeless(two["metrics"][2:])
    assert_equal_full_states(again["resumed"], two["end"])


def test_a_group_of_one_loads_a_checkpoint_of_two_processes(qwen, saved):
    # the worker trains batch 2 from scratch first (unused), then loads and trains it again
    one = spawn_local(1, workers.checkpoints,
                      (qwen, CONFIG, BATCHES[2:], 0, None, str(saved["two_dir"])),
                      timeout_s=TIMEOUT_S)[0]
    assert_equal_full_states(one["loaded"], saved["two"]["saved"])
    assert_like_single(one["resumed_metrics"], saved["two"]["metrics"][2:])
    assert_close_states(one["resumed"]["weights"], saved["two"]["end"]["weights"])


def test_a_joined_group_of_one_trains_bit_for_bit_as_one_process(qwen, one):
    got = spawn_local(1, workers.train, (qwen, [(CONFIG, BATCHES)]), timeout_s=TIMEOUT_S)[0][0]
    assert timeless(got["metrics"]) == timeless(one["metrics"])
    assert_equal_full_states(got["state"], one["state"])
    assert_equal_states(got["published"], one["published"])
    assert got["rows"] == {}  # its published part is the whole published state


def test_a_rank_checks_and_loads_its_own_part_alone(qwen):
    """What a resuming rank that follows only its own rows of each version does: its part
    compared and loaded as a part, the ranks agreeing on a difference one of them sees."""
    got = spawn_local(2, workers.parts, (qwen, CONFIG, BATCHES[:1]), timeout_s=TIMEOUT_S)
    for rank in got:
        assert rank["fully_sharded"] and rank["same"] is None
        assert rank["changed"] is not None  # rank 1's difference, on both ranks
        assert rank["reloaded_same"] is None
        assert_equal_states(rank["reloaded"], rank["part"])
    assert got[0]["changed"] == got[1]["changed"]


def test_spawn_local_reports_a_failing_worker():
    with pytest.raises(RuntimeError, match="(?s)rank 0 failed:.*ZeroDivisionError"):
        spawn_local(1, divmod, (1, 0), timeout_s=TIMEOUT_S)

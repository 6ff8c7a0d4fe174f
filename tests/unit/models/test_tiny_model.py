"""The tiny policy model: init and reload, its tokenizer on task text, load errors, a warm-start
step, evaluate, the model commands, an interrupted model init (the task sources and the answer
checker: tests/unit/tasks/test_arithmetic.py)."""

from __future__ import annotations

import pytest

from astraflow.tasks import eval_problems, train_problems


@pytest.fixture(scope="module")
def torch_threads():
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared: keep the model tests on one core
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, torch_threads):
    from astraflow.models.tiny import init_model

    return init_model(tmp_path_factory.mktemp("tiny-model"), seed=3)


def test_init_and_reload_round_trip(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.models.loading import load_policy
    from astraflow.models.tiny import init_model

    model, tok = load_policy(tiny_dir)
    assert model.config.tie_word_embeddings
    assert tok.pad_token == "<pad>" and tok.eos_token == "<|endoftext|>"
    assert tok.padding_side == "left"
    ids = tok(["12+34=", "7*8="], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        a = model(**ids).logits
        # the plain auto classes load the same thing from the same local path
        auto = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).eval()
        b = auto(**ids).logits
    assert torch.equal(a, b)
    auto_tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert auto_tok("12+34=")["input_ids"] == tok("12+34=")["input_ids"]
    # the same seed writes the same weights
    again = init_model(tiny_dir.parent / "again", seed=3)
    m2, _ = load_policy(again)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tokenizer_round_trip_on_task_text(tiny_dir):
    from astraflow.models.loading import load_policy

    _, tok = load_policy(tiny_dir)
    texts = [p.prompt + p.answer for p in train_problems((1, 2, 3, 4), n=50)]
    texts += ["Natalia sold 48/2 = 24 clips.\n#### 72", "What is \\boxed{1,234}? (a) x_1 ^ 2!"]
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(t)  # one token per character
        assert tok.decode(ids) == t
    ids = tok("3+4=7<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "3+4=7"


def test_load_policy_errors(tmp_path):
    from astraflow.models.errors import ModelError
    from astraflow.models.loading import load_policy

    with pytest.raises(ModelError, match="no such model directory"):
        load_policy(tmp_path / "missing")
    with pytest.raises(ModelError, match="no config.json"):
        load_policy(tmp_path)


def test_a_warm_start_step_moves_the_weights_against_the_gradient_and_lowers_the_loss(
        tiny_dir):
    """One step on one batch (the whole task list, fixed seed): the weights move against
    the gradient of that batch's loss, and the loss on the same batch goes down. How much a
    longer warm start learns is a bench (``bench/learning.py``), not a test."""
    import torch

    from astraflow.models.examples import encode_task
    from astraflow.models.loading import load_policy
    from astraflow.models.warm_start import _padded, warm_start

    model, tok = load_policy(tiny_dir)
    tasks = train_problems((1,), n=16, unique=False)
    ids, attn, labels = _padded([encode_task(tok, t) for t in tasks], tok.pad_token_id)

    def batch_loss():
        return model(input_ids=ids, attention_mask=attn, labels=labels).loss

    model.train()
    model.zero_grad(set_to_none=True)
    loss = batch_loss()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    metrics = warm_start(model, tok, tasks, steps=1, lr=1e-3, batch_size=len(tasks), seed=0)
    assert metrics["steps"] == 1 and metrics["examples"] == len(tasks)
    assert metrics["loss_first"] == pytest.approx(float(loss), rel=1e-5)  # this very batch
    along = sum(float(((p.detach() - before[n]) * grads[n]).sum())
                for n, p in model.named_parameters())
    assert along < 0, "the step did not move the weights against the gradient"
    with torch.no_grad():
        assert float(batch_loss()) < float(loss)


def test_evaluate_scores_each_greedy_completion_and_each_level(tiny_dir):
    """Tasks built from the model's own greedy completions, right for a known set of them:
    the accuracy is exactly that share, overall and per level."""
    from astraflow.models.chat import ChatFormat
    from astraflow.models.evaluation import evaluate, generate_answers
    from astraflow.models.loading import load_policy
    from astraflow.tasks.check import cut_at_stop
    from astraflow.tasks.rewards import make_reward

    model, tok = load_policy(tiny_dir)
    ones, twos = eval_problems((1,), n=8), eval_problems((2,), n=12)
    problems = ones + twos
    prompts = [ChatFormat().prompt_text(tok, p.payload()) for p in problems]
    completions = generate_answers(model, tok, prompts, max_new_tokens=4, batch_size=16)
    # right: every second level-1 task (4 of 8), every third level-2 one (4 of 12)
    right = [j % 2 == 0 for j in range(len(ones))] + [j % 3 == 0 for j in range(len(twos))]
    tasks = [{**p.payload(), "answer": cut_at_stop(c).strip() if ok else "not an answer"}
             for p, c, ok in zip(problems, completions, right)]
    per: dict[int, float] = {}
    acc = evaluate(model, tok, tasks, max_new_tokens=4, batch_size=16, per_level=per,
                   reward=make_reward("exact_match"))
    assert [p.level for p in problems] == [1] * 8 + [2] * 12
    assert acc == 8 / 20 and per == {1: 4 / 8, 2: 4 / 12}


def test_model_cli_registers():
    import argparse

    from astraflow.cli import model

    parser = argparse.ArgumentParser()
    model.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["model", "init", "/tmp/x", "--warm-start-steps", "5"])
    assert args.func is model.cmd_model_init and args.warm_start_steps == 5


@pytest.mark.slow  # two `astraflow model init` processes
def test_interrupted_model_init_leaves_no_model_and_a_finished_one_has_its_recipe(tmp_path):
    """Ctrl-C during the warm start: no directory the next run could take for a model."""
    import signal
    import subprocess
    import sys

    from astraflow.models.recipe import INIT_RECIPE

    out = tmp_path / "model"
    cmd = [sys.executable, "-u", "-m", "astraflow.cli.main", "model", "init", str(out),
           "--warm-start-steps", "100000"]
    # Ctrl-C as a terminal sends it: the child starts with SIGINT's default action even if
    # the test process ignores it (an ignored SIGINT is inherited across exec, and Python
    # then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    for line in proc.stdout:  # the config and weights are written: the warm start runs
        if line.startswith("wrote tiny model"):
            break
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not out.exists() and list(tmp_path.iterdir()) == []

    done = subprocess.run([*cmd[:-1], "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").is_file() and (out / INIT_RECIPE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    # a directory holding something else is not replaced
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    res = subprocess.run([*cmd[:5], "init", str(other)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and "holds no model" in res.stderr
    assert (other / "todo.txt").read_text() == "keep me"

"""What an untrusted agent program can reach, without a broker: real jailed processes
against the node's real endpoint. Another episode's key or URL is found nowhere (not in
``/proc``, not in files), the node's secret files and private directories are not there,
limits are set before the program starts and bind its children, a call past an endpoint
limit is refused with its reason and the endpoint lives on, and the generation loop never
makes a caller wait for calls that arrived after it."""

from __future__ import annotations

import json
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from astraflow.raas.agent import jail
from astraflow.raas.agent.program import AgentProgram, Limits
from astraflow.raas.agent.server import AgentServer, EndpointLimits
from astraflow.raas.engine import Generation, SamplingParams
from tests.unit.raas.test_agent import _script


@pytest.fixture
def server():
    s = AgentServer(limits=EndpointLimits(max_body_mb=1, max_n=4, max_tokens=32, max_calls=2))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def jailed():
    if (why := jail.probe(True, False)) is not None:
        pytest.skip(f"this machine cannot make the jail's namespaces: {why}")


SNOOP = """
    import glob, json, os, sys, time, urllib.request
    mine = os.environ["OPENAI_API_KEY"]
    seen, found = set(), []
    # everything a program can read of other processes: environments and command lines
    for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
        try:
            text = open(path, "rb").read().replace(b"\\0", b"\\n").decode(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            # (its own task holds another episode's URL, handed in on purpose below)
            if ("OPENAI_API_KEY=" in line or "/ep/" in line) and not line.startswith(
                    "ASTRAFLOW_TASK="):
                seen.add(line)
    for line in sorted(seen):
        if "OPENAI_API_KEY=" in line and line.split("=", 1)[1] != mine:
            found.append("a key: " + line)
        if "/ep/" in line and os.environ["OPENAI_BASE_URL"] not in line:
            found.append("an episode: " + line)
    secrets = {}
    for path in sys.argv[1:]:
        try:
            secrets[path] = open(path).read()
        except OSError as e:
            secrets[path] = type(e).__name__
    # the key of another episode, handed in on purpose: the endpoint refuses it
    other = json.loads(sys.stdin.read()).get("other")
    status = None
    if other:
        req = urllib.request.Request(other["url"] + "/models",
                                     headers={"Authorization": "Bearer " + mine})
        try:
            urllib.request.urlopen(req, timeout=10)
            status = 200
        except urllib.error.HTTPError as e:
            status = e.code
    time.sleep(1)  # the other episode's program runs meanwhile
    print(json.dumps({"found": found, "secrets": secrets, "status": status,
                      "uid": os.getuid(), "env": sorted(os.environ),
                      "pids": len([p for p in os.listdir("/proc") if p.isdigit()])}))
"""


def test_a_program_finds_no_other_episode_and_none_of_the_nodes_secrets(
        engine, server, jailed, tmp_path, monkeypatch):
    script = _script(tmp_path, SNOOP)
    # beside the program, so inside what its jail shows, and readable by anyone on the
    # host: the jail must blank it itself
    secret = tmp_path / "agent" / "password"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    monkeypatch.setenv("ASTRAFLOW_SASL_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("SOME_NODE_SETTING", "node-only")
    readme = os.path.join(os.getcwd(), "README.md")  # the node's working directory
    cmd = (*script, str(secret), readme)
    program = AgentProgram(command=cmd, env={"GIVEN": "1"})
    eps = [server.open({"actor": engine}, j, keyed=True) for j in range(2)]
    other = {"url": server.base_url(eps[1])}
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda j: program.run({"other": other if j == 0 else None},
                                                   server.access(eps[j]), 60), range(2)))
    for out in outs:
        assert out.error is None, out.stderr
        r = out.result
        assert r["found"] == [], r["found"]
        assert r["secrets"][str(secret)] == "" and r["secrets"][readme] == "FileNotFoundError"
        assert r["env"] == ["ASTRAFLOW_TASK", "GIVEN", "HOME", "LANG", "OPENAI_API_KEY",
                            "OPENAI_BASE_URL", "PATH", "TMPDIR"]  # built from nothing
        assert r["pids"] <= 3  # the jail, the program, and nothing of anyone else
    assert outs[0].result["status"] == 401  # another episode's URL without its key
    if os.geteuid() == 0:  # a uid of each program's own, neither root
        assert 0 not in {o.result["uid"] for o in outs}
        assert outs[0].result["uid"] != outs[1].result["uid"]
    assert not any(ep.ended for ep in eps)  # refused calls end nothing


def test_the_endpoint_answers_only_calls_with_the_episodes_own_key(engine, server):
    ep = server.open({"actor": engine}, 0, keyed=True)
    other = server.open({"actor": engine}, 1, keyed=True)
    path = f"/ep/{ep.id}/v1/models"
    assert server.handle("GET", path, None)[0] == 401
    assert server.handle("GET", path, None, f"Bearer {other.api_key}")[0] == 401
    assert server.handle("GET", path, None, f"Bearer {ep.api_key}")[0] == 200
    assert not ep.ended and ep.failure is None


LIMITS = """
    import json, resource, subprocess, sys
    print_limits = {n: resource.getrlimit(getattr(resource, "RLIMIT_" + n))[0]
                    for n in ("CPU", "AS", "NPROC")}
    children, refused = [], None
    for _ in range(6):  # more processes than max_procs allows
        try:
            children.append(subprocess.Popen([sys.executable, "-c",
                                              "import time; time.sleep(5)"]))
        except OSError as e:
            refused = type(e).__name__
            break
    for c in children:
        c.kill()
    print(json.dumps({"limits": print_limits, "started": len(children), "refused": refused}))
"""


def test_limits_are_set_before_the_program_runs_and_bind_its_children(jailed, tmp_path):
    program = AgentProgram(command=_script(tmp_path, LIMITS),
                           limits=Limits(cpu_s=20, mem_mb=1024, max_procs=3))
    out = program.run({}, _access(), 60)
    assert out.error is None, out.stderr
    lim = out.result["limits"]
    assert lim["CPU"] == 20 and lim["AS"] == 1024 * 2**20 and lim["NPROC"] >= 3
    assert out.result["refused"] == "BlockingIOError"  # fork: EAGAIN, as root too
    assert out.result["started"] < 3


def _access():
    from astraflow.raas.agent.program import Access

    return Access("http://127.0.0.1:9/ep/none/v1")


# --- endpoint limits ------------------------------------------------------------------------
def _raw_post(server: AgentServer, path: str, length: int, key: str | None) -> bytes:
    """A POST that announces ``length`` bytes and sends a few: the reply, read to its end."""
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n")
        if key:
            head += f"Authorization: Bearer {key}\r\n"
        s.sendall(head.encode() + b"\r\n" + b"{" * 1024)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_calls_past_a_limit_are_refused_with_the_limit_and_the_endpoint_lives_on(
        engine, server):
    from openai import OpenAI

    ep = server.open({"actor": engine}, 0, keyed=True)
    reply = _raw_post(server, f"/ep/{ep.id}/v1/chat/completions", 100 * 2**20, ep.api_key)
    assert reply.startswith(b"HTTP/1.1 413") and b"endpoint.max_body_mb" in reply
    assert ep.failure and "endpoint.max_body_mb" in ep.failure
    for body, limit in (({"n": 10000}, "endpoint.max_n"),
                        ({"max_tokens": 10**6}, "endpoint.max_tokens")):
        ep = server.open({"actor": engine}, 0, keyed=True)
        status, err = server.handle(
            "POST", f"/ep/{ep.id}/v1/chat/completions",
            {"model": "actor", "messages": [{"role": "user", "content": "1"}], **body},
            f"Bearer {ep.api_key}")
        assert status == 400 and limit in err["error"]["message"]
        assert limit in ep.failure
    # the endpoint still answers a new episode
    ep = server.open({"actor": engine}, 0, keyed=True)
    r = OpenAI(base_url=server.base_url(ep), api_key=ep.api_key).chat.completions.create(
        model="actor", messages=[{"role": "user", "content": "1+1="}], max_tokens=2)
    assert isinstance(r.choices[0].message.content, str) and ep.failure is None


def test_an_episode_with_too_many_calls_at_once_is_refused(server):
    gate = threading.Event()

    class Slow:  # an engine that holds its calls until the gate opens
        eos_token_id = None

        def generate(self, prompts, params):
            gate.wait(30)
            return [[Generation([], [1], [-0.1], "stop", [0])] for _ in prompts]

        def encode(self, text):
            return [1, 2]

        def decode(self, ids):
            return "x"

    ep = server.open({"actor": Slow()}, 0, keyed=True)
    body = {"model": "actor", "prompt": [1, 2], "max_tokens": 1}
    path = f"/ep/{ep.id}/v1/completions"
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(server.handle, "POST", path, body, f"Bearer {ep.api_key}")
                 for _ in range(2)]
        wait_until(lambda: ep.active == 2)
        status, err = server.handle("POST", path, body, f"Bearer {ep.api_key}")
        gate.set()
        assert status == 429 and "endpoint.max_calls" in err["error"]["message"]
        assert "endpoint.max_calls" in ep.failure
        assert {c.result()[0] for c in calls} <= {200, 410}


def test_a_burst_of_connections_waits_for_the_endpoint_to_accept_it():
    """Episodes connecting at once while the engine holds the cores queue in the listening
    socket up to the connection limit; with socketserver's backlog of 5 the sixth
    connection was dropped (and under load, reset)."""
    from astraflow.raas.agent.server import _BoundedHTTPServer, _Handler

    httpd = _BoundedHTTPServer(("127.0.0.1", 0), _Handler, 64)  # accepts none: not served
    socks = []
    try:
        for _ in range(40):
            s = socket.create_connection(httpd.server_address[:2], timeout=5)
            socks.append(s)
        assert len(socks) == 40
    finally:
        for s in socks:
            s.close()
        httpd.server_close()


def wait_until(cond, timeout_s: float = 30.0) -> None:
    ready = threading.Event()
    for _ in range(int(timeout_s * 100)):
        if cond():
            return
        ready.wait(0.01)
    raise AssertionError("condition not met")


# --- fair batching --------------------------------------------------------------------------
def test_no_caller_waits_for_calls_that_arrived_after_it():
    """The first caller's answer comes back while a later caller's call is still being
    computed (the old leader served every queued call before returning)."""
    from astraflow.raas.agent.batching import Coalescer

    started, release = [], {1: threading.Event(), 2: threading.Event()}
    calls = threading.Semaphore(0)

    class Gated:
        def generate(self, prompts, params):
            n = len(started) + 1
            started.append([p[0] for p in prompts])
            calls.release()
            release[n].wait(30)
            return [[Generation([], [p[0]], [-0.1], "stop", [0])] for p in prompts]

    c = Coalescer(Gated(), window_s=0.0)
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.generate, [1], greedy)
        assert calls.acquire(timeout=30)  # the first call runs, with the first request
        later = pool.submit(c.generate, [2], greedy)
        release[1].set()
        assert calls.acquire(timeout=30)  # the second call runs, with the later request
        assert first.result(timeout=30)[0].token_ids == [1]  # while the second is held
        assert not later.done()
        release[2].set()
        assert later.result(timeout=30)[0].token_ids == [2]
    assert started == [[1], [2]]


def test_calls_carry_the_oldest_request_first_and_its_peers():
    from astraflow.raas.agent.batching import Coalescer, _Request

    c = Coalescer(object(), window_s=0.0)
    a = SamplingParams(max_new_tokens=1, temperature=0.0)
    b = SamplingParams(max_new_tokens=2, temperature=0.0)
    c._queue.extend(_Request([i], p) for i, p in enumerate((b, a, b, a)))
    assert [r.prompt for r in c._next()] == [[0], [2]]
    assert [r.prompt for r in c._next()] == [[1], [3]]


def test_the_jail_config_hides_the_nodes_dirs_and_names_secret_files(tmp_path):
    secret = tmp_path / "key.pem"
    secret.write_text("k")
    assert jail.secret_files({"SSL_KEY_LOCATION": str(secret), "OTHER": str(secret),
                              "MY_TOKEN": "not-a-path"}) == [str(secret)]
    dirs = jail.hidden_dirs("/root", "/")
    assert "/" not in dirs and "/tmp" in dirs and "/root" in dirs
    nested = jail.hidden_dirs(str(tmp_path), str(tmp_path / "x"))
    assert str(tmp_path) not in nested or "/tmp" not in nested  # none inside another
    assert json.loads(json.dumps(jail.config(["a"], {}, uid=None, limits={})))["argv"] == ["a"]

"""``serve --data-parallel-size 2`` end to end on CPU: real processes, the `openai` client.

One server (two replica processes, prefix caching, restarts allowed) serves the module; the
last test kills a replica mid-stream, so it runs last.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import MODEL as MODEL_DIR
from server_helpers import Server

from replayssm import SamplingParams

NAME = "tiny-chat"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Foo:\n    def", "for i in range(", "x = [1, 2,",
           "# compute the", "return self.", "def __init__(self"]
MAX = 8
#: a shared prefix of 4 whole affinity blocks (16 tokens each) and more
SHARED = "You are a careful assistant. Answer in one short line, in plain words, and never guess. " * 2


@pytest.fixture(scope="module")
def dp_server(chat_model_dir):
    s = Server(chat_model_dir, "--data-parallel-size", "2", "--max-num-seqs", "4", "--max-queue", "8",
               "--served-model-name", NAME, "--enable-prefix-caching", "--max-seq-len", "512",
               "--data-parallel-max-restarts", "1", "--log-stats-interval", "0", "--shutdown-timeout", "5")
    yield s.wait(180)
    s.stop()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60, **kw)


def per_replica(server, name: str) -> dict:
    """``{(replica, reason or None): value}`` of a ``replayssm:dp_replica_*`` series."""
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"replayssm:dp_replica_{name}{{"):
            rep = re.search(r'replica="(\d+)"', line).group(1)
            reason = re.search(r'reason="(\w+)"', line)
            out[int(rep), reason.group(1) if reason else None] = float(line.rpartition(" ")[2])
    return out


def routed(server) -> dict:
    return per_replica(server, "requests_routed_total")


def replica_pids(server) -> dict:
    """Replica -> pid, from the startup and restart log lines."""
    pids = {}
    for line in server.log:
        m = re.search(r"replica (\d+) \(pid (\d+)", line) or re.search(r"replica (\d+) is back \(pid (\d+)", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    return pids


def health(server) -> tuple[int, dict]:
    r = httpx.get(server.url + "/health", timeout=10)
    return r.status_code, r.json()


def test_greedy_output_is_one_engines_and_both_replicas_serve(dp_server, offline):
    assert health(dp_server) == (200, {"status": "ok", "in_flight": 0, "steps": 0, "replicas": [
        {"replica": i, "state": "up", "in_flight": 0, "steps": 0, "restarts": 0} for i in range(2)]})
    c = client(dp_server)
    refs = offline.generate(PROMPTS, SamplingParams(max_tokens=MAX, logprobs=1))
    before = routed(dp_server)

    def one(k):
        p = PROMPTS[k]
        if k % 2:
            chunks = list(c.completions.create(model=NAME, prompt=p, max_tokens=MAX, temperature=0, stream=True))
            return "".join(ch.text for x in chunks for ch in x.choices), None
        r = c.completions.create(model=NAME, prompt=p, max_tokens=MAX, temperature=0, logprobs=1,
                                 extra_body={"return_token_ids": True})
        ch = r.choices[0]
        return ch.text, (ch.token_ids, ch.logprobs.token_logprobs)

    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(one, range(len(PROMPTS))))
    for ref, (text, ids_lps) in zip(refs, got):
        assert text == ref.text
        if ids_lps is not None:
            assert ids_lps[0] == ref.token_ids
            assert ids_lps[1] == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-4)
    after = routed(dp_server)
    load = {i: after[i, "load"] - before[i, "load"] for i in range(2)}
    aff = {i: after[i, "affinity"] - before[i, "affinity"] for i in range(2)}
    assert sum(load.values()) + sum(aff.values()) == len(PROMPTS)
    assert load[0] >= 1 and load[1] >= 1   # concurrent requests with unseen prefixes: spread by load
    tokens = per_replica(dp_server, "generation_tokens_total")
    assert tokens[0, None] > 0 and tokens[1, None] > 0
    m = dp_server.metrics()
    assert m["replayssm:generation_tokens_total"] == tokens[0, None] + tokens[1, None]
    assert m["replayssm:total_slots"] == 8   # 4 per replica


def test_same_prefix_goes_to_the_same_replica_and_hits_its_prefix_cache(dp_server, offline):
    c = client(dp_server)
    tails = ["What is 2 + 2?", "Name a colour.", "Spell cat.", "Say hi."]
    before, hits0 = routed(dp_server), dp_server.metrics()["replayssm:prefix_cache_hits_total"]
    for t in tails:   # one after the other: the replica holding the prefix is never over its share
        r = c.completions.create(model=NAME, prompt=SHARED + t, max_tokens=MAX, temperature=0)
        assert r.choices[0].text == offline.generate([SHARED + t], SamplingParams(max_tokens=MAX))[0].text
    after = routed(dp_server)
    d = {k: after[k] - before[k] for k in after}
    (first,) = [i for i in range(2) if d[i, "load"] + d[i, "affinity"] > 0]   # all on one replica
    assert d[first, "affinity"] == len(tails) - 1 and d[first, "load"] == 1
    assert dp_server.metrics()["replayssm:prefix_cache_hits_total"] > hits0   # the engine resumed the prefix

    # a burst of the same prefix: affinity yields to load once that replica holds its share
    before = routed(dp_server)
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda k: list(c.completions.create(model=NAME, prompt=SHARED + tails[k % 4], max_tokens=24,
                                                        temperature=0, stream=True)), range(6)))
    after = routed(dp_server)
    per = [sum(after[i, r] - before[i, r] for r in ("load", "affinity")) for i in range(2)]
    assert sum(per) == 6 and min(per) >= 1


def test_chat_sampling_and_tokenizer_routes(dp_server, offline):
    c = client(dp_server)
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    ids = offline.tokenizer.encode("user: def add(a, b):\nassistant:", add_special_tokens=False).ids
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.content == offline.generate([ids], SamplingParams(max_tokens=MAX))[0].text
    tok = httpx.post(dp_server.url + "/tokenize", json={"prompt": "import os"}, timeout=10).json()
    assert tok["tokens"] == offline.tokenizer.encode("import os").ids and tok["max_model_len"] == 512
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model=NAME, prompt="x " * 600, max_tokens=4)
    # seeded samples (n=2) are the same on whichever replica runs them (unseeded ones differ
    # between replicas: each samples with its own engine seed)
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0.8, seed=4, n=2)
    before = routed(dp_server)
    runs = [[x.text for x in c.completions.create(**kw).choices] for _ in range(4)]
    after = routed(dp_server)
    assert all(r == runs[0] for r in runs) and len(runs[0]) == 2
    assert all(sum(after[i, k] - before[i, k] for k in ("load", "affinity")) >= 1 for i in range(2))
    # several prompts in one request run on one replica, each choice its prompt's
    r = c.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=MAX, temperature=0)
    want = offline.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX))
    assert [(x.index, x.text) for x in r.choices] == [(i, o.text) for i, o in enumerate(want)]


def test_a_client_that_leaves_is_aborted_on_its_replica(dp_server):
    """Closing a stream cancels the request on the replica holding it: its slot frees long
    before the 300 tokens it asked for."""
    c = client(dp_server)
    with c.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=300, temperature=0, stream=True) as stream:
        it = iter(stream)
        next(it)
        next(it)
        reps = health(dp_server)[1]["replicas"]
        assert sum(x["in_flight"] for x in reps) == 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        if health(dp_server)[1]["in_flight"] == 0 and sum(per_replica(dp_server, "running").values()) == 0:
            break
        time.sleep(0.05)
    assert health(dp_server)[1]["in_flight"] == 0
    assert sum(per_replica(dp_server, "running").values()) == 0
    aborted = dp_server.metrics()['replayssm:request_success_total{finished_reason="abort",model_name="tiny-chat"}']
    assert aborted >= 1


def test_bad_data_parallel_flags_are_refused_before_any_replica_starts(capsys, serve_logging):
    from replayssm.server import cli as serve_cli

    model = os.path.join(os.path.dirname(__file__), "..", "..", "replayssm", "assets", "tiny-mamba2")
    assert serve_cli.main([model, "--port", "0", "--data-parallel-size", "2", "--device", "cuda:1"]) == 2
    assert "names one GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        serve_cli.main([model, "--data-parallel-size", "0"])
    assert e.value.code == 2
    assert "--data-parallel-size" in capsys.readouterr().err
    # contradicting engine flags are named before any replica process starts
    assert serve_cli.main([model, "--port", "0", "--data-parallel-size", "2", "--speculative", "draft"]) == 2
    assert "error: --speculative draft needs --draft-model DIR" in capsys.readouterr().err


def test_a_killed_replica_ends_its_requests_with_an_error_and_comes_back(dp_server, offline):
    """SIGKILL the replica serving a stream and a plain request: both end at once with an
    error naming the replica; the other replica serves meanwhile (/health: degraded); the
    killed one is restarted; SIGTERM then drains and exits 0 with no replica left."""
    c = client(dp_server)
    pids = replica_pids(dp_server)
    assert sorted(pids) == [0, 1]
    prompt = SHARED + "Count to one hundred:"
    stream = c.completions.create(model=NAME, prompt=prompt, max_tokens=300, temperature=0, stream=True)
    it = iter(stream)
    next(it)
    victim = next(x["replica"] for x in health(dp_server)[1]["replicas"] if x["in_flight"])
    plain_err = {}

    def plain():   # same prefix: routed to the same replica (it holds 1 sequence, within its share)
        try:
            c.completions.create(model=NAME, prompt=prompt + " go", max_tokens=300, temperature=0)
        except openai.APIStatusError as e:
            plain_err["e"] = e

    t = threading.Thread(target=plain)
    t.start()
    deadline = time.time() + 10
    while health(dp_server)[1]["replicas"][victim]["in_flight"] < 2 and time.time() < deadline:
        time.sleep(0.02)
    assert health(dp_server)[1]["replicas"][victim]["in_flight"] == 2
    os.kill(pids[victim], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match=rf"engine replica {victim} \(pid \d+\) was killed by SIGKILL"):
        for _ in it:
            pass
    t.join(30)
    assert time.monotonic() - t0 < 10
    e = plain_err["e"]
    assert e.status_code == 500 and f"engine replica {victim}" in str(e)
    code, body = health(dp_server)
    if body["replicas"][victim]["state"] != "up":   # (unless it restarted already)
        assert code == 200 and body["status"] == "degraded"
        assert "SIGKILL" in body["replicas"][victim]["error"]
    # the other replica serves meanwhile, with the right output
    r = c.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX, temperature=0)
    assert r.choices[0].text == offline.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX))[0].text
    deadline = time.time() + 120
    while health(dp_server)[1]["status"] != "ok" and time.time() < deadline:
        time.sleep(0.2)
    code, body = health(dp_server)
    assert code == 200 and body["replicas"][victim]["restarts"] == 1
    assert per_replica(dp_server, "restarts_total")[victim, None] == 1
    new_pid = replica_pids(dp_server)[victim]
    assert new_pid != pids[victim]
    # the restarted replica serves the shared prefix again (its table entries were forgotten)
    r = c.completions.create(model=NAME, prompt=SHARED + "Say hi.", max_tokens=MAX, temperature=0)
    assert r.choices[0].text == offline.generate([SHARED + "Say hi."], SamplingParams(max_tokens=MAX))[0].text

    # graceful stop: exit 0, every replica process gone
    dp_server.proc.send_signal(signal.SIGTERM)
    assert dp_server.proc.wait(30) == 0
    deadline = time.time() + 10
    left = set(replica_pids(dp_server).values())
    while left and time.time() < deadline:
        left = {p for p in left if _alive(p)}
        time.sleep(0.1)
    assert not left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _spawned_children(pid: int) -> list[int]:
    """Children of ``pid`` started by multiprocessing's spawn (not its resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(x) for x in f.read().split()]
    out = []
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                out.append(k)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads children from /proc")
def test_tensor_parallel_replicas_and_a_lost_worker(offline):
    """DP=2 x TP=2 (four engine processes on gloo): greedy output is one engine's; killing a
    TP worker of the replica serving a stream ends that stream with the WorkerFailed reason
    within seconds and the replica restarts while the other one serves."""
    s = Server(MODEL_DIR, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-num-seqs", "2",
               "--max-seq-len", "256", "--log-stats-interval", "0")
    try:
        s.wait(240)
        c = client(s)
        with ThreadPoolExecutor(2) as ex:
            got = list(ex.map(lambda p: c.completions.create(model="tiny-mamba2", prompt=p, max_tokens=MAX,
                                                             temperature=0).choices[0].text, PROMPTS[:4]))
        assert got == [o.text for o in offline.generate(PROMPTS[:4], SamplingParams(max_tokens=MAX))]
        pids = replica_pids(s)
        stream = iter(c.completions.create(model="tiny-mamba2", prompt=[5] * 20, max_tokens=200, temperature=0,
                                           stream=True))
        next(stream)
        victim = next(x["replica"] for x in health(s)[1]["replicas"] if x["in_flight"])
        (worker,) = _spawned_children(pids[victim])
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match=rf"engine replica {victim} \(pid {pids[victim]}\) failed: .*"
                                                  rf"WorkerFailed: rank 1 \(pid {worker}\) exited with code -9"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        assert health(s)[1]["replicas"][victim]["state"] == "restarting"
        r = c.completions.create(model="tiny-mamba2", prompt=PROMPTS[0], max_tokens=MAX, temperature=0)
        assert r.choices[0].text == got[0]   # the other replica
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)   # while the replica restarts: the start is cancelled
        assert s.proc.wait(30) == 0 and time.monotonic() - t0 < 15
    finally:
        s.stop()

"""Operating `replayssm serve`: version, tokenizer routes, logs, vLLM-named metrics, --config,
GPU defaults, and the graceful shutdown (a real server process, the `openai` client)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest
from server_helpers import API_KEY, MODEL

import replayssm
from replayssm.server import cli as serve_cli
from replayssm.server import engine_args
from replayssm.server.metrics import VLLM_NAMES, ServerMetrics
from replayssm.server.stats_log import StatsLogger

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def client(server, key=API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


# ---- version ---------------------------------------------------------------------------------------
def test_version_everywhere(plain_server, capsys):
    from replayssm import cli

    pyproject = (MODEL.parents[2] / "pyproject.toml").read_text()
    assert f'version = "{replayssm.__version__}"' in pyproject     # the one source of truth
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"replayssm {replayssm.__version__}"
    with pytest.raises(SystemExit) as e:
        serve_cli.build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"replayssm {replayssm.__version__}"
    assert httpx.get(plain_server.url + "/version").json() == {"version": replayssm.__version__}


# ---- tokenizer routes ------------------------------------------------------------------------------
def test_tokenize_detokenize_round_trip_and_counts_match_usage(plain_server):
    url, text = plain_server.url, "def fibonacci(n):\n    return é"
    tk = httpx.post(url + "/tokenize", headers=AUTH, json={"model": "tiny-chat", "prompt": text}).json()
    card = httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]
    assert tk["count"] == len(tk["tokens"]) and tk["max_model_len"] == card["max_model_len"]
    usage = client(plain_server).completions.create(model="tiny-chat", prompt=text, max_tokens=1).usage
    assert usage.prompt_tokens == tk["count"]                         # what generation counts
    plain = httpx.post(url + "/tokenize", headers=AUTH, json={"prompt": text, "add_special_tokens": False,
                                                              "return_token_strs": True}).json()
    assert plain["tokens"] == tk["tokens"][1:] and len(plain["token_strs"]) == plain["count"]
    back = httpx.post(url + "/detokenize", headers=AUTH, json={"model": "tiny-chat", "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # chat messages through the template count as the chat completion does
    msgs = [{"role": "user", "content": "hi there"}]
    chat_tk = httpx.post(url + "/tokenize", headers=AUTH, json={"messages": msgs}).json()
    r = client(plain_server).chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=1)
    assert chat_tk["count"] == r.usage.prompt_tokens
    rendered = httpx.post(url + "/detokenize", headers=AUTH, json={"tokens": chat_tk["tokens"]}).json()["prompt"]
    assert rendered == "user: hi there\nassistant:"


def test_tokenizer_routes_refuse_bad_input_by_name(plain_server):
    url = plain_server.url
    r = httpx.post(url + "/detokenize", headers=AUTH, json={"tokens": [5, 257, -1, 3]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tokens" and "257, -1" in err["message"] and "[0, 257)" in err["message"]
    r = httpx.post(url + "/detokenize", headers=AUTH, json={"tokens": "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    both = {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}
    r = httpx.post(url + "/tokenize", headers=AUTH, json=both)
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]
    r = httpx.post(url + "/tokenize", headers=AUTH, json={"prompt": "x", "model": "other"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):   # the /v1 key check
        assert httpx.post(url + path, json=body).status_code == 401
        assert httpx.post(url + path, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401


# ---- logs --------------------------------------------------------------------------------------------
def _wait_log(server, needle: str, timeout: float = 5.0) -> list[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        hits = [x for x in list(server.log) if needle in x]
        if hits:
            return hits
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not logged:\n" + "".join(server.log[-30:]))


def test_startup_summary_request_log_and_stats_lines(plain_server):
    summary = _wait_log(plain_server, "serve: model 'tiny-chat'")
    assert len(summary) == 1
    limit = httpx.get(plain_server.url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    for part in ("dtype float32", "device cpu", "decode mode replay", "speculation off", "slots 2",
                 f"context {limit} tokens", "memory plan", "prefix store", "CUDA graphs off",
                 f"replayssm {replayssm.__version__}"):
        assert part in summary[0], part
    secret = "SECRET-TAIL"
    prompt = "line one\nline two " + "x" * 40 + secret
    r = client(plain_server).completions.create(model="tiny-chat", prompt=prompt, max_tokens=5, temperature=0,
                                                seed=3)
    rid = r.id
    arrival = _wait_log(plain_server, f"request {rid}: ")[0]
    assert "'line one\\nline two " in arrival and "max_tokens=5" in arrival and "seed=3" in arrival
    assert f"of {r.usage.prompt_tokens} tokens" in arrival
    finish = _wait_log(plain_server, f"request {rid} finished")[0]
    assert "finish length" in finish and f"{r.usage.prompt_tokens} prompt + 5 completion tokens" in finish
    assert not any(secret in x for x in plain_server.log)            # only a short prefix is logged
    stats = _wait_log(plain_server, "stats: prompt throughput", timeout=3)[-1]
    for part in ("generation throughput", "running", "waiting", "state cache", "/2 slots", "prefix cache hit rate"):
        assert part in stats, part


def test_startup_summary_is_printed_once_below_info_level(spec_server):
    (line,) = _wait_log(spec_server, "serve: model 'tiny-mamba2'")
    assert line.startswith(f"replayssm {replayssm.__version__} serve:") and " INFO " not in line
    assert "speculation draft (3 tokens/step)" in line and "context 512 tokens" in line and "warmed up in" in line
    assert not any("stats:" in x for x in spec_server.log)              # info lines are below the level


def test_stats_line_only_with_traffic():
    class Loop:
        in_flight = 0

    m = ServerMetrics("t")
    m.last_occupancy = {"running": 0, "waiting": 0, "free_slots": 4, "total_slots": 4, "free_kv_blocks": 30,
                        "total_kv_blocks": 40, "prefix_hit_rate": 0.5}
    s = StatsLogger(m, Loop(), 10.0)
    t0 = s._last_t
    assert s.line(t0 + 10) is None                                    # nothing happened: no line
    m.on_prompt(100)
    m.on_tokens(50)
    m.totals.update(prefix_query_tokens=100, prefix_hit_tokens=25)
    m.last_occupancy.update(running=1, free_slots=3)
    line = s.line(t0 + 20)
    assert "prompt throughput 10.0 tokens/s" in line and "generation throughput 5.0 tokens/s" in line
    assert "running 1 reqs" in line and "state cache 1/4 slots (25.0%)" in line
    assert "KV blocks free 30/40" in line and "prefix cache hit rate 25.0%" in line
    assert "running 1 reqs" in s.line(t0 + 30)                        # still busy: a line, zero throughput
    m.last_occupancy.update(running=0, free_slots=4)
    assert s.line(t0 + 40) is None
    with pytest.raises(ValueError, match="interval"):
        StatsLogger(m, Loop(), 0)


# ---- metrics -----------------------------------------------------------------------------------------
def test_metrics_carry_vllm_names_under_our_prefix(plain_server):
    # one finished request first: a labelled counter has no sample line before its first event
    # (the session's server may not have served one yet when this test runs first)
    client(plain_server).completions.create(model="tiny-chat", prompt="import os\n", max_tokens=2, temperature=0)
    text = httpx.get(plain_server.url + "/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in VLLM_NAMES:
        base = name.removesuffix("_total")
        assert any(n in (f"replayssm:{name}", f"replayssm:{base}_count") for n in names), name
    assert 'replayssm:num_requests_running{model_name="tiny-chat"}' in text
    assert not any(n.startswith("replayssm_") for n in names)          # the old names are gone
    before = plain_server.metrics()
    r = client(plain_server).completions.create(model="tiny-chat", prompt="import os\n", max_tokens=4, temperature=0)
    m = plain_server.metrics()
    d = lambda k: m[k] - before.get(k, 0)  # noqa: E731
    assert d("replayssm:prompt_tokens_total") == r.usage.prompt_tokens
    assert d("replayssm:generation_tokens_total") == 4
    assert d("replayssm:request_queue_time_seconds_count") == 1
    assert d("replayssm:e2e_request_latency_seconds_count") == 1
    assert d("replayssm:request_prompt_tokens_sum") == r.usage.prompt_tokens
    assert m["replayssm:kv_cache_usage_perc"] == 0 and m["replayssm:num_preemptions_total"] == 0


def test_state_cache_usage_and_preemptions_from_the_engine():
    class Engine:
        stats = {"preemptions": 3}

        def occupancy(self):
            return {"running": 3, "waiting": 1, "free_slots": 1, "total_slots": 4, "free_kv_blocks": 10,
                    "total_kv_blocks": 40}

    class Loop:
        in_flight, step_failures = 4, 0

    m = ServerMetrics("t")
    m.refresh(Engine(), Loop())
    m.refresh(Engine(), Loop())                                       # counted once
    get = lambda n: m.registry.get_sample_value("replayssm:" + n, {"model_name": "t"})  # noqa: E731
    assert get("state_cache_usage_perc") == 0.75 and get("kv_cache_usage_perc") == 0.75
    assert get("num_preemptions_total") == 3 and get("num_requests_waiting") == 1


def test_concurrent_refreshes_count_preemptions_once():
    """GET /metrics refreshes from the server's thread while the engine thread does after each
    step (bench serve samples /metrics every 0.1 s): two refreshes at once add them once."""
    class Engine:
        stats = {"preemptions": 5}

        def occupancy(self):
            return {"running": 1, "waiting": 0, "free_slots": 1, "total_slots": 2, "free_kv_blocks": -1,
                    "total_kv_blocks": 0}

    class Loop:
        in_flight, step_failures = 1, 0

    m = ServerMetrics("t")
    counter = m.preemptions

    class SlowCounter:   # another thread runs between a refresh's check and its bookkeeping
        def inc(self, n):
            time.sleep(0.05)
            counter.inc(n)

    m.preemptions = SlowCounter()
    threads = [threading.Thread(target=m.refresh, args=(Engine(), Loop())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.registry.get_sample_value("replayssm:num_preemptions_total", {"model_name": "t"}) == 5


# ---- --config and flags ------------------------------------------------------------------------------
def test_config_file_gives_flags_and_the_command_line_wins(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model: {MODEL}\nmax_num_seqs: 3\nmax-queue: 7\nwarm-up: off\nenable_prefix_caching: true\n"
                   f"speculative-config: {{method: ngram, num_speculative_tokens: 2}}\nlog_stats_interval: 2.5\n")
    args = serve_cli.parse_args(["--config", str(cfg), "--max-num-seqs", "5"])
    assert args.model == str(MODEL) and args.max_num_seqs == 5 and args.max_queue == 7
    assert args.warm_up == "off" and args.enable_prefix_caching and args.log_stats_interval == 2.5
    assert '"num_speculative_tokens": 2' in args.speculative_config
    assert serve_cli.parse_args(["other-dir", "--config", str(cfg)]).model == "other-dir"
    m = f"model: {MODEL}\n"
    for body, needle in ((m + "max_num_seq: 3\nfoo: 1\n", "unknown keys ['foo', 'max_num_seq']"),
                         (m + "enable-prefix-caching: 'yes please'\n", "'enable-prefix-caching' is a switch"),
                         ("- a\n- b\n", "must be a mapping"),
                         (m + "max-num-seqs: [\n", "not valid YAML"),
                         (m + "max-num-seqs: many\n", "--max-num-seqs: invalid int value")):
        cfg.write_text(body)
        with pytest.raises(SystemExit) as e:
            serve_cli.parse_args(["--config", str(cfg)])
        assert e.value.code == 2 and needle in capsys.readouterr().err, needle
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "No such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_cli.parse_args([])
    assert "required: model" in capsys.readouterr().err


def test_cuda_graphs_by_default_on_cuda_and_enforce_eager(monkeypatch):
    seen = {}
    monkeypatch.setattr(engine_args, "LLM", lambda model, **kw: seen.update(kw) or kw)
    p = serve_cli.build_parser()
    serve_cli.build_engine("M", p.parse_args(["M", "--device", "cuda"]))
    assert seen["cuda_graphs"] is True and seen["dtype"] == "bfloat16"
    assert seen["max_seq_len"] is None                                 # the model's context (bounded by memory)
    serve_cli.build_engine("M", p.parse_args(["M", "--device", "cuda", "--enforce-eager"]))
    assert seen["cuda_graphs"] is False
    serve_cli.build_engine("M", p.parse_args(["M", "--device", "cuda", "--cuda-graphs"]))   # old flag: accepted
    assert seen["cuda_graphs"] is True
    serve_cli.build_engine("M", p.parse_args(["M", "--device", "cpu"]))
    assert seen["cuda_graphs"] is False and seen["gc_freeze"] is False
    serve_cli.build_engine("M", p.parse_args(["M", "--gc-freeze"]))
    assert seen["gc_freeze"] is True
    assert p.parse_args(["M"]).warm_up == "auto"                       # auto: on for CUDA


def test_preemption_mode_priority_and_hub_ids_reach_the_engine(monkeypatch, plain_server, tmp_path):
    """``--preemption-mode`` is the engine's; a request's ``priority`` (vLLM's field) reaches its
    SamplingParams; a Hub id that cannot be fetched offline is refused before anything loads."""
    import os
    import subprocess
    import sys

    from replayssm.server.protocol import CompletionRequest

    seen = {}
    monkeypatch.setattr(engine_args, "LLM", lambda model, **kw: seen.update(kw) or kw)
    p = serve_cli.build_parser()
    serve_cli.build_engine("M", p.parse_args(["M", "--device", "cpu"]))
    assert seen["preemption_mode"] == "swap"
    serve_cli.build_engine("M", p.parse_args(["M", "--device", "cpu", "--preemption-mode", "off"]))
    assert seen["preemption_mode"] == "off"
    req = CompletionRequest(prompt="x", priority=-3)
    assert req.sampling_params(4).priority == -3
    with pytest.raises(Exception, match="priority"):
        CompletionRequest(prompt="x", priority="high")
    r = client(plain_server).completions.create(model="tiny-chat", prompt="def f():", max_tokens=3,
                                                temperature=0, extra_body={"priority": 5})
    assert r.choices[0].finish_reason == "length"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "replayssm", "serve", "no-such-org/no-such-model", "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "no-such-org/no-such-model" in out.stderr and "HF_HUB_OFFLINE" in out.stderr


# ---- graceful shutdown -------------------------------------------------------------------------------
def test_sigterm_drains_streams_refuses_new_requests_and_exits_0(drain_server):
    """SIGTERM with 4 requests in flight: a short stream ends naturally ("length"), two long
    streams and a long non-streaming request end with "abort" after --shutdown-timeout (3 s),
    each with its final chunk / a whole response and no connection error; a request sent while
    draining gets 503 naming the shutdown; the process exits 0; then the port refuses."""
    url = drain_server.url
    cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    results, errors, started = {}, [], threading.Semaphore(0)

    def stream(name, max_tokens):
        try:
            finish, chunks = None, 0
            for ch in cl.completions.create(model="tiny-mamba2", prompt="def f(x):\n", max_tokens=max_tokens,
                                            stream=True, extra_body={"ignore_eos": True}):
                chunks += 1
                if chunks == 1:
                    started.release()
                finish = ch.choices[0].finish_reason or finish
            results[name] = (finish, chunks)
        except Exception as e:   # a connection error fails the test
            errors.append(f"{name}: {type(e).__name__}: {e}")
            started.release()

    def whole():
        try:
            started.release()
            r = cl.completions.create(model="tiny-mamba2", prompt="import os\n", max_tokens=4000,
                                      extra_body={"ignore_eos": True})
            results["whole"] = (r.choices[0].finish_reason, r.usage.completion_tokens)
        except Exception as e:
            errors.append(f"whole: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=("short", 30)), threading.Thread(target=stream, args=("a", 4000)),
               threading.Thread(target=stream, args=("b", 4000)), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=30)
    time.sleep(0.2)
    t_term = time.time()
    drain_server.proc.send_signal(signal.SIGTERM)
    refused = None
    while time.time() < t_term + 2.5:       # the drain window: up and answering 503
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        if r.status_code == 503:
            refused = r
            break
        time.sleep(0.05)
    assert refused is not None and "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError):
        cl.completions.create(model="tiny-mamba2", prompt="x", max_tokens=1)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert results["short"][0] == "length"
    assert results["a"][0] == results["b"][0] == "abort" and results["a"][1] > 1
    assert results["whole"][0] == "abort" and 0 < results["whole"][1] < 4000
    assert drain_server.proc.wait(15) == 0
    assert time.time() - t_term < 3 + 10
    with pytest.raises(httpx.ConnectError):    # the socket is closed once the server exited
        httpx.get(url + "/health", timeout=2)
    out = "".join(drain_server.log)
    assert "SIGTERM: draining" in out and "aborted 3 sequences" in out and "Traceback" not in out

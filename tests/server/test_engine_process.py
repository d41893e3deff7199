"""``serve --engine-process on``: the single engine in a process of its own (the replica
machinery with one replica), end to end on CPU with the real `openai` client, against the
engine in the API process (``plain_server``, the same flags) and the offline engine.

Every feature of the in-process server goes through the pipe: streaming, n > 1, logprobs,
echo, structured outputs, tool calls (a grammar), priorities, prefix caching of prompts and
of replies, the tokenizer routes, the metric names, error mapping (a bad request beside good
ones), a client that leaves, a full queue, and a graceful SIGTERM (it stops the module's server);
then servers of their own: preemption and priorities on a tiny hybrid under a small memory
budget (both placements), and a killed engine process (restarted, then the exit).
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest
from server_helpers import API_KEY, CHAT_TEMPLATE, Server, open_stream
from server_helpers import wait_idle as _wait_idle

from replayssm import SamplingParams

NAME = "tiny-chat"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Foo:\n    def", "for i in range(", "x = [1, 2,"]
MAX = 8
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def proc_server(chat_model_dir):
    """``plain_server``'s flags with the engine in its own process, plus a tool-call parser."""
    s = Server(chat_model_dir, "--engine-process", "on", "--api-key", API_KEY, "--max-num-seqs", "2",
               "--max-queue", "1", "--served-model-name", NAME, "--enable-prefix-caching", "--max-model-len", "2048",
               "--log-stats-interval", "0", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
               "--shutdown-timeout", "3")
    yield s.wait(180)
    s.stop()


@pytest.fixture(params=["in_process", "engine_process"])
def server(request, plain_server, proc_server):
    return plain_server if request.param == "in_process" else proc_server


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60, **kw)



def wait_idle(server, timeout=15.0) -> dict:
    """:func:`server_helpers.wait_idle` with a longer bound (a step crosses a process here)."""
    return _wait_idle(server, timeout)


def test_the_flag_decides_where_the_engine_runs(tmp_path, monkeypatch, capsys, serve_logging):
    """auto: its own process on CUDA only (and not under torchrun); on / off / --engine-in-process
    force it; contradictions are refused by name, before any model loads; --config gives it too."""
    from server_helpers import MODEL

    from replayssm.server import cli as serve_cli

    def where(*flags):
        return serve_cli.engine_process(serve_cli.parse_args([str(MODEL), *flags]))

    for var in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(serve_cli.torch.cuda, "is_available", lambda: True)
    assert where() is True and where("--device", "cuda:1") is True
    assert where("--device", "cpu") is False and where("--engine-in-process") is False
    assert where("--engine-process", "off") is False and where("--engine-process", "on", "--device", "cpu") is True
    monkeypatch.setattr(serve_cli.torch.cuda, "is_available", lambda: False)
    assert where() is False and where("--engine-process", "on") is True
    with pytest.raises(ValueError, match="--engine-in-process runs one engine"):
        where("--engine-in-process", "--data-parallel-size", "2")
    assert serve_cli.main([str(MODEL), "--port", "0", "--engine-in-process", "--data-parallel-size", "2"]) == 2
    assert "--engine-in-process runs one engine" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(serve_cli.torch.cuda, "is_available", lambda: True)
    assert where() is False   # multi-node tensor parallelism: rank 0's engine stays in the API process
    with pytest.raises(ValueError, match="not supported under torchrun"):
        where("--engine-process", "on")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("WORLD_SIZE")
    # an engine that cannot be built: the engine process's error, exit 2, nothing left running
    assert serve_cli.main([str(MODEL), "--port", "0", "--engine-process", "on", "--device", "cpu",
                           "--max-seq-len", "-5", "--torch-threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: the engine process could not start: ValueError: " in err and "max_seq_len" in err, err
    cfg = tmp_path / "serve.yaml"
    for body, want in (("engine-in-process: true\n", "off"), ("engine_process: on\n", "on"),
                       ("engine-in-process: false\n", "auto")):
        cfg.write_text(f"model: {MODEL}\n" + body)
        assert serve_cli.parse_args(["--config", str(cfg)]).engine_process == want, body
    cfg.write_text(f"model: {MODEL}\nengine-in-process: sure\n")
    with pytest.raises(SystemExit):
        serve_cli.parse_args(["--config", str(cfg)])
    assert "'engine-in-process' is a switch" in capsys.readouterr().err


def test_it_runs_in_its_own_process(proc_server):
    out = "".join(proc_server.log)
    assert "engine process (pid " in out and "engine process pid " in out
    h = httpx.get(proc_server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert [r["state"] for r in h.json()["replicas"]] == ["up"]


def test_completions_stream_logprobs_echo_and_n(server, offline):
    c = client(server)
    refs = offline.generate(PROMPTS[:3], SamplingParams(max_tokens=MAX, logprobs=2))
    r = c.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=MAX, temperature=0, logprobs=2)
    for ch, ref in zip(sorted(r.choices, key=lambda x: x.index), refs):
        assert ch.text == ref.text and ch.finish_reason == "length"
        assert ch.logprobs.token_logprobs == pytest.approx([lp for lp, _ in ref.logprobs], abs=1e-4)
    assert r.usage.completion_tokens == 3 * MAX
    text, reasons, usage = "", [], None
    for ch in c.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=MAX, temperature=0, stream=True,
                                   echo=True, stream_options={"include_usage": True}):
        if ch.choices:
            text += ch.choices[0].text
            reasons.append(ch.choices[0].finish_reason)
        usage = ch.usage or usage
    ref = offline.generate([PROMPTS[3]], SamplingParams(max_tokens=MAX))[0]
    assert text == PROMPTS[3] + ref.text and reasons[-1] == "length" and usage.completion_tokens == MAX
    # n = 2 sampled with a seed: the samples are the offline engine's, on either side of the pipe
    r = c.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=MAX, temperature=0.9, seed=7, n=2)
    ref = offline.generate([PROMPTS[4]], SamplingParams(max_tokens=MAX, temperature=0.9, seed=7, n=2))[0]
    assert [ch.text for ch in sorted(r.choices, key=lambda x: x.index)] == [o.text for o in ref.samples]
    wait_idle(server)


def test_chat_stream_and_structured_outputs(server, offline):
    c = client(server)
    msgs = [{"role": "user", "content": "Say hi"}]
    ref = offline.chat(msgs, SamplingParams(max_tokens=MAX), chat_template=CHAT_TEMPLATE)[0]
    parts = [ch.choices[0].delta.content or "" for ch in
             c.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX, temperature=0, stream=True)]
    assert "".join(parts) == ref.text
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    r = c.completions.create(model=NAME, prompt="Person: ", max_tokens=40, temperature=0,
                             extra_body={"response_format": rf, "priority": -1})
    ref = offline.generate(["Person: "], SamplingParams(max_tokens=40, structured_outputs={"json": SCHEMA}))[0]
    assert r.choices[0].text == ref.text and set(json.loads(ref.text)) == {"name", "n"}
    r = c.completions.create(model=NAME, prompt="abab ", max_tokens=10, temperature=0,
                             extra_body={"guided_choice": ["yes", "no"], "priority": 3})
    assert r.choices[0].text in ("yes", "no")


def test_a_required_tool_call_goes_through_the_engine_process(proc_server, offline):
    """tool_choice "required": the grammar travels to the engine process with the request; the
    call is parsed out of exactly the text the offline engine writes under that grammar."""
    from replayssm.server.tools import make_tool_parser, tool_call_grammar

    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    no_space = {32: -100, 10: -100, 9: -100}   # else the tiny model pads the JSON with blanks forever
    r = client(proc_server).chat.completions.create(model=NAME, messages=msgs, tools=[WEATHER],
                                                    tool_choice="required", max_tokens=150, temperature=0,
                                                    parallel_tool_calls=False, logit_bias=no_space)
    grammar = tool_call_grammar(make_tool_parser("hermes"), [WEATHER], parallel=False)
    ref = offline.chat(msgs, SamplingParams(max_tokens=150, structured_outputs={"grammar": grammar},
                                            logit_bias=no_space), chat_template=CHAT_TEMPLATE, tools=[WEATHER])[0]
    assert ref.finish_reason == "stop" and r.usage.completion_tokens == len(ref.token_ids)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == json.loads(ref.text.split("<tool_call>")[1]
                                                                 .split("</tool_call>")[0])["arguments"]


def test_prefix_cache_of_prompts_and_replies(server, offline):
    """A chat's second turn resumes at the end of the first turn's reply (cached after it)."""
    c = client(server)
    msgs = [{"role": "user", "content": "You are a careful assistant. Answer in one line. " * 3 + "Hi?"}]
    m0 = wait_idle(server)
    a = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX, temperature=0)
    msgs += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "More?"}]
    b = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=MAX, temperature=0)
    assert b.choices[0].message.content == offline.chat(msgs, SamplingParams(max_tokens=MAX),
                                                        chat_template=CHAT_TEMPLATE)[0].text
    m1 = wait_idle(server)
    assert m1["replayssm:prefix_cache_replies_total"] > m0["replayssm:prefix_cache_replies_total"]
    assert m1["replayssm:prefix_cache_hits_total"] > m0["replayssm:prefix_cache_hits_total"]


def test_tokenizer_routes_and_metric_names_are_the_same(plain_server, proc_server):
    h, seen = {"Authorization": f"Bearer {API_KEY}"}, []
    for s in (plain_server, proc_server):
        tok = httpx.post(s.url + "/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False},
                         headers=h).json()
        back = httpx.post(s.url + "/detokenize", json={"tokens": tok["tokens"]}, headers=h).json()
        assert back["prompt"] == PROMPTS[0] and tok["max_model_len"] == 2048
        seen.append(tok)
    assert seen[0] == seen[1]
    names = [{ln.split("{")[0].split(" ")[0] for ln in httpx.get(s.url + "/metrics").text.splitlines()
              if ln and not ln.startswith("#")} for s in (plain_server, proc_server)]
    assert names[0] <= names[1]   # every in-process series, plus the replica's own
    assert {n for n in names[1] - names[0]} <= {n for n in names[1] if n.startswith("replayssm:dp_replica_")}


def test_a_bad_request_never_harms_the_others(server, offline):
    """Bad requests (400s) sent while two good streams run: the good ones finish exactly."""
    c = client(server)
    url, h = server.url + "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    got, errors = {}, []

    def good(i):
        try:
            got[i] = "".join(ch.choices[0].text for ch in c.completions.create(
                model=NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0, stream=True))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=good, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    bad = [{"prompt": [10 ** 6], "max_tokens": 2}, {"prompt": "x", "max_tokens": 5000},
           {"prompt": "x", "max_tokens": 2, "n": 9}, {"prompt": "x", "response_format": {"type": "json_schema"}},
           {"prompt": "x", "model": "other"}]
    for body in bad:
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    for t in ts:
        t.join(60)
    assert not errors, errors
    refs = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=24))
    assert [got[0], got[1]] == [ref.text for ref in refs]
    wait_idle(server)



def test_a_client_that_leaves_and_a_full_queue(proc_server, offline):
    m0 = wait_idle(proc_server)
    held = [open_stream(proc_server) for _ in range(3)]     # 2 running + 1 queued = capacity
    try:
        lines = held[0][2].iter_lines()   # (kept: a dropped line iterator closes the response)
        assert next(x for x in lines if x.startswith("data: "))
        assert proc_server.metrics()["replayssm:num_requests_in_flight"] == 3
        r = httpx.post(proc_server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "capacity" in r.json()["error"]["message"]
        assert r.headers.get("retry-after") == "1"
    finally:
        for cl, cm, _ in held:                                # every client goes away mid-stream
            cm.__exit__(None, None, None)
            cl.close()
    m = wait_idle(proc_server)
    gen = m["replayssm:generation_tokens_total"] - m0["replayssm:generation_tokens_total"]
    assert gen < 3 * 1500                                      # cancelled in the engine process
    key = f'replayssm:request_success_total{{finished_reason="abort",model_name="{NAME}"}}'
    assert m[key] - m0.get(key, 0) == 3
    r = client(proc_server).completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX, temperature=0)
    assert r.choices[0].text == offline.generate([PROMPTS[2]], SamplingParams(max_tokens=MAX))[0].text


def test_sigterm_drains_and_stops_the_engine_process(proc_server):
    """Last (it stops the module's server): a long stream ends with "abort" after the
    --shutdown-timeout (3 s), a new request gets 503, the server exits 0, the engine process too."""
    import os

    pid = int("".join(proc_server.log).split("engine process pid ")[1].split(")")[0])
    c = client(proc_server)
    got, started = {}, threading.Event()

    def long():
        for ch in c.completions.create(model=NAME, prompt="def f(x):", max_tokens=1900, stream=True,
                                       extra_body={"ignore_eos": True}):
            started.set()
            got["finish"] = ch.choices[0].finish_reason or got.get("finish")

    t = threading.Thread(target=long)
    t.start()
    assert started.wait(30)
    t0 = time.time()
    proc_server.proc.send_signal(signal.SIGTERM)
    deadline, refused = t0 + 2.5, None
    while time.time() < deadline and refused is None:
        r = httpx.post(proc_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        refused = r if r.status_code == 503 else None
        time.sleep(0.05)
    assert refused is not None and "shutting down" in refused.json()["error"]["message"]
    t.join(30)
    assert got["finish"] == "abort"
    assert proc_server.proc.wait(20) == 0
    assert time.time() - t0 < 3 + 10
    with pytest.raises(ProcessLookupError):
        for _ in range(50):   # the engine process exits with the server
            os.kill(pid, 0)
            time.sleep(0.1)
    assert "Traceback" not in "".join(proc_server.log)


def test_a_killed_engine_process_is_restarted_then_the_server_exits_1(chat_model_dir, offline):
    """The engine process killed mid-stream: the stream ends with an error naming it, the engine
    is restarted (--data-parallel-max-restarts 1) and serves the offline engine's text again;
    killed once more, no restart is left and the server exits 1 (as one in-process engine that
    fails does, so that a supervisor restarts it) instead of answering 503 forever."""
    import os

    s = Server(chat_model_dir, "--engine-process", "on", "--served-model-name", NAME, "--max-seq-len", "2048",
               "--data-parallel-max-restarts", "1", "--log-stats-interval", "0").wait(180)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)

        def pid():   # the engine process's, from the startup and restart log lines
            line = [ln for ln in s.log if "engine process (pid " in ln or "is back (pid " in ln][-1]
            return int(line.split("pid ")[1].split(")")[0].split(",")[0])

        for round_ in range(2):
            victim = pid()
            with pytest.raises(openai.APIError, match=rf"engine replica 0 \(pid {victim}\) was killed by SIGKILL"):
                for k, _ in enumerate(c.completions.create(model=NAME, prompt="def f(x):", max_tokens=1900,
                                                           stream=True, extra_body={"ignore_eos": True})):
                    if k == 2:
                        os.kill(victim, signal.SIGKILL)
            if round_ == 0:
                deadline = time.time() + 120
                while httpx.get(s.url + "/health").json()["status"] != "ok" and time.time() < deadline:
                    time.sleep(0.2)
                assert pid() != victim
                r = c.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX, temperature=0)
                assert r.choices[0].text == offline.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX))[0].text
        assert s.proc.wait(30) == 1
        out = "".join(s.log)
        assert "replayssm serve: error: engine failed: engine replica 0" in out and "Traceback" not in out
    finally:
        s.stop()


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A tiny Nemotron-H hybrid (attention KV in a paged pool: a small budget forces preemption)."""
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=4, hybrid_override_pattern="M*M-", num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=2, mamba_n_groups=2, conv_kernel=4, eos_token_id=None)
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("preempt") / "nemotron_h"
    transformers.NemotronHForCausalLM(cfg).save_pretrained(str(d))
    return d


LONG = 100


@pytest.mark.parametrize("where", ["off", "on"])
def test_preemption_and_priorities_through_the_server(hybrid_dir, where):
    """Six requests into four slots whose block pools hold two sequences' worth: the engine
    preempts (swaps to host memory and back) and every greedy output is still the unconstrained
    engine's; the preemptions reach /metrics; a priority -5 request sent while priority-0 ones
    wait is admitted before them (it finishes before any of them)."""
    import asyncio

    import torch

    from replayssm import LLM

    kw = dict(dtype="float64", decode_mode="replay", kv_block_size=4, max_seq_len=128)
    prompts = [[(7 * i + 3 * j + 2) % 61 for j in range(4 + 3 * (i % 3))] for i in range(6)]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [o.token_ids for o in LLM(str(hybrid_dir), max_num_seqs=6, **kw).generate(
            prompts, SamplingParams(max_tokens=LONG, ignore_eos=True))]
        probe = LLM(str(hybrid_dir), max_num_seqs=4, memory_budget=1 << 32, **kw)
        mem = probe.plan.memory
        budget = (1 << 32) - probe.blocks.pool_bytes + 2 * mem.dynamic(56 + mem.verify_tokens)
    finally:
        torch.set_num_threads(n)
    s = Server(hybrid_dir, "--engine-process", where, "--dtype", "float64", "--mode", "replay", "--kv-block-size", "4",
               "--max-seq-len", "128", "--max-num-seqs", "4", "--memory-budget", str(budget), "--log-stats-interval",
               "0", "--served-model-name", "h").wait(180)
    try:
        async def main():
            ac = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
            done = []

            async def one(i, prompt, priority=0, max_tokens=LONG):
                r = await ac.completions.create(model="h", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                extra_body={"ignore_eos": True, "return_token_ids": True,
                                                            "priority": priority})
                done.append(i)
                return r.choices[0].token_ids

            tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
            for _ in range(200):   # the urgent one comes while priority-0 requests wait
                m = await asyncio.to_thread(s.metrics)
                if m["replayssm:num_requests_waiting"] >= 1:
                    break
                await asyncio.sleep(0.01)
            assert m["replayssm:num_requests_waiting"] >= 1 and not done
            urgent = asyncio.ensure_future(one("urgent", prompts[0][:3], priority=-5, max_tokens=2))
            got = await asyncio.gather(*tasks)
            await urgent
            return got, done
        got, done = asyncio.run(main())
        assert got == want
        assert done[0] == "urgent"   # admitted ahead of the priority-0 queue
        m = s.metrics()
        assert m["replayssm:num_preemptions_total"] >= 1
    finally:
        s.stop()

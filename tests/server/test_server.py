"""The OpenAI-compatible server, end to end: real processes, the `openai` client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_helpers import API_KEY, open_stream, wait_idle

from replayssm import SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\n", "class Foo:\n    def", "for i in range(", "x = [1, 2,",
           "# compute the", "return self.", "def __init__(self"]
MAX = 8


def client(server, key=API_KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def offline_greedy(offline, prompt, n=MAX, ids=None):
    out = offline.generate([ids if ids is not None else prompt], SamplingParams(max_tokens=n))[0]
    return out



# ---- plain server: completions, chat, parity ---------------------------------------------------
def test_completions_greedy_match_offline(plain_server, offline):
    c = client(plain_server)
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]
    for prompt in PROMPTS[:2]:
        ref = offline_greedy(offline, prompt)
        r = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=MAX, temperature=0, logprobs=0)
        ch = r.choices[0]
        assert ch.text == ref.text and ch.finish_reason == "length"
        assert ch.logprobs.tokens == [offline.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
        assert r.usage.completion_tokens == MAX and r.usage.prompt_tokens == len(ref.prompt_token_ids)
        # streamed: the same text, in pieces, then usage in a last chunk without choices
        chunks = list(c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=MAX, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.text for k in chunks for ch in k.choices) == ref.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX
        assert [ch.finish_reason for k in chunks for ch in k.choices][-1] == "length"
        plain = list(c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=MAX, temperature=0,
                                          stream=True))
        assert plain[-1].usage.completion_tokens == MAX and plain[-1].choices[0].finish_reason == "length"
        assert all(k.usage is None for k in plain[:-1])
    # token-id prompts
    ids = offline.tokenizer.encode(PROMPTS[2]).ids
    r = c.completions.create(model="tiny-chat", prompt=ids, max_tokens=MAX, temperature=0)
    assert r.choices[0].text == offline_greedy(offline, None, ids=ids).text


def test_chat_greedy_matches_offline(plain_server, offline):
    c = client(plain_server)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
    ids = offline.tokenizer.encode(text, add_special_tokens=False).ids
    ref = offline_greedy(offline, None, ids=ids)
    r = c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=MAX, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(k.usage is None for k in chunks[:-1])
    assert "".join(ch.delta.content or "" for k in chunks for ch in k.choices) == ref.text
    assert chunks[-1].usage.total_tokens == len(ids) + MAX


def test_sampling_parameters_over_http(plain_server, offline):
    c = client(plain_server)
    ref = offline_greedy(offline, PROMPTS[0], 12)
    stop = ref.text[4:6]
    r = c.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == ref.text[: ref.text.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.text for k in c.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=12,
                                                             temperature=0, stop=stop, stream=True)
                       for ch in k.choices)
    assert streamed == r.choices[0].text                        # nothing past the stop was streamed
    kw = dict(model="tiny-chat", prompt=PROMPTS[1], max_tokens=6, temperature=0.8, top_p=0.9, seed=4, n=2,
              presence_penalty=0.5, frequency_penalty=0.2,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    a = c.completions.create(**kw)
    b = c.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1]
    assert [x.text for x in a.choices] == [x.text for x in b.choices]       # seeded
    r = c.completions.create(model="tiny-chat", prompt=PROMPTS[:2], max_tokens=MAX, temperature=0)
    assert [(x.index, x.text) for x in r.choices] == [(i, offline_greedy(offline, p).text)
                                                      for i, p in enumerate(PROMPTS[:2])]
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                  logprobs=True, top_logprobs=2, temperature=0)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)


# ---- plain server: faults -------------------------------------------------------------------
def test_errors_are_openai_style_and_name_the_field(plain_server):
    url = plain_server.url + "/v1/completions"
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url, content=b'{"prompt": "x", ', headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    cases = [({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
             ({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": "x", "top_p": 2.0}, "top_p"),
             ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "stop": 5}, "stop"), ({"max_tokens": 3}, "prompt"),
             ({"prompt": "x", "model": "gpt-9"}, "model"), ({"prompt": "x" * 3000}, "prompt"),
             ({"prompt": "x", "max_tokens": 2047}, "max_tokens"), ({"prompt": [1, 99999]}, "prompt"),
             ({"prompt": "x", "presence_penalty": 5.0}, "presence_penalty"), ({"prompt": "x", "n": 3}, "n"),
             ({"prompt": ["a", "b"], "n": 2}, "prompt"), ({"prompt": "x", "echo": True, "logprobs": 1}, "echo")]
    for body, field in cases:
        r = httpx.post(url, json=body, headers=h)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error", (body, err)
    c = client(plain_server)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="tiny-chat", prompt="x", max_tokens=-1)


def test_hostile_inputs_are_400s_before_the_engine(plain_server, offline):
    """Values that used to reach the engine step (a top_k too large for its tensor failed the
    whole step, every request in flight with it), lone surrogates (500 from the tokenizer),
    a multi-megabyte prompt (tokenized for seconds, the server frozen meanwhile), unbounded
    stop lists and tool / JSON-mode requests: each a 400 naming its field, fast; the server
    then answers as before."""
    url = plain_server.url
    h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    raw = [(b'{"prompt": "x", "top_k": 1' + b"0" * 400 + b"}", "/v1/completions", "top_k"),
           (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "/v1/completions", "prompt"),
           (b'{"messages": [{"role": "user", "content": "hi \\udc80"}]}',
            "/v1/chat/completions", "messages")]
    for body, route, field in raw:
        r = httpx.post(url + route, content=body, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * (8 << 20), "max_tokens": 2}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "characters" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5.0
    words = "ab " * 6_000           # between the head (8 chars per context token) and the bound (2 x 5 here)
    err = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 2}, headers=h).json()["error"]
    assert err["param"] == "prompt" and "in its first" in err["message"], err
    chat = [({"stop": [f"s{i}" for i in range(65)]}, "stop"), ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ({"response_format": {"type": "yaml"}}, "response_format"), ({"tool_choice": "required"}, "tool_choice")]
    for extra, field in chat:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)
    ok = client(plain_server).completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=MAX, temperature=0)
    assert ok.choices[0].text == offline_greedy(offline, PROMPTS[0]).text
    wait_idle(plain_server)


def test_openai_shapes_nulls_and_model_cards(plain_server, offline):
    """Messages say what a union field takes; ``null`` means the default where the OpenAI API
    allows it; ``GET /v1/models/{id}`` (the client's ``models.retrieve``) answers."""
    url = plain_server.url
    h = {"Authorization": f"Bearer {API_KEY}"}
    for prompt in ([1.5], [True], ["a", 1]):
        err = httpx.post(url + "/v1/completions", json={"prompt": prompt}, headers=h).json()["error"]
        assert err["param"] == "prompt" and "list of token ids" in err["message"], err
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    err = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": image}]},
                     headers=h).json()["error"]
    assert err["param"] == "messages" and "image and audio parts are not supported" in err["message"], err
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": MAX, "temperature": 0, "n": None,
                                                 "stream": None, "echo": None}, headers=h)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline_greedy(offline, PROMPTS[1]).text
    c = client(plain_server)
    assert c.models.retrieve("tiny-chat").id == "tiny-chat"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-9")


def test_prefix_cache_hits_over_http(plain_server, offline):
    """A long shared prefix sent twice with different endings: the second request resumes from
    the cached prefix (exactly the tokens the first one's whole blocks cover, up to where the
    prompts differ), its text is the uncached engine's, and /metrics counts the hit."""
    shared = "You are a careful assistant. Answer in one line.\n" * 4
    prompts = [shared + "Q: what is 2+2?\nA:", shared + "Q: name a colour.\nA:"]
    refs = [offline_greedy(offline, p) for p in prompts]
    a, b = (ref.prompt_token_ids for ref in refs)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    bs = 16                                                  # --kv-block-size default
    assert common >= 2 * bs
    want = min(common, len(a) // bs * bs, len(b) - 1)
    c = client(plain_server)
    seen = [wait_idle(plain_server)]
    for p, ref in zip(prompts, refs):
        r = c.completions.create(model="tiny-chat", prompt=p, max_tokens=MAX, temperature=0)
        assert r.choices[0].text == ref.text
        seen.append(wait_idle(plain_server))
    delta = [{k: m1[k] - m0[k] for k in ("replayssm:prefix_cache_queries_total", "replayssm:prefix_cache_hits_total")}
             for m0, m1 in zip(seen, seen[1:])]
    assert [d["replayssm:prefix_cache_queries_total"] for d in delta] == [len(a), len(b)]
    assert delta[1]["replayssm:prefix_cache_hits_total"] == want
    m = seen[-1]
    assert m["replayssm:prefix_cache_blocks"] >= len(a) // bs
    assert 0 < m["replayssm:prefix_cache_hit_rate"] <= 1


def test_api_key(plain_server):
    with pytest.raises(openai.AuthenticationError):
        client(plain_server, key="wrong").completions.create(model="tiny-chat", prompt="x", max_tokens=1)
    r = httpx.post(plain_server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(plain_server.url + "/health").status_code == 200        # open routes
    assert httpx.get(plain_server.url + "/metrics").status_code == 200



def test_disconnect_mid_stream_frees_the_slot(plain_server, offline):
    cl, cm, resp = open_stream(plain_server)
    lines = resp.iter_lines()
    first = next(x for x in lines if x.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["text"]
    assert plain_server.metrics()["replayssm:num_requests_running"] == 1
    cm.__exit__(None, None, None)                   # the client goes away mid-stream
    cl.close()
    m = wait_idle(plain_server, timeout=10)
    assert m["replayssm:generation_tokens_total"] < 1500   # cancelled, not run to the end
    assert m['replayssm:request_success_total{finished_reason="abort",model_name="tiny-chat"}'] >= 1
    r = client(plain_server).completions.create(model="tiny-chat", prompt=PROMPTS[3], max_tokens=MAX, temperature=0)
    assert r.choices[0].text == offline_greedy(offline, PROMPTS[3]).text


def test_full_queue_answers_503_and_recovers(plain_server, offline):
    held = [open_stream(plain_server) for _ in range(3)]     # 2 running + 1 queued = capacity
    try:
        r = httpx.post(plain_server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "capacity" in r.json()["error"]["message"]
        assert r.headers.get("retry-after") == "1"
        with pytest.raises(openai.InternalServerError):
            client(plain_server).completions.create(model="tiny-chat", prompt="x", max_tokens=2)
    finally:
        for cl, cm, _ in held:
            cm.__exit__(None, None, None)
            cl.close()
    wait_idle(plain_server, timeout=10)
    r = client(plain_server).completions.create(model="tiny-chat", prompt=PROMPTS[4], max_tokens=MAX, temperature=0)
    assert r.choices[0].text == offline_greedy(offline, PROMPTS[4]).text
    assert httpx.get(plain_server.url + "/health").json()["status"] == "ok"


# ---- speculative server: parity and load ----------------------------------------------------------
def test_speculative_server_matches_offline_and_answers_chat(spec_server, offline):
    c = client(spec_server, key="unused")
    for prompt in PROMPTS[:3]:
        ref = offline_greedy(offline, prompt, 16)
        r = c.completions.create(model="tiny-mamba2", prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text
        s = "".join(ch.text for k in c.completions.create(model="tiny-mamba2", prompt=prompt, max_tokens=16,
                                                          temperature=0, stream=True) for ch in k.choices)
        assert s == ref.text
    msgs = [{"role": "user", "content": "hi"}]   # the shipped model's own chat template
    r = c.chat.completions.create(model="tiny-mamba2", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == offline.chat(msgs, SamplingParams(max_tokens=8))[0].text
    m = spec_server.metrics()
    assert m["replayssm:mean_accepted_length"] > 1.0


def test_load_32_streaming_clients(spec_server, offline):
    """32 concurrent streaming clients x 4 requests, speculation on: all complete, greedy text
    equals offline, and afterwards no slot is held."""
    want = {p: offline_greedy(offline, p).text for p in PROMPTS}
    ac = openai.AsyncOpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one_client(k: int):
        got = []
        for j in range(4):
            p = PROMPTS[(k + j) % len(PROMPTS)]
            stream = await ac.completions.create(model="tiny-mamba2", prompt=p, max_tokens=MAX, temperature=0,
                                                 stream=True)
            text, reason = "", None
            async for chunk in stream:
                for ch in chunk.choices:
                    text += ch.text
                    reason = ch.finish_reason or reason
            got.append((p, text, reason))
        return got

    async def run():
        try:
            return await asyncio.gather(*(one_client(k) for k in range(32)))
        finally:
            await ac.close()

    before = spec_server.metrics()
    t0 = time.perf_counter()
    results = asyncio.run(run())
    dt = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    assert len(flat) == 128
    assert all(reason == "length" for _, _, reason in flat)
    assert all(text == want[p] for p, text, _ in flat)
    m = wait_idle(spec_server, timeout=10)
    assert m["replayssm:generation_tokens_total"] - before["replayssm:generation_tokens_total"] == 128 * MAX
    assert m["replayssm:kv_free_blocks"] == -1 and m["replayssm:total_slots"] == 16
    print(f"load test: 128 streamed requests in {dt:.1f}s")

"""The FastAPI application: OpenAI-compatible routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` answers
server-sent events, one ``data: {chunk}`` per engine step that produced tokens, ending in
``data: [DONE]``; the last chunk carries ``usage``, or with ``stream_options.include_usage``,
as OpenAI does, one more chunk without choices does and the others have ``usage: null``),
``GET /v1/models``, ``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /version``.

Every refusal is an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``:
400 for invalid JSON, wrong types, values out of range, an unknown model name, a prompt
longer than the context or ``max_tokens`` past it, a chat request to a model without a chat
template; 401 for a missing or wrong key (with ``api_key``); 503 when the queue is full
or the server is shutting down (:meth:`AsyncEngine.drain`: ``/health`` answers 503 too).
A client that goes away is cancelled at the engine's next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import load_server_template
from .engine_loop import AsyncEngine, EngineError, QueueFull, RequestStream, ShuttingDown
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       error_body)
from .reasoning import ReasoningStreamer
from .stats_log import StatsLogger
from .tools import ToolStreamer, make_tool_parser, tool_call_grammar

log = logging.getLogger("replayssm.server")

DEFAULT_COMPLETION_TOKENS = 16   # OpenAI's default max_tokens for /v1/completions
#: a text prompt longer than this many characters per context token has its head counted first
HEAD_CHARS_PER_TOKEN = 8
#: what a union-typed field accepts, for the 400 when a value matches none of its forms
UNION_SHAPES = {
    "prompt": "must be a string, a list of token ids (ints), a list of strings or a list of token-id lists",
    "content": "message content must be a string or a list of text parts ({\"type\": \"text\", \"text\": ...}); "
               "image and audio parts are not supported",
    "stop": "must be a string or a list of strings",
}


@dataclass
class ServerConfig:
    model_name: str
    model_dir: str = ""
    api_key: str | None = None
    max_queue: int = 64
    max_model_len: int | None = None   # default: the engine's token limit
    chat_template: str | None = None   # override (string or file)
    log_requests: bool = False         # an info line per request at arrival and at finish
    log_stats_interval: float | None = 10.0   # seconds between stats lines (None: off)
    tool_call_parser: str | None = None       # hermes / qwen3 / nemotron (tools.py)
    enable_auto_tool_choice: bool = False     # parse calls out of the text with tool_choice "auto"
    reasoning_parser: str | None = None       # qwen3 / deepseek_r1 (reasoning.py)


def context_limit(engine) -> int:
    """Most tokens (prompt + generated) one sequence may hold."""
    sch = getattr(engine, "scheduler", None)
    if sch is not None and hasattr(sch, "token_limit"):
        return int(sch.token_limit)
    cfg = getattr(engine, "config", None)
    return int(getattr(cfg, "max_seq_len", 2048))


def max_token_chars(tok) -> int:
    """The most characters one token of ``tok`` stands for (the longest vocabulary entry;
    byte-level entries are at least as long as the text they decode to), so a text of more
    than ``limit * max_token_chars`` characters has more than ``limit`` tokens.  The server
    refuses such prompts before tokenizing them, with a factor 2 to spare normalizers that
    drop characters.  1 without a tokenizer (token-id prompts are counted directly)."""
    vocab = getattr(tok, "get_vocab", None)
    if vocab is None:
        return 1
    try:
        return max([len(k) for k in vocab(with_added_tokens=True)] or [1])
    except TypeError:   # a tokenizer without the keyword
        return max([len(k) for k in vocab()] or [1])


def build_app(engine, config: ServerConfig, engine_loop=None) -> FastAPI:
    """The app serving ``engine`` (anything with the step-wise API, e.g. ``LLM``).
    ``engine_loop``: an engine loop of its own with the :class:`AsyncEngine` interface and
    ``metrics`` (data parallelism's replica pool, :mod:`replayssm.server.dp`); ``engine`` then
    only gives the tokenizer, the context and the occupancy."""
    if engine_loop is None:
        metrics = ServerMetrics(config.model_name)
        slots = getattr(engine, "num_slots", None) or getattr(getattr(engine, "config", None), "max_num_seqs", 16)
        loop = AsyncEngine(engine, max_running=slots, max_queue=config.max_queue, metrics=metrics)
    else:
        loop, metrics = engine_loop, engine_loop.metrics
    tok = getattr(engine, "tokenizer", None)
    chat = load_server_template(config.model_dir, config.chat_template)   # a missing file raises
    limit = config.max_model_len or context_limit(engine)
    vocab = int(getattr(engine, "vocab_size", 0) or 0)
    chars_limit = 2 * limit * max_token_chars(tok)

    @asynccontextmanager
    async def lifespan(app):
        loop.start()
        stats = None
        if config.log_stats_interval:
            stats = asyncio.ensure_future(StatsLogger(metrics, loop, config.log_stats_interval).run())
        yield
        if stats is not None:
            stats.cancel()
        loop.shutdown()

    app = FastAPI(title="replayssm", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics, app.state.engine = loop, metrics, engine

    # -- errors --------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        e = errs[0] if errs else {"msg": "invalid request", "loc": ()}
        if e.get("type") == "extra_forbidden":   # never dropped silently: named
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            where = ".".join(loc)
            top = loc[-1] if len(loc) == 1 else loc[0]
            return JSONResponse(error_body(f"unknown field {where!r}: not a field of this API (nothing is ignored "
                                           f"silently)", param=top, code=400), status_code=400)
        if e.get("type") == "json_invalid":
            return JSONResponse(error_body(f"invalid JSON body: {e.get('ctx', {}).get('error', e['msg'])}", code=400),
                                status_code=400)
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # the field's name (drop pydantic's union-branch tags such as 'str' or 'list[int]')
        names = [x for x in loc if not x.isdigit() and x not in ("str", "int", "float", "bool")
                 and "[" not in x and "function" not in x]
        param = names[0] if names else (loc[0] if loc else None)
        where = ".".join(loc) if loc else "body"
        msg = f"{where}: {e['msg']}"
        shape = None
        if len(errs) > 1:
            shape = UNION_SHAPES["content"] if "content" in loc else UNION_SHAPES.get(param)
        if shape is not None:   # a value no branch of a union accepts: say what the field takes
            msg = f"{where.split('.str')[0].split('.list')[0]}: {shape}"
        if "input" in e and e.get("type") != "missing":
            msg += f" (got {json.dumps(e['input'], default=str)[:80]})"
        return JSONResponse(error_body(msg, param=param, code=400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # pragma: no cover - a bug of ours
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                            status_code=500)

    async def check_key(request: Request):
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error")

    def check_model(name):
        if name is not None and name != config.model_name:
            raise APIError(400, f"model {name!r} is not served here (this server serves {config.model_name!r})",
                           param="model")

    # -- info routes -----------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if hasattr(loop, "health"):   # several replicas: each one's state
            status, body = loop.health()
            return JSONResponse(body, status_code=status)
        if getattr(loop, "failed", None) is not None:
            return JSONResponse(error_body(f"engine failed: {loop.failed}", "internal_error"), status_code=503)
        if not loop.alive:
            return JSONResponse(error_body("engine loop is not running", "internal_error"), status_code=503)
        if loop.draining:
            return JSONResponse(error_body("server is shutting down", "service_unavailable", code=503),
                                status_code=503)
        return {"status": "ok", "in_flight": loop.in_flight, "steps": loop.steps}

    @app.get("/version")
    async def version():
        from .. import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        metrics.refresh(engine, loop)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return {"id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "replayssm",
                "root": config.model_dir, "max_model_len": limit}

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_key)])
    async def model_card(model_id: str):
        if model_id != config.model_name:
            raise APIError(404, f"model {model_id!r} is not served here (this server serves {config.model_name!r})",
                           type="not_found_error", param="model")
        return card()

    # -- helpers -----------------------------------------------------------------------------------
    def encode(prompt, param: str, special: bool = True, fit: bool = True) -> list[int]:
        """Token ids of a prompt (a string, or ids checked against the vocabulary); with
        ``fit`` (generation) also refused when empty or too long for the context."""
        if isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param=param)
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{param} is not valid Unicode (a lone surrogate at character {e.start})",
                               param=param) from None
            if len(prompt) > chars_limit:   # cannot fit: refused before tokenizing (seconds per MB, holding the GIL)
                raise APIError(400, f"{param} has {len(prompt)} characters, more than this model's context of "
                                    f"{limit} tokens can hold", param=param)

            def ids_of(text):
                try:
                    return tok.encode(text, add_special_tokens=special).ids
                except TypeError:   # a tokenizer without the keyword
                    return tok.encode(text).ids

            head = HEAD_CHARS_PER_TOKEN * limit
            if fit and len(prompt) > head:
                # a long text: count the tokens of a head cut at whitespace first (the words before
                # the cut tokenize as in the whole text), so an oversized prompt costs a bounded
                # tokenization, not one proportional to its size
                cut = max(prompt.rfind(c, 0, head) for c in " \n\t")
                if cut > 0 and len(ids_of(prompt[:cut])) > limit + 1:
                    raise APIError(400, f"{param} has more than {limit} tokens in its first {cut} characters; "
                                        f"this model's context is {limit} tokens (prompt + generated)", param=param)
            ids = ids_of(prompt)
        else:
            ids = list(prompt)
            check_ids(ids, param)
        if not fit:
            return ids
        if not ids:
            raise APIError(400, f"{param} is empty", param=param)
        if len(ids) + 1 > limit:
            raise APIError(400, f"{param} has {len(ids)} tokens; this model's context is {limit} tokens "
                                f"(prompt + generated)", param=param)
        return ids

    def check_ids(ids: list, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < vocab] if vocab else []
        if bad:
            shown = ", ".join(map(str, bad[:8])) + (f", ... ({len(bad)} in all)" if len(bad) > 8 else "")
            raise APIError(400, f"{param}: token ids out of this model's vocabulary [0, {vocab}): {shown}",
                           param=param)

    def max_tokens_for(n_prompt: int, requested: int | None, default: int | None) -> int:
        """``requested`` if it fits the context (else 400), otherwise ``default`` capped to the room."""
        room = limit - n_prompt
        if requested is not None:
            if n_prompt + requested > limit:
                raise APIError(400, f"max_tokens={requested} with a prompt of {n_prompt} tokens exceeds this "
                                    f"model's context of {limit} tokens", param="max_tokens")
            return requested
        return min(default, room) if default is not None else room

    def submit(reqs) -> RequestStream:
        n = reqs[0][2].n
        if n > loop.max_running:
            raise APIError(400, f"n={n} exceeds the {loop.max_running} sequences this server runs at once "
                                f"(the samples of a request run together)", param="n")
        seqs = sum(p.n for _, _, p in reqs)
        if seqs > loop.max_running + loop.max_queue:
            raise APIError(400, f"{len(reqs)} prompts x n={n} = {seqs} sequences can never fit this server "
                                f"({loop.max_running} running + {loop.max_queue} queued)", param="prompt")
        try:
            return loop.submit(reqs)
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded", headers={"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise APIError(503, str(e), "service_unavailable", headers={"Connection": "close"}) from None

    # -- tokenizer routes (vLLM's) -------------------------------------------------------------
    def need_tokenizer(param: str):
        if tok is None:
            raise APIError(400, "this model has no tokenizer (no tokenizer.json)", param=param)

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if req.chat():
            need_tokenizer("messages")
            msgs = [m.for_template(i) for i, m in enumerate(req.messages)]
            try:
                text = chat.render(msgs, req.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            ids = encode(text, "messages", special=bool(req.add_special_tokens), fit=False)
        else:
            need_tokenizer("prompt")
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = encode(req.prompt, "prompt", special=special, fit=False) if req.prompt else []
        body = {"tokens": ids, "count": len(ids), "max_model_len": limit}
        if req.return_token_strs:
            body["token_strs"] = [tok.id_to_token(t) for t in ids]
        return body

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        need_tokenizer("tokens")
        check_ids(req.tokens, "tokens")
        try:
            text = tok.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)
        except TypeError:   # a tokenizer without the keyword
            text = tok.decode(req.tokens)
        except Exception as e:   # an id the tokenizer has no entry for
            raise APIError(400, f"tokens: cannot decode: {e}", param="tokens") from None
        return {"prompt": text}

    # -- completions ---------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        req.check_refused()
        encoded = [truncate(encode(p, "prompt", special=req.add_special_tokens, fit=req.truncate_prompt_tokens is None),
                            req.truncate_prompt_tokens) for p in req.prompts()]
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs = []
        structured = req.structured()
        for i, ids in enumerate(encoded):
            mt = max_tokens_for(len(ids), req.max_tokens, DEFAULT_COMPLETION_TOKENS)
            reqs.append((f"{rid}-{i}", ids, req.sampling_params(mt, structured)))
        first = req.prompts()[0]
        echo = None
        if req.echo:   # the prompt's text before each choice's (token-id prompts decoded)
            echo = [p if isinstance(p, str) else decode(ids, req.skip_special_tokens)
                    for p, ids in zip(req.prompts(), encoded)]
        return await respond(req, raw, reqs, rid, "text_completion", encoded, first if isinstance(first, str) else None,
                             echo=echo)

    def decode(ids, skip: bool = True) -> str:
        if tok is None:
            raise APIError(400, "echo needs a tokenizer to show token-id prompts as text", param="echo")
        try:
            return tok.decode(list(ids), skip_special_tokens=skip)
        except TypeError:   # a tokenizer without the keyword
            return tok.decode(list(ids))

    def truncate(ids: list, keep: int | None) -> list:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (then checked
        against the context as any prompt)."""
        if keep is None:
            return ids
        ids = ids[-keep:]
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(ids) + 1 > limit:
            raise APIError(400, f"truncate_prompt_tokens={keep} leaves {len(ids)} tokens; this model's context is "
                                f"{limit} tokens (prompt + generated)", param="truncate_prompt_tokens")
        return ids

    def tool_plan(req: ChatCompletionRequest):
        """``(tool parser or None, structured-output constraint or None)`` of a chat request."""
        choice = req.effective_tool_choice()
        if choice == "none" or not req.tools:
            return None, None
        if config.tool_call_parser is None:
            raise APIError(400, f"tools (tool_choice {choice!r}) need the server started with --tool-call-parser "
                                f"(and --enable-auto-tool-choice for 'auto')",
                           param="tools" if req.tool_choice is None else "tool_choice")
        parser = make_tool_parser(config.tool_call_parser)
        if choice == "auto":
            if not config.enable_auto_tool_choice:
                raise APIError(400, "tool_choice 'auto' needs the server started with --enable-auto-tool-choice "
                                    "and --tool-call-parser", param="tool_choice")
            return parser, None
        # "required" or a named function: only a grammar makes the model call one
        from .protocol import engine_has

        if not engine_has("structured_outputs"):
            raise APIError(400, f"tool_choice {choice!r} needs constrained decoding (a grammar of the tool calls), "
                                f"which this engine does not have yet: use 'auto' or 'none'", param="tool_choice")
        if req.structured() is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with another "
                                "structured-output constraint", param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools
                 if choice == "required" or t.function.name == choice]
        grammar = tool_call_grammar(parser, tools, parallel=choice == "required" and req.parallel_tool_calls is not False)
        return parser, {"grammar": grammar}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        req.check_refused()
        parser, structured = tool_plan(req)
        msgs = req.template_messages()
        try:
            text = chat.render(msgs, req.add_generation_prompt, tools=req.template_tools(), documents=req.documents,
                               chat_template_kwargs=req.chat_template_kwargs)
        except ValueError as e:   # NoChatTemplate, or the template raised / failed to render
            msg = str(e)
            param = next((f for f in ("chat_template_kwargs", "documents", "tools") if f in msg), "messages")
            raise APIError(400, msg, param=param) from None
        ids = truncate(encode(text, "messages", special=req.add_special_tokens,
                              fit=req.truncate_prompt_tokens is None), req.truncate_prompt_tokens)
        mt = max_tokens_for(len(ids), req.requested_max_tokens, None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = req.sampling_params(mt, structured)

        def pipe():
            if parser is None and config.reasoning_parser is None:
                return None
            return _ChatPipe(ReasoningStreamer(config.reasoning_parser, text) if config.reasoning_parser else None,
                             ToolStreamer(parser) if parser is not None else None)

        return await respond(req, raw, [(f"{rid}-0", ids, params)], rid, "chat.completion", [ids], text, pipe=pipe)

    async def respond(req, raw: Request, reqs, rid: str, kind: str, encoded, preview: str | None = None,
                      echo: list | None = None, pipe=None):
        stream = submit(reqs)
        state = _Choices(reqs, req.n, tok, chat=kind == "chat.completion", token_ids=req.return_token_ids,
                         skip_special=req.skip_special_tokens, include_stop=req.include_stop_str_in_output,
                         echo=echo, pipe=pipe)
        head = {"id": rid, "created": int(time.time()), "model": config.model_name}
        n_prompt = sum(len(e) for e in encoded)
        done = None
        if config.log_requests:
            log.info("request %s: %s", rid, _arrival_summary(reqs, encoded, preview, req.stream))
            t0 = time.perf_counter()

            def log_finished(note: str = ""):
                log.info("request %s finished: %s", rid, _finish_summary(state, n_prompt, stream,
                                                                          time.perf_counter() - t0, note))
            done = log_finished
        if req.stream:
            gen = _sse(stream, state, head, kind, req.include_usage, n_prompt, loop, done)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await _collect(stream, state, raw, loop)
        except EngineError as e:
            if done is not None:
                done(f"engine error: {e}")
            raise APIError(500, str(e), "internal_error") from None
        if stream.closed is False:   # the client went away: nothing to answer
            if done is not None:
                done("client gone")
            return Response(status_code=499)
        if done is not None:
            done()
        err = state.error()
        if err is not None:
            raise APIError(*err)
        body = dict(head, object=kind, choices=state.final_choices(),
                    usage=_usage(n_prompt, state.completion_tokens()))
        return body

    return app


# ---- choice bookkeeping ----------------------------------------------------------------------
@dataclass
class _Choice:
    index: int
    stop_hold: int                  # chars held back while streaming (a stop string may start there)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    token_ids: list = field(default_factory=list)
    sent_lp: int = 0
    logprobs: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    role_sent: bool = False
    stops: tuple = ()
    prefix: str = ""                # echo: the prompt's text
    pipe: object = None             # _ChatPipe: reasoning / tool calls split out of the text


class _ChatPipe:
    """A chat choice's text through the reasoning parser, then the tool-call parser (on the
    content only): ``feed(piece, final) -> (reasoning, content, tool-call deltas)``."""

    def __init__(self, reasoning: ReasoningStreamer | None, tools: ToolStreamer | None):
        self.reasoning, self.tools = reasoning, tools

    def feed(self, piece: str, final: bool = False) -> tuple[str, str, list]:
        reasoning, content = self.reasoning.feed(piece, final) if self.reasoning is not None else ("", piece)
        deltas = []
        if self.tools is not None:
            content, deltas = self.tools.feed(content, final)
        return reasoning, content, deltas

    @property
    def calls(self) -> list:
        return self.tools.calls if self.tools is not None else []


class _Choices:
    """Per (engine request, sample) choice state: what was sent, what is final."""

    def __init__(self, reqs, n: int, tok, chat: bool, token_ids: bool = False, skip_special: bool = True,
                 include_stop: bool = False, echo: list | None = None, pipe=None):
        self.tok, self.chat, self.token_ids = tok, chat, token_ids
        self.skip_special, self.include_stop = skip_special, include_stop
        self.by_key: dict = {}
        for p, (rid, _, params) in enumerate(reqs):
            hold = max((len(s) for s in params.stop), default=1) - 1
            for j in range(n):
                self.by_key[(rid, j)] = _Choice(index=p * n + j, stop_hold=hold, stops=tuple(params.stop),
                                                prefix=echo[p] if echo else "", pipe=pipe() if pipe else None)

    def _decode(self, ids, skip: bool) -> str:
        try:
            return self.tok.decode(list(ids), skip_special_tokens=skip)
        except TypeError:
            return self.tok.decode(list(ids))

    def _text(self, c: _Choice, out) -> str:
        """The choice's text as asked: special tokens kept (``skip_special_tokens=false``,
        still cut at a stop string), the matched stop string kept (``include_stop_str_in_output``),
        after the prompt (``echo``)."""
        text = out.text
        if self.tok is not None and (not self.skip_special or self.include_stop):
            if not self.skip_special:
                full = self._decode(out.token_ids, False)
                cut = min((i for i in (full.find(s) for s in c.stops) if i >= 0), default=-1)
                text = full[:cut] if cut >= 0 and out.finish_reason == "stop" else full
            if self.include_stop and out.finish_reason == "stop" and c.stops:
                full = self._decode(out.token_ids, self.skip_special)
                hit = next((s for s in c.stops if full.startswith(s, len(text))), None)
                if hit is not None:
                    text += hit
        return c.prefix + text

    def update(self, out) -> _Choice:
        c = self.by_key[(out.request_id, getattr(out, "index", 0))]
        c.text, c.token_ids = self._text(c, out), list(out.token_ids)
        c.logprobs = out.logprobs
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason
            c.error = getattr(out, "error", None)
        return c

    def delta(self, c: _Choice) -> tuple[str, list]:
        """New text to send (holding back a possible stop-string start) and new logprobs."""
        end = len(c.text) if c.finish_reason is not None else max(len(c.text) - c.stop_hold, c.sent_chars)
        piece = c.text[c.sent_chars:end]
        c.sent_chars = end
        pairs = []
        if c.logprobs is not None:
            i0 = c.sent_lp
            pairs = list(zip(c.token_ids[i0:], c.logprobs[i0:]))
            c.sent_lp = i0 + len(pairs)
        return piece, pairs

    def error(self):
        for c in self.by_key.values():
            if c.finish_reason == "rejected":
                return (400, c.error or "request rejected", "invalid_request_error", "prompt")
            if c.finish_reason == "error":
                return (500, c.error or "engine error", "internal_error")
        return None

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.by_key.values())

    def final_choices(self) -> list:
        out = []
        for c in sorted(self.by_key.values(), key=lambda c: c.index):
            pairs = list(zip(c.token_ids, c.logprobs)) if c.logprobs is not None else None
            lp = self.format_logprobs(pairs, 0) if pairs is not None else None
            if self.chat:
                msg = {"role": "assistant", "content": c.text}
                reason = _reason(c.finish_reason)
                if c.pipe is not None:
                    reasoning, content, _ = c.pipe.feed(c.text, final=True)
                    msg["content"] = content if content.strip() else None
                    if c.pipe.reasoning is not None:
                        msg["reasoning_content"] = reasoning or None
                    if c.pipe.calls:
                        msg["tool_calls"] = c.pipe.calls
                        reason = "tool_calls"
                ch = {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": reason}
            else:
                ch = {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": _reason(c.finish_reason)}
            if self.token_ids:
                ch["token_ids"] = list(c.token_ids)
            out.append(ch)
        return out

    def token_str(self, t: int) -> str:
        if self.tok is None:
            return str(t)
        try:
            return self.tok.decode([t], skip_special_tokens=False)
        except TypeError:
            return self.tok.decode([t])

    def format_logprobs(self, pairs, offset: int):
        """OpenAI logprobs for ``[(token id, (logprob, [(id, logprob), ...])), ...]``."""
        if self.chat:
            content = []
            for t, (lp, top) in pairs:
                s = self.token_str(t)
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": self.token_str(i), "logprob": v,
                                                  "bytes": list(self.token_str(i).encode())} for i, v in top]})
            return {"content": content}
        tokens, lps, tops, offs = [], [], [], []
        pos = offset
        for t, (lp, top) in pairs:
            s = self.token_str(t)
            tokens.append(s)
            lps.append(lp)
            tops.append({self.token_str(i): v for i, v in top})
            offs.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def _reason(r):
    return r if r in ("stop", "length", "tool_calls") or r is None else ("abort" if r == "abort" else "error")


def _usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


async def _collect(stream: RequestStream, state: _Choices, raw: Request, loop: AsyncEngine) -> None:
    """Drain ``stream``; if the client disconnects meanwhile, cancel the request."""
    async def drain():
        async for out in stream:
            state.update(out)

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                return
            if await raw.is_disconnected():
                loop.abort(stream)
                task.cancel()
                return
    finally:
        if not task.done():
            task.cancel()


async def _sse(stream: RequestStream, state: _Choices, head: dict, kind: str, include_usage: bool, n_prompt: int,
               loop: AsyncEngine, on_done=None):
    """Server-sent events for one request; aborts the engine requests if the client leaves.
    ``on_done(note)``: called once at the end (request logging)."""
    obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"

    def chunk(choices, usage=None) -> str:
        body = dict(head, object=obj, choices=choices)
        if include_usage or usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        if state.chat:   # the role first, as OpenAI does
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in sorted(state.by_key.values(), key=lambda c: c.index)])
        try:
            async for out in stream:
                c = state.update(out)
                if c.finish_reason in ("error", "rejected"):
                    raise EngineError(c.error or "engine error")
                new_ids = c.token_ids[c.sent_tokens:]
                new_tokens = len(new_ids)
                c.sent_tokens = len(c.token_ids)
                piece, lps = state.delta(c)
                done = c.finish_reason is not None
                if not piece and not done and not new_tokens:
                    continue   # (a chunk per step with new tokens, even if their text is held back)
                lp = state.format_logprobs(lps, c.sent_chars - len(piece)) if c.logprobs is not None else None
                reason = _reason(c.finish_reason) if done else None
                extra = []   # tool-call deltas after the first: one chunk each, as OpenAI streams them
                if state.chat and c.pipe is not None:
                    reasoning, content, calls = c.pipe.feed(piece, done)
                    delta = {}
                    if reasoning:
                        delta["reasoning_content"] = reasoning
                    if content:
                        delta["content"] = content
                    if calls:
                        delta["tool_calls"] = calls[:1]
                        extra = calls[1:]
                    if done and c.pipe.calls and reason is not None:
                        reason = "tool_calls"
                    ch = {"index": c.index, "delta": delta, "logprobs": lp,
                          "finish_reason": None if extra else reason}
                elif state.chat:
                    ch = {"index": c.index, "delta": {"content": piece} if piece else {}, "logprobs": lp,
                          "finish_reason": reason}
                else:
                    ch = {"index": c.index, "text": piece, "logprobs": lp, "finish_reason": reason}
                if state.token_ids:
                    ch["token_ids"] = new_ids
                last = done and all(x.finish_reason is not None for x in state.by_key.values())
                # usage: in the last chunk, or (include_usage, as OpenAI) in one more without choices
                usage = _usage(n_prompt, state.completion_tokens()) if last and not include_usage else None
                for k, d in enumerate(extra):
                    yield chunk([ch], None)
                    ch = {"index": c.index, "delta": {"tool_calls": [d]}, "logprobs": None,
                          "finish_reason": reason if k == len(extra) - 1 else None}
                yield chunk([ch], usage)
        except EngineError as e:
            yield f"data: {json.dumps(error_body(str(e), 'internal_error', code=500))}\n\n"
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield chunk([], _usage(n_prompt, state.completion_tokens()))
        yield "data: [DONE]\n\n"
    finally:
        gone = not stream.closed
        if gone:   # the client went away (or the response was cancelled)
            loop.abort(stream)
        if on_done is not None:
            on_done("client gone" if gone else "")


#: characters of a prompt a request log line shows (escaped)
LOG_PROMPT_CHARS = 40


def _arrival_summary(reqs, encoded, preview: str | None, stream: bool) -> str:
    """One request's log line at arrival: sizes, a short escaped prompt prefix, its sampling."""
    p = reqs[0][2]
    if preview is not None:
        shown = ascii(preview[:LOG_PROMPT_CHARS]) + ("..." if len(preview) > LOG_PROMPT_CHARS else "")
    else:
        ids = encoded[0]
        shown = f"ids {ids[:8]}" + ("..." if len(ids) > 8 else "")
    sampling = [f"max_tokens={p.max_tokens}", f"temperature={p.temperature:g}"]
    if p.top_p < 1.0:
        sampling.append(f"top_p={p.top_p:g}")
    if p.top_k:
        sampling.append(f"top_k={p.top_k}")
    if p.n > 1:
        sampling.append(f"n={p.n}")
    if p.seed is not None:
        sampling.append(f"seed={p.seed}")
    if p.stop or p.stop_token_ids:
        sampling.append(f"stops={len(p.stop) + len(p.stop_token_ids)}")
    if p.logprobs is not None:
        sampling.append(f"logprobs={p.logprobs}")
    lens = [len(e) for e in encoded]
    return (f"{len(reqs)} prompt(s) of {lens if len(lens) > 1 else lens[0]} tokens, prompt {shown}, "
            f"{' '.join(sampling)}{', stream' if stream else ''}")


def _finish_summary(state: _Choices, n_prompt: int, stream: RequestStream, seconds: float, note: str) -> str:
    reasons = sorted({str(c.finish_reason) for c in state.by_key.values()})
    ttft = "" if stream.first_token is None else f", first token after {stream.first_token - stream.arrival:.3f} s"
    return (f"finish {'/'.join(reasons)}{' (' + note + ')' if note else ''}, {n_prompt} prompt + "
            f"{state.completion_tokens()} completion tokens, {seconds:.3f} s{ttft}")

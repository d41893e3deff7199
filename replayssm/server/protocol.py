"""Request bodies of the OpenAI-compatible API (pydantic, strict types) and error bodies.

Types are strict: ``"max_tokens": "16"`` or ``"temperature": true`` is a 400 naming the
field, as the OpenAI API answers, instead of a silent conversion.  No field is dropped
silently: an unknown field is a 400 naming it, and every known field of OpenAI's and vLLM's
APIs is either honoured or, where this server cannot do what it asks, refused by name
(:data:`REFUSED`: accepted only at its no-op values).  :meth:`SamplingFields.sampling_params` turns a
request into the engine's :class:`~replayssm.engine.config.SamplingParams`; its
``ValueError`` (a value out of range) becomes a 400 as well.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.config import SamplingParams


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.status)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    include_obfuscation: Optional[bool] = None     # OpenAI's padding of stream chunks: nothing to pad here
    continuous_usage_stats: bool = False          # vLLM's: usage in every chunk (refused when true)


def engine_has(field_name: str) -> bool:
    """Whether the engine's :class:`SamplingParams` has ``field_name`` (features another part
    of the engine adds are mapped once they exist, refused until then)."""
    return field_name in {f.name for f in dataclasses.fields(SamplingParams)}


#: fields of OpenAI's or vLLM's request bodies this server cannot honour: ``{name: (values
#: that ask for nothing, why)}``; any other value is a 400 naming the field
REFUSED = {
    "prompt_logprobs": ((None,), "prompt log-probabilities are not computed by this engine"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "kv_transfer_params": ((None,), "disaggregated prefill (KV transfer) is not supported"),
    "store": ((None, False), "completions are not stored by this server"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier"),
    "functions": ((None,), "the deprecated 'functions' API is not supported: use 'tools'"),
    "function_call": ((None,), "the deprecated 'function_call' is not supported: use 'tool_choice'"),
    "reasoning_effort": ((None,), "reasoning effort is not supported (use chat_template_kwargs, e.g. "
                                  "{\"enable_thinking\": false})"),
    "verbosity": ((None,), "verbosity is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1.0, 1), "length_penalty (beam search) is not supported"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported"),
    "logits_processors": ((None,), "custom logits processors are not supported"),
    "spaces_between_special_tokens": ((None, True), "detokenization always puts spaces between special tokens"),
    "detokenize": ((None, True), "outputs are always detokenized"),
    "return_tokens_as_token_ids": ((None, False), "use return_token_ids (the ids alongside the text)"),
    "guided_decoding_backend": ((None,), "the structured-output backend is the engine's"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "cache_salt": ((None,), "cache_salt is not supported"),
    "mm_processor_kwargs": ((None,), "this server serves text models only"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported"),
    "request_id": ((None,), "request_id is assigned by the server"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "chat_template": ((None,), "per-request chat templates are not accepted (the server's --chat-template is "
                               "used; template variables go in chat_template_kwargs)"),
    "min_tokens": ((None, 0), "min_tokens is not supported by this engine"),
    "bad_words": ((None, []), "bad_words is not supported by this engine"),
    "logit_bias": ((None, {}), "logit_bias is not supported by this engine"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
}
#: structured-output request fields (mapped to ``SamplingParams.structured_outputs`` when the
#: engine has it, refused by name until then)
STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


#: per request (OpenAI allows 4 stop strings; vLLM does not limit them)
MAX_STOP = 64
MAX_STOP_TOKEN_IDS = 1024


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = Field(default=1, ge=1)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    return_token_ids: bool = False     # extension: generated token ids in each choice / chunk
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # identifiers of the end user / the caller's bookkeeping: accepted, they change no output
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    priority: int = 0                  # vLLM's: lower runs first (admission order, last to be preempted)
    skip_special_tokens: bool = True   # vLLM's: special tokens left out of the text
    include_stop_str_in_output: bool = False   # vLLM's: a matched stop string ends the text
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=1)   # vLLM's: keep the prompt's last k tokens
    response_format: Optional[dict] = None
    # structured outputs (vLLM's) and the fields refused unless at a no-op value (REFUSED)
    structured_outputs: Optional[dict] = None
    guided_json: Optional[Union[str, dict]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    prompt_logprobs: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    kv_transfer_params: Any = None
    store: Any = None
    service_tier: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    logits_processors: Any = None
    spaces_between_special_tokens: Any = None
    detokenize: Any = None
    return_tokens_as_token_ids: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    cache_salt: Any = None
    mm_processor_kwargs: Any = None
    vllm_xargs: Any = None
    request_id: Any = None
    min_tokens: Any = None
    bad_words: Any = None
    logit_bias: Any = None

    @field_validator("n", "stream", "ignore_eos", "return_token_ids", "echo", "logprobs", "add_generation_prompt",
                     "skip_special_tokens", "include_stop_str_in_output", "add_special_tokens",
                     mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v, info):
        """``null`` means the default, as the OpenAI API allows for these fields (the last
        three are a subclass's: completions' ``echo`` / ``logprobs``, chat's)."""
        return cls.model_fields[info.field_name].default if v is None else v

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def check_refused(self) -> None:
        """A 400 naming the first field this server cannot honour at the value given."""
        for name, (noop, why) in REFUSED.items():
            if name not in type(self).model_fields:
                continue
            v = getattr(self, name)
            if name in ("min_tokens", "bad_words", "logit_bias") and engine_has(name):
                continue
            if not any(v == ok and type(v) is type(ok) or (v is None and ok is None) for ok in noop):
                raise APIError(400, f"{name} is not supported: {why} (got {json.dumps(v, default=str)[:60]})",
                               param=name)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise APIError(400, "stream_options.continuous_usage_stats is not supported (usage comes in the last "
                                "chunk)", param="stream_options")

    def structured(self) -> dict | None:
        """The request's structured-output constraint as ``SamplingParams.structured_outputs``
        (``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``),
        or ``None``; a 400 naming the field when the engine has no structured outputs."""
        given = [n for n in STRUCTURED if getattr(self, n) is not None]
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind not in ("text", "json_object", "json_schema"):
                raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', "
                                    f"got {kind!r}", param="response_format")
            if kind != "text":
                given.append("response_format")
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"give one structured-output constraint, not {', '.join(given)}", param=given[1])
        name = given[0]
        if not engine_has("structured_outputs"):
            raise APIError(400, f"{name} is not supported: this engine has no structured outputs (constrained "
                                f"decoding) yet", param=name)
        if name == "guided_json":
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise APIError(400, "guided_json is not valid JSON", param="guided_json") from None
            return {"json": schema}
        if name == "response_format":
            if rf["type"] == "json_object":
                return {"json_object": True}
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema must be {\"name\": ..., \"schema\": {...}}",
                               param="response_format")
            return {"json": js.get("schema", {})}
        kind = name.removeprefix("guided_")
        out = {kind: getattr(self, name)} if name != "structured_outputs" else dict(self.structured_outputs)
        grammar = out.get("grammar")
        if isinstance(grammar, str):   # checked here: a grammar that does not compile is the caller's 400
            try:
                from llguidance import LLMatcher

                problem = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar))
            except ImportError:
                problem = ""
            except Exception as e:   # the Lark text did not parse
                problem = str(e)
            if problem:
                raise APIError(400, f"{name}: the grammar does not compile: {problem[:300]}", param=name)
        return out

    def extra_sampling(self) -> dict:
        """``SamplingParams`` fields beyond the basic ones (present in the engine only)."""
        kw = {}
        for name in ("min_tokens", "bad_words", "logit_bias"):
            v = getattr(self, name)
            if v is not None and engine_has(name):
                kw[name] = v
        if isinstance(kw.get("logit_bias"), dict):   # JSON object keys are strings: "50256": -100
            bias = {}
            for k, v in kw["logit_bias"].items():
                try:
                    bias[int(k)] = v
                except (TypeError, ValueError):
                    raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias") from None
            kw["logit_bias"] = bias
        return kw

    def sampling_params(self, max_tokens: int, structured: dict | None = None) -> SamplingParams:
        """Engine parameters (OpenAI defaults: temperature 1, top_p 1); raises ValueError
        naming the field for values out of range."""
        self.check_refused()
        if structured is None:
            structured = self.structured()
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:   # vLLM's "no top-k"
            top_k = 0
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:   # every stop string is searched in every step's new text
            raise APIError(400, f"at most {MAX_STOP} stop strings, got {len(stop)}", param="stop")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
                           param="stop_token_ids")
        kw = dict(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                  top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
                  min_p=self.min_p or 0.0, seed=self.seed, stop=tuple(stop),
                  stop_token_ids=tuple(self.stop_token_ids or ()), n=self.n,
                  presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                  repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                  ignore_eos=self.ignore_eos, logprobs=self._logprobs(), priority=self.priority,
                  **self.extra_sampling())
        if structured is not None:
            kw["structured_outputs"] = structured
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e)
            field = msg.split(" ", 1)[0].removeprefix("SamplingParams.").split("[")[0]
            names = {"presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                     "min_p", "seed", "stop", "stop_token_ids", "n", "max_tokens", "logprobs", "priority",
                     "min_tokens", "bad_words", "logit_bias", "structured_outputs"}
            raise APIError(400, msg.replace("SamplingParams.", ""), param=field if field in names else None) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of
    either (one choice per prompt and sample)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Any = None
    best_of: Optional[int] = None
    add_special_tokens: bool = True    # vLLM's: the tokenizer's BOS etc. around a text prompt

    def _logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt log-probabilities)", param="echo")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        return self.logprobs

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCallIn(BaseModel):
    """An assistant message's tool call, as the OpenAI client sends it back."""
    model_config = ConfigDict(strict=True, extra="forbid")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None      # vLLM's newer name for reasoning_content
    # fields the OpenAI client returns in an assistant message (sent back as history)
    refusal: Optional[str] = None
    annotations: Optional[list] = None
    audio: Optional[dict] = None
    function_call: Optional[dict] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self, index: int) -> dict:
        """The message as transformers' chat templates take it: text content, tool calls with
        their ``arguments`` parsed into dicts (a string that is not a JSON object is a 400
        naming the message)."""
        if self.audio is not None:
            raise APIError(400, f"messages[{index}].audio: audio is not supported", param="messages")
        if self.function_call is not None:
            raise APIError(400, f"messages[{index}].function_call: the deprecated function_call is not supported "
                                f"(send tool_calls)", param="messages")
        m = {"role": self.role, "content": self.text() if self.content is not None or not self.tool_calls else None}
        if self.name:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        if self.tool_calls:
            calls = []
            for j, c in enumerate(self.tool_calls):
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise APIError(400, f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON: "
                                            f"{args[:60]!r}", param="messages") from None
                    if not isinstance(args, dict):
                        raise APIError(400, f"messages[{index}].tool_calls[{j}].function.arguments must be a JSON "
                                            f"object", param="messages")
                call = {"type": "function", "function": {"name": c.function.name, "arguments": args}}
                if c.id is not None:
                    call["id"] = c.id
                calls.append(call)
            m["tool_calls"] = calls
        return m


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict] = None
    chat_template: Any = None
    documents: Optional[list[dict]] = None
    echo: bool = False                    # vLLM's chat echo: refused
    add_special_tokens: bool = False      # vLLM's: the template writes the special tokens
    continue_final_message: Any = None

    def template_messages(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def effective_tool_choice(self):
        """``"none"``, ``"auto"``, ``"required"`` or the named function's name (a 400 naming
        ``tool_choice`` when it names no tool given or asks for calls without tools)."""
        tc = self.tool_choice
        if tc is None:
            return "auto" if self.tools else "none"
        if isinstance(tc, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if tc.function.name not in names:
                raise APIError(400, f"tool_choice names {tc.function.name!r}, which is not among the tools given "
                                    f"({', '.join(names) or 'none'})", param="tool_choice")
            return tc.function.name
        if tc == "required" and not self.tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return tc

    def _logprobs(self) -> int | None:
        if self.echo:
            raise APIError(400, "echo is not supported on chat completions", param="echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a ``prompt`` string, or chat ``messages`` rendered with
    the chat template first.  ``add_special_tokens`` defaults to true for a prompt and false
    for messages (the template writes them), as vLLM does."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def chat(self) -> bool:
        """True for messages; refuses both or neither."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either 'prompt' (a string) or 'messages' (a chat), not both or neither",
                           param="prompt" if self.prompt is not None else "messages")
        return self.messages is not None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: Optional[str] = None
    tokens: list[int]
    skip_special_tokens: bool = False

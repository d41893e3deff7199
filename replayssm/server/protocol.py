"""Request bodies of the OpenAI-compatible API (pydantic, strict types) and error bodies.

Types are strict: ``"max_tokens": "16"`` or ``"temperature": true`` is a 400 naming the
field, as the OpenAI API answers, instead of a silent conversion.  Unknown fields are
ignored (clients send vendor extensions).  :meth:`SamplingFields.sampling_params` turns a
request into the engine's :class:`~replayssm.engine.config.SamplingParams`; its
``ValueError`` (a value out of range) becomes a 400 as well.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

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
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


#: per request (OpenAI allows 4 stop strings; vLLM does not limit them)
MAX_STOP = 64
MAX_STOP_TOKEN_IDS = 1024


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

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
    user: Optional[str] = None
    logit_bias: Optional[dict] = None
    priority: int = 0                  # vLLM's: lower runs first (admission order, last to be preempted)

    @field_validator("n", "stream", "ignore_eos", "return_token_ids", "echo", "logprobs", "add_generation_prompt",
                     mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v, info):
        """``null`` means the default, as the OpenAI API allows for these fields (the last
        three are a subclass's: completions' ``echo`` / ``logprobs``, chat's)."""
        return cls.model_fields[info.field_name].default if v is None else v

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Engine parameters (OpenAI defaults: temperature 1, top_p 1); raises ValueError
        naming the field for values out of range."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
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
                  ignore_eos=self.ignore_eos, logprobs=self._logprobs(), priority=self.priority)
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e)
            field = msg.split(" ", 1)[0].removeprefix("SamplingParams.").split("[")[0]
            names = {"presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                     "min_p", "seed", "stop", "stop_token_ids", "n", "max_tokens", "logprobs", "priority"}
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
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def _logprobs(self) -> int | None:
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
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
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    # read only to refuse them: answering in plain text instead would be silently wrong
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is not supported (no tools)", param="tool_choice")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {self.response_format.get('type')!r} is not supported "
                                f"(only 'text')", param="response_format")
        return super().sampling_params(max_tokens)

    def _logprobs(self) -> int | None:
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

    model_config = ConfigDict(strict=True, extra="ignore")
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

    model_config = ConfigDict(strict=True, extra="ignore")
    model: Optional[str] = None
    tokens: list[int]
    skip_special_tokens: bool = False

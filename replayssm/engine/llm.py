"""The offline API: :class:`LLM` (``generate``, ``stream``), a thin loop over
:class:`~replayssm.engine.engine.LLMEngine`'s steps."""

from __future__ import annotations

import os
from typing import Iterator

from tqdm.auto import tqdm

from .config import SamplingParams, sampling_params_list
from .engine import LLMEngine
from .inputs import check_text, prompt_list
from .outputs import RequestOutput
from .sequence import Sequence

__all__ = ["LLM", "RequestOutput"]


class LLM(LLMEngine):
    """Generate with a Mamba-2 / Gated DeltaNet model (constructor: :class:`LLMEngine`)."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        # where chat() finds the model's chat template (a directory or Hub id; None: a loaded model)
        self._chat_source = (os.fspath(model), kwargs.get("revision")) if isinstance(model, (str, os.PathLike)) \
            else None
        self._chat_templates = None

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run ``prompts`` (one prompt or a list) to completion; one output per prompt, in order.
        A prompt that fails validation gets an output with ``finish_reason="error"`` and the
        message in ``error``, and the others run; bad arguments of the call itself raise."""
        prompts = prompt_list(prompts)
        params = sampling_params_list(sampling_params, len(prompts))
        seqs = []
        for p, sp in zip(prompts, params):
            try:
                seqs.append(self.add_request(p, sp))
            except ValueError as e:  # this request fails alone
                seqs.append(Sequence.failed(sp, str(e), p if isinstance(p, str) else None))
        bar = tqdm(total=len(seqs), desc="generate", unit="req") if use_tqdm else None
        done = 0
        while self.has_unfinished():
            self._step()
            if bar is not None:
                n = sum(all(m.is_finished for m in s.group) for s in seqs)
                bar.update(n - done)
                done = n
        if bar is not None:
            bar.close()
        outs = []
        for s in seqs:
            out = self.output(s)
            if len(s.group) > 1:
                out.samples = [self.output(m) for m in s.group]
            outs.append(out)
        return outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[list[int]]:
        """Generate one request, yielding lists of new token ids as they are accepted
        (``self.last_output`` holds its :class:`RequestOutput` afterwards)."""
        seq = self.add_request(prompt, params)
        while not seq.is_finished:
            before = len(seq.output_ids)
            self._step()
            if len(seq.output_ids) > before:
                yield seq.output_ids[before:]
        while self._inflight is not None and all(s.is_finished for s in self._inflight.seqs):
            self._step()   # async scheduling: a step left in flight with only this request's dropped row
        self.last_output = self.output(seq)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None, tools: list | None = None,
             add_generation_prompt: bool = True, documents: list | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content", ...}`` dicts) or
        a list of conversations, as vLLM's ``LLM.chat``: each is rendered with the model's chat
        template as transformers' ``apply_chat_template`` renders it
        (:mod:`replayssm.engine.chat_template`), tokenized without added special tokens (the
        template writes them) and run by :meth:`generate`; one output per conversation, its
        ``prompt`` the rendered text.

        ``chat_template``: template text, a file, or the name of one of the model's named
        templates, instead of the model's own.  ``chat_template_kwargs``: extra template
        variables (``{"enable_thinking": False}``).  ``tools``: JSON schemas as the OpenAI API
        sends them (``{"type": "function", "function": {...}}``); ``documents``: a list of
        dicts.  A conversation the template refuses (``raise_exception``) or that cannot be
        tokenized raises ``ValueError`` before anything runs.  Needs jinja2."""
        from .chat_template import ChatTemplate, ChatTemplateError

        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            conversations = list(messages)
        elif isinstance(messages, (list, tuple)) and messages:
            conversations = [messages]
        else:
            raise ValueError("messages must be a conversation (a non-empty list of message dicts) "
                             "or a list of conversations")
        if self._chat_templates is None:
            if self._chat_source is not None:
                from ..models import resolve_model_dir

                self._chat_templates = ChatTemplate.from_model_dir(resolve_model_dir(*self._chat_source))
            else:   # a loaded model: no directory to read a template from
                self._chat_templates = ChatTemplate(None)
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (tokenizer.json in the model directory)")
        prompts, texts = [], []
        for i, conv in enumerate(conversations):
            try:
                text = self._chat_templates.render(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                                   documents=documents, chat_template=chat_template,
                                                   chat_template_kwargs=chat_template_kwargs)
            except ChatTemplateError as e:
                raise ValueError(f"conversation {i}: {e}" if len(conversations) > 1 else str(e)) from None
            check_text(text, "the rendered chat")
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append(list(getattr(enc, "ids", enc)))
            texts.append(text)
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
            for s in out.samples:
                s.prompt = text
        return outs

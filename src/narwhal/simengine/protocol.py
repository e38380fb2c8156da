"""vLLM's OpenAI-compatible request fields and response shapes, as the simulator speaks them.

Parsing is strict about what the simulator cannot do (batched prompts, ``echo``, beam search)
and validates the sampling knobs as vLLM does, though their values do not change a deterministic
simulation; ``n``, logprobs, tools and response formats are in :mod:`openai_surface`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from narwhal.engines.context import (
    DEFAULT_COMPLETIONS_MAX_TOKENS,
    cut_max_tokens,
    max_tokens_refusal,
    min_tokens_refusal,
    output_cap,
    prompt_refusal,
    range_refusal,
)
from narwhal.engines.lax import lax_bool, lax_int, lax_token_ids
from narwhal.simengine.openai_surface import Invalid, SurfaceOptions, parse_surface
from narwhal.simengine.vocab import ChatTemplateError, Vocabulary, render_chat

__all__ = ["GenerationParams", "ProtocolError", "ResponseBuilder", "error_body", "parse_generation"]


class ProtocolError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type_: str = "BadRequestError",
        in_stream: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_
        # A streamed request's refusal by the engine itself (SamplingParams.verify): vLLM
        # answers 200 and sends it as the stream's only event, then [DONE].
        self.in_stream = in_stream


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


@dataclass(frozen=True)
class GenerationParams:
    chat: bool
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    kv_transfer_params: Any
    cache_salt: str | None = None
    # n, logprobs and guided output; the default is a plain greedy request's.
    surface: SurfaceOptions = field(default_factory=SurfaceOptions)
    # A chat answer's role: vLLM's "assistant", or with add_generation_prompt false the last
    # message's (its get_chat_request_role).
    role: str = "assistant"


def _int_field(body: dict[str, Any], name: str, ranged: bool = True) -> int | None:
    raw = body.get(name)
    if raw is None:
        return None
    value = lax_int(raw)  # vLLM's pydantic, lax: 2.0, "2", true
    if value is None:
        raise ProtocolError(f"{name} must be an integer", param=name)
    if ranged and (refusal := range_refusal(name, value)) is not None:
        raise ProtocolError(refusal.message, param=refusal.param)
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool = False) -> bool:
    raw = body.get(name, default)
    if raw is None:
        return default
    value = lax_bool(raw)  # vLLM's pydantic, lax: "true", 1, "off"
    if value is None:
        raise ProtocolError(f"{name} must be a boolean", param=name)
    return value


def _prompt_tokens(
    body: dict[str, Any], vocab: Vocabulary, chat: bool, generation_prompt: bool
) -> list[int]:
    if chat:
        if body.get("messages") == []:
            raise ProtocolError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        try:
            return vocab.encode(render_chat(body.get("messages"), generation_prompt))
        except ChatTemplateError as exc:
            raise ProtocolError(str(exc), param="messages") from exc
    prompt = body.get("prompt")
    if prompt == "":
        raise ProtocolError(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            param="prompt",
        )
    if prompt == []:
        raise ProtocolError("You must pass at least one prompt")
    if body.get("suffix") is not None:
        # vLLM 0.32 renders a suffix only for models with fill-in-the-middle completion
        # rendering (DeepSeek-V4's renderer); the simulated model has none.
        if body.get("echo"):
            raise ProtocolError("Echo is unsupported with suffix.", param="suffix")
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
        ):
            raise ProtocolError(
                "suffix is only supported for models with FIM completion rendering",
                param="suffix",
            )
        raise ProtocolError(
            "suffix requires text prompt input for FIM completion rendering", param="suffix"
        )
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return vocab.encode(prompt)
    # vLLM 0.32's lax list[int]: true and false are ids 1 and 0, 2.0 and "2" are 2.
    ids: list[int] | None = None
    # A list of strings only is text prompts (a batch); ["11", 10] is ids [11, 10].
    if isinstance(prompt, list) and prompt and not all(isinstance(t, str) for t in prompt):
        if all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            ids = lax_token_ids(prompt)
    if ids is not None:
        bad = vocab.check_ids(ids)
        if bad is not None:
            raise ProtocolError(f"Token id {bad} is out of vocabulary", param="prompt")
        return ids
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise ProtocolError("batched prompts are not supported by the simulator", param="prompt")
    raise ProtocolError("prompt must be a string or a non-empty list of token ids", param="prompt")


def parse_generation(
    body: Any, vocab: Vocabulary, chat: bool, max_model_len: int
) -> GenerationParams:
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    # Off as vLLM reads it (1.0 and "1" are 1; 0, "false" and "off" are false).
    if body.get("best_of") is not None and lax_int(body["best_of"]) != 1:
        raise ProtocolError("best_of is not supported", param="best_of")
    if body.get("echo") is not None and lax_bool(body["echo"]) is not False:
        raise ProtocolError("echo is not supported by the simulator", param="echo")
    try:
        surface = parse_surface(body, chat, vocab, body.get("kv_transfer_params"))
    except Invalid as exc:
        raise ProtocolError(exc.message, param=exc.param, type_=exc.type) from exc
    stream = _bool_field(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ProtocolError("stream_options must be an object", param="stream_options")
    if options and not stream:
        raise ProtocolError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ProtocolError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    # vLLM uses max_completion_tokens when given, and checks only the limit it uses.
    completion_cap = _int_field(body, "max_completion_tokens") if chat else None
    max_tokens, cap_name = output_cap(
        _int_field(body, "max_tokens", ranged=completion_cap is None), completion_cap
    )
    min_tokens = _int_field(body, "min_tokens") or 0  # vLLM 0.32 has no min_completion_tokens
    # vLLM 0.32's context rule, in its words (engines.context).
    refusal = max_tokens_refusal(max_tokens, cap_name, max_model_len)
    if refusal is not None:
        raise ProtocolError(refusal.message, param=refusal.param)
    generation_prompt = chat and _bool_field(body, "add_generation_prompt", default=True)
    prompt = _prompt_tokens(body, vocab, chat, generation_prompt)
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str | list):
        raw = raw[0]  # a batch of one
    ids = not chat and isinstance(raw, list)
    if (refusal := prompt_refusal(len(prompt), max_model_len, counted=ids)) is not None:
        raise ProtocolError(refusal.message, param=refusal.param)
    if max_tokens is None:
        max_tokens = max_model_len if chat else DEFAULT_COMPLETIONS_MAX_TOKENS
    max_tokens, refusal = cut_max_tokens(max_tokens, len(prompt), max_model_len)
    if refusal is None:
        refusal = min_tokens_refusal(min_tokens, max_tokens)
    if refusal is not None:
        raise ProtocolError(refusal.message, param=refusal.param)
    if (engine_refusal := surface.refusal) is not None:
        raise ProtocolError(engine_refusal.message, param=engine_refusal.param, in_stream=stream)
    return GenerationParams(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=_bool_field(body, "ignore_eos"),
        stream=stream,
        include_usage=_bool_field(options, "include_usage"),
        continuous_usage=_bool_field(options, "continuous_usage_stats"),
        return_token_ids=_bool_field(body, "return_token_ids"),
        kv_transfer_params=body.get("kv_transfer_params"),
        cache_salt=salt,
        surface=surface,
        # Rendered: a list of messages, each with a string role.
        role="assistant" if generation_prompt or not chat else str(body["messages"][-1]["role"]),
    )


def _usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None
        if cached_tokens is None
        else {"cached_tokens": cached_tokens},
    }


@dataclass
class ResponseBuilder:
    """Builds one request's OpenAI response or stream chunks, vLLM style."""

    params: GenerationParams
    request_id: str
    model: str
    created: int = 0
    # vLLM's --enable-prompt-tokens-details: usage carries prompt_tokens_details.cached_tokens
    # (set by the engine once the prompt's cache lookup is done).
    prompt_tokens_details: bool = False
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        self.created = int(time.time())
        prefix = "chatcmpl-" if self.params.chat else "cmpl-"
        self.response_id = prefix + self.request_id

    def full(
        self,
        text: str,
        tokens: list[int],
        finish_reason: str,
        kv_transfer_params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The non-streamed response of a one-choice request without logprobs or tools."""
        return self.full_choices(
            [self.full_choice(0, text, tokens, finish_reason)], len(tokens), kv_transfer_params
        )

    def full_choice(
        self,
        index: int,
        text: str,
        tokens: list[int],
        finish_reason: str,
        logprobs: dict[str, Any] | None = None,
        content: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        """One choice of a non-streamed response; ``content`` / ``tool_calls``: the chat
        message's when a tool call replaces the text (None: the text, no calls);
        ``stop_reason``: the stop string or stop token id that ended it."""
        p = self.params
        ids = tokens if p.return_token_ids else None
        if p.chat:
            message: dict[str, Any] = {
                "role": p.role,
                "content": text if content is None else content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
            }
            if tool_calls:  # vLLM 0.32's ChatMessage drops an empty list when serialised
                message["tool_calls"] = tool_calls
            message["reasoning"] = None
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": ids,
                "routed_experts": None,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "token_ids": ids,
            "routed_experts": None,
            "prompt_logprobs": None,
            "prompt_token_ids": p.prompt if p.return_token_ids else None,
        }

    def full_choices(
        self,
        choices: list[dict[str, Any]],
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The non-streamed response; usage counts every choice's tokens, as vLLM's does."""
        p = self.params
        if p.chat:
            body: dict[str, Any] = {"id": self.response_id, "object": "chat.completion"}
        else:
            body = {"id": self.response_id, "object": "text_completion"}
        usage = _usage(len(p.prompt), completion_tokens, self._cached())
        usage["completion_tokens_details"] = None
        body.update(
            created=self.created,
            model=self.model,
            choices=choices,
            service_tier=None,
            system_fingerprint=None,
            usage=usage,
        )
        # vLLM 0.32's top-level fields: a chat answer's prompt fields are top-level, a
        # completion's are in its choices.
        if p.chat:
            body.update(
                prompt_logprobs=None,
                prompt_token_ids=p.prompt if p.return_token_ids else None,
                prompt_text=None,
            )
        body.update(kv_transfer_params=kv_transfer_params, ec_transfer_params=None, metrics=None)
        return body

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.params.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        # vLLM 0.32 leaves an unset usage out of every chunk, completion and chat alike.
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """A chat stream's first chunk of choice ``index``: the assistant role, and, as vLLM
        0.32 sets them on it (null unless asked), the prompt's ids and text."""
        chunk = self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": self.params.role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        chunk["prompt_token_ids"] = self.params.prompt if self.params.return_token_ids else None
        chunk["prompt_text"] = None  # return_prompt_text is not simulated
        return chunk

    def token_chunk(
        self,
        text: str,
        tokens: list[int],
        finish_reason: str | None,
        completion_tokens: int,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        delta: dict[str, Any] | None = None,
        first: bool = False,
        stop_reason: str | int | None = None,
    ) -> dict[str, Any]:
        """A chunk of choice ``index``'s tokens; ``completion_tokens``: that choice's so far
        (what vLLM's continuous usage counts); ``delta``: a chat delta other than the text
        (tool-call deltas); ``first``: the choice's first token chunk (a completions stream's
        carries the prompt's ids, as vLLM 0.32 sends them, with ``return_token_ids``).
        ``token_ids`` (and a completions choice's ``prompt_token_ids``) are null unless the
        request asked for them, as vLLM serialises them: set, to None."""
        p = self.params
        if p.chat:
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": text} if delta is None else delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        choice["stop_reason"] = stop_reason
        if not p.chat:
            choice["prompt_token_ids"] = p.prompt if (first and p.return_token_ids) else None
        choice["token_ids"] = tokens if p.return_token_ids else None
        usage = (
            _usage(len(p.prompt), completion_tokens, self._cached())
            if (p.include_usage and p.continuous_usage)
            else None
        )
        return self._chunk([choice], usage)

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        usage = _usage(len(self.params.prompt), completion_tokens, self._cached())
        if usage["prompt_tokens_details"] is None:
            del usage["prompt_tokens_details"]  # vLLM drops None fields from the usage chunk
        return self._chunk([], usage)

    def _cached(self) -> int | None:
        return self.cached_tokens if self.prompt_tokens_details else None

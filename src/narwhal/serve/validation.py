"""Client request checks: parse the body once, validate the fields the router uses, refuse what
it cannot do faithfully, and estimate the prompt length. Everything else passes through to the
engines, which validate their own fields (their 4xx answers reach the client unchanged)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from typing import Any

import orjson

from narwhal.engines.context import (
    DEFAULT_COMPLETIONS_MAX_TOKENS,
    cut_max_tokens,
    max_tokens_refusal,
    min_tokens_refusal,
    output_cap,
    prompt_refusal,
    range_refusal,
    text_prompt_refusal,
)
from narwhal.engines.lax import lax_bool, lax_float, lax_int, lax_token_ids
from narwhal.routing.prompt_length import MAX_BYTES_PER_TOKEN
from narwhal.serve.errors import InvalidRequest, NotFound

__all__ = ["MAX_CHOICES", "ClientRequest", "parse_client_request", "parse_json_object"]

# The most choices (``n`` times the prompts of a batch) one request fans out into: each is a
# P/D request of its own, admitted and scheduled like any other.
MAX_CHOICES = 64

# Fields the router refuses, with why. Everything else (tools, tool_choice, response_format,
# structured outputs, logprobs, stop, seed, ...) passes through: the decode engine produces the
# whole answer, first token included, so it samples, constrains and parses as a lone engine
# would (docs/router.md lists every field).
_UNSUPPORTED: dict[str, str] = {
    "best_of": "best_of is not supported by the P/D router: it ranks candidates by their "
    "cumulative logprob on one engine, and each P/D candidate decodes on its own",
    "echo": "echo is not supported by the P/D router: an echo with logprobs needs the prompt's "
    "logprobs, which only the prefill engine computes and vLLM's KV handoff does not return",
    "prompt_logprobs": "prompt_logprobs are not supported by the P/D router: only the prefill "
    "engine computes the prompt, and vLLM's KV handoff returns no logprobs from it",
    "use_beam_search": "beam search is not supported by the P/D router: its beams fork and "
    "prune KV blocks on one engine",
    "functions": "'functions' is the deprecated form of 'tools', which vLLM does not accept: "
    "send 'tools'",
    "function_call": "'function_call' is the deprecated form of 'tool_choice', which vLLM does "
    "not accept: send 'tool_choice'",
    "kv_transfer_params": "kv_transfer_params is set by the router, not by clients",
    "ec_transfer_params": "ec_transfer_params is set by a disaggregating router, not by "
    "clients: it would point an engine at another host's encoder cache",
}


# Unsupported fields that vLLM types as booleans: "off" is whatever it reads as false (0, "0",
# "false", "off").
_BOOLEAN_FIELDS = frozenset({"echo", "use_beam_search"})


def _is_off(name: str, value: Any) -> bool:
    """Values of unsupported fields that mean "off" and are harmless to accept, as vLLM reads
    them."""
    if value is None or value is False:
        return True
    if name == "best_of":
        return lax_int(value) == 1
    if name in _BOOLEAN_FIELDS:
        return lax_bool(value) is False
    return isinstance(value, list) and not value


@dataclass(frozen=True)
class ClientRequest:
    chat: bool
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt_tokens_exact: int | None
    prompt_bytes: int = 0
    # n > 1 or a batch of prompts: one request per choice (index i * n + j for prompt i's
    # choice j, as vLLM numbers them), each with n = 1 and one prompt; empty otherwise.
    choices: tuple[ClientRequest, ...] = ()
    choices_per_prompt: int = 1


def _check_int(body: dict[str, Any], name: str, ranged: bool = True) -> int | None:
    """``body[name]`` as vLLM reads an integer field; with ``ranged``, also held to its least
    value (a field vLLM reads but does not use, such as a chat request's ``max_tokens`` beside
    its ``max_completion_tokens``, is checked for its type only)."""
    value = body.get(name)
    if value is None:
        return None
    number = lax_int(value)
    if number is None:
        raise InvalidRequest(f"'{name}' must be an integer", name)
    if ranged and (refusal := range_refusal(name, number)) is not None:
        raise InvalidRequest(refusal.message, refusal.param)
    if number is not value:
        body[name] = number  # 2.0 or "2", as vLLM reads it: the legs carry the integer
    return number


def _prompt_length(body: dict[str, Any], chat: bool) -> tuple[int | None, int]:
    """(exact token count if known, size of a text prompt in UTF-8 bytes)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty list", "messages")
        size = 0
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequest(
                    f"'messages[{i}]' must be an object with a string 'role'", f"messages[{i}]"
                )
            content = message.get("content")
            if isinstance(content, str):
                size += len(content.encode("utf-8", "surrogatepass"))
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        size += len(part["text"].encode("utf-8", "surrogatepass"))
            elif content is not None:
                raise InvalidRequest(
                    f"'messages[{i}].content' must be a string or a list of parts",
                    f"messages[{i}].content",
                )
            size += 8  # role markers of a chat template
        return None, max(1, size)
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty", "prompt")
        return None, len(prompt.encode("utf-8", "surrogatepass"))
    if isinstance(prompt, list) and prompt:
        # One C pass, no loop per token (a 12,000-token prompt: 0.07 ms, where checking each
        # element's type and the minimum took 0.38): every element an integer in [0, 2**64).
        # JSON's true and false pass as 1 and 0, as vLLM 0.32's lax list[int] reads them.
        try:
            array("Q", prompt)
        except OverflowError:
            raise InvalidRequest(
                "'prompt' token ids must be non-negative integers", "prompt"
            ) from None
        except TypeError:
            # Ids vLLM reads all the same (2.0, "2"): rewritten in place as integers, so the
            # engines, the prefix index and the lifecycle see the ids vLLM would.
            ids = lax_token_ids(prompt)
            if ids is None or max(ids) >= 2**64:
                raise InvalidRequest(
                    "'prompt' token ids must be non-negative integers", "prompt"
                ) from None
            prompt[:] = ids
        return len(prompt), 0
    raise InvalidRequest("'prompt' must be a string or a non-empty list of token ids", "prompt")


def _batch(body: dict[str, Any], chat: bool) -> list[Any]:
    """A completion's batch of prompts (strings or token-id lists); ``[]`` when it is not one."""
    prompt = body.get("prompt")
    if chat or not isinstance(prompt, list) or len(prompt) < 2:
        return []
    if isinstance(prompt[0], str | list):
        # OpenAI's and vLLM's prompt is a string, a list of strings, token ids or token-id
        # lists: a batch mixes none of them.
        kind = str if isinstance(prompt[0], str) else list
        if not all(isinstance(p, kind) for p in prompt):
            if kind is str and lax_token_ids(prompt) is not None:
                # Token ids, as vLLM 0.32's lax list[int] reads ["11", 10]: [11, 10] (a list of
                # strings only is a batch of text prompts, as there).
                return []
            raise InvalidRequest(
                "'prompt' must be a string, a list of strings, a list of token ids or a list "
                "of token-id lists, not a mix",
                "prompt",
            )
        return prompt
    return []


def _fan_out(
    body: dict[str, Any],
    chat: bool,
    served_model: str,
    max_model_len: int,
    n: int,
    prompts: list[Any],
    stream: bool,
    include_usage: bool,
) -> ClientRequest:
    """One request per choice, each checked as if sent alone (an error names the prompt)."""
    temperature = lax_float(body.get("temperature"))  # "0" is 0.0 to vLLM
    if n > 1 and temperature is not None and temperature < 1e-5:
        # vLLM's own refusal (sampling_params.py): n greedy choices would be one choice n times.
        raise InvalidRequest(f"n must be 1 when using greedy sampling, got {n}.", "n")
    count = n * max(1, len(prompts))
    if count > MAX_CHOICES:
        raise InvalidRequest(
            f"at most {MAX_CHOICES} choices per request (n times the prompts); this one asks"
            f" for {count}",
            "n" if len(prompts) < 2 else "prompt",
        )
    single = {k: v for k, v in body.items() if k != "n"}
    choices: list[ClientRequest] = []
    for i, prompt in enumerate(prompts or [None]):
        if prompt is not None:
            if not isinstance(prompt, str | list):
                raise InvalidRequest(
                    f"'prompt[{i}]' must be a string or a list of token ids", f"prompt[{i}]"
                )
            single = {**single, "prompt": prompt}
        try:
            one = parse_client_request(orjson.dumps(single), chat, served_model, max_model_len)
        except InvalidRequest as exc:
            if prompt is None:
                raise
            raise InvalidRequest(f"prompt {i}: {exc.message}", f"prompt[{i}]") from None
        # The seed as vLLM reads it ("5", 5.0 and true are integers to it).
        seed, request_id = lax_int(single.get("seed")), single.get("request_id")
        for j in range(n):
            changes: dict[str, Any] = {}
            if j and seed is not None:
                # vLLM seeds choice j of a seeded request with seed + j (parallel_sampling.py):
                # the same seed on every choice would make them all one sample.
                # Past int64 (vLLM's range) it wraps: still distinct and still reproducible.
                child = seed + j
                changes["seed"] = child - 2**64 if seed < 2**63 <= child else child
            if isinstance(request_id, str) and request_id:
                # vLLM keys a request, and its KV handoff, by a client's request_id.
                changes["request_id"] = f"{request_id}-{len(choices)}"
            choices.append(replace(one, body={**one.body, **changes}) if changes else one)
    first = choices[0]
    return ClientRequest(
        chat=chat,
        body=body,
        model=first.model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=first.max_tokens,
        prompt_tokens_exact=None,
        prompt_bytes=first.prompt_bytes,
        choices=tuple(choices),
        choices_per_prompt=n,
    )


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object, or the 400 that says why not. A UTF-8
    byte order mark before it is read past, as vLLM's JSON reader (Python's) reads past it."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def parse_client_request(
    raw: bytes, chat: bool, served_model: str, max_model_len: int
) -> ClientRequest:
    body = parse_json_object(raw)
    try:
        # The legs re-serialise the body, and orjson writes at most 254 levels of nesting
        # while it reads 1024: refuse here what could not be forwarded (else a 500 later).
        orjson.dumps(body)
    except TypeError:
        raise InvalidRequest("request body is nested too deeply") from None
    model = body.get("model")
    if model is None or model == "":
        # vLLM serves a request without a model (or with an empty one) by its one model; the
        # legs name it, so every engine reads the same request.
        model = body["model"] = served_model
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", "model")
    if model != served_model:
        raise NotFound(
            f"The model '{model}' does not exist; this router serves '{served_model}'",
            "model",
            code="model_not_found",
        )
    n = _check_int(body, "n") or 1
    for name, why in _UNSUPPORTED.items():
        if name in body and (name.endswith("_transfer_params") or not _is_off(name, body[name])):
            raise InvalidRequest(why, name)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        # vLLM reads its extra args as the request's transfer parameters where the router set
        # none (a local leg, the encoder cache): a client's would point an engine elsewhere.
        for name in ("kv_transfer_params", "ec_transfer_params"):
            if name in xargs:
                raise InvalidRequest(_UNSUPPORTED[name], f"vllm_xargs.{name}")
    raw_stream = body.get("stream", False)
    stream = False if raw_stream is None else lax_bool(raw_stream)
    if stream is None:
        raise InvalidRequest("'stream' must be a boolean", "stream")
    if raw_stream is not None and stream is not raw_stream:
        body["stream"] = stream
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest("'stream_options' must be an object", "stream_options")
        # vLLM refuses only options that say something ({} is no more than none).
        if options and not stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        for name in ("include_usage", "continuous_usage_stats"):
            # Read as vLLM's bool fields read them ("false" and 0 are false); the decode leg
            # carries the router's own options, so what the engine would refuse is refused here.
            given = options.get(name)
            flag = False if given is None else lax_bool(given)
            if flag is None:
                raise InvalidRequest(
                    f"'stream_options.{name}' must be a boolean", f"stream_options.{name}"
                )
            if name == "include_usage":
                include_usage = flag
    completion_cap = _check_int(body, "max_completion_tokens") if chat else None
    max_tokens, cap_name = output_cap(
        _check_int(body, "max_tokens", ranged=completion_cap is None), completion_cap
    )
    # The context as vLLM 0.32 applies it, in its words (engines.context): the engines cut
    # max_tokens to what the prompt leaves, and the router plans with the cut value.
    if (refusal := max_tokens_refusal(max_tokens, cap_name, max_model_len)) is not None:
        raise InvalidRequest(refusal.message, refusal.param)
    min_tokens = _check_int(body, "min_tokens")
    prompts = _batch(body, chat)
    if n > 1 or len(prompts) > 1:
        return _fan_out(body, chat, served_model, max_model_len, n, prompts, stream, include_usage)
    exact, size = _prompt_length(body, chat)
    if exact is not None:
        if (refusal := prompt_refusal(exact, max_model_len, counted=True)) is not None:
            raise InvalidRequest(refusal.message, refusal.param)
        wanted = max_tokens
        if wanted is None:
            wanted = max_model_len if chat else DEFAULT_COMPLETIONS_MAX_TOKENS
        cut, refusal = cut_max_tokens(wanted, exact, max_model_len)
        if refusal is None and min_tokens:
            refusal = min_tokens_refusal(min_tokens, cut)
        if refusal is not None:
            raise InvalidRequest(refusal.message, refusal.param)
        if max_tokens is not None:
            max_tokens = cut
    else:
        # A text prompt is counted only by the engines; one that cannot fit at 16 bytes a token
        # is refused here, as vLLM refuses it once tokenized (one token past the context).
        if size / MAX_BYTES_PER_TOKEN > max_model_len:
            refusal = text_prompt_refusal(max_model_len)
            raise InvalidRequest(refusal.message, refusal.param)
        # The cut can only lower max_tokens: a min_tokens past the client's own is refused by
        # every engine, here before any leg.
        refusal = min_tokens_refusal(min_tokens or 0, max_tokens) if max_tokens else None
        if refusal is not None:
            raise InvalidRequest(refusal.message, refusal.param)
    return ClientRequest(
        chat=chat,
        body=body,
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        prompt_tokens_exact=exact,
        prompt_bytes=size,
    )

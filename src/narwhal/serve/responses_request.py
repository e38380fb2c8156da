"""A stateless ``POST /v1/responses`` request translated into the chat-completions request the
P/D chat path serves (``serve.responses`` runs it and translates the answer back).

Why a translation and not a pass-through: the P/D machinery (admission, scheduling, KV handoff,
first-token deadline, journal, metrics) serves chat, and vLLM renders a Responses ``input``
through the same chat template as the equivalent ``messages`` (its ``construct_input_messages``
in ``entrypoints/openai/responses/utils.py``), so the engines see the same prompt tokens. What a
chat request cannot express, or what needs state the router does not keep, is refused with 400
naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal.engines.lax import lax_bool, lax_int
from narwhal.serve.errors import InvalidRequest, NotFound
from narwhal.serve.validation import parse_json_object

__all__ = ["ResponsesRequest", "parse_responses_request", "to_chat_body"]

# Fields that need state the router does not keep, or run work it does not run; any value but
# "off" (None, False, empty) is refused.
_STATEFUL: dict[str, str] = {
    "conversation": "conversation is not supported: the router keeps no conversation state; "
    "send the whole conversation in 'input'",
    "background": "background mode is not supported: it needs a stored response to poll, and "
    "the router keeps none",
    "prompt": "prompt templates are not supported: they are stored server-side, and the router "
    "keeps none (vLLM refuses them too)",
    "previous_input_messages": "previous_input_messages is not supported: it is vLLM's harmony "
    "history, which the chat form cannot express",
    "kv_transfer_params": "kv_transfer_params is set by the router, not by clients",
}

# Fields whose meaning is the same in a chat-completions request: passed to the engine as sent,
# so its own validation (and its 400 naming the field) applies.
_SAME_IN_CHAT = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "include_reasoning",
    "cache_salt",
    "chat_template_kwargs",
    "structured_outputs",
    "vllm_xargs",
    "priority",
    "user",
)

# include entries: served, ignored (and why), or refused (and why).
_INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Reasoning comes back as plain reasoning_text, which a stateless client sends back as it is;
# vLLM accepts the entry and returns no encrypted content either.
_INCLUDE_IGNORED = frozenset({"reasoning.encrypted_content"})
_BUILTIN_WHY = "runs on OpenAI's platform; the router serves function tools only"

# Tool types that run on the provider's side (or need a runtime the router does not have).
_BUILTIN_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "mcp",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
    }
)

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request as the router serves it: the chat body it runs as, and what the
    ``response`` object echoes back (``echo``)."""

    chat_body: dict[str, Any]
    stream: bool
    logprobs: bool
    echo: dict[str, Any]


def _refuse(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, param)


def _named(value: Any, names: frozenset[str]) -> bool:
    """``value in names`` for any JSON value (a list or an object is unhashable)."""
    return isinstance(value, str) and value in names


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _text_part(part: Any, where: str) -> dict[str, Any]:
    """One content part of a message in its chat form (vLLM renders both alike)."""
    if not isinstance(part, dict):
        raise _refuse(f"'{where}' must be an object", where)
    kind = part.get("type")
    if _named(kind, _TEXT_PARTS):
        text = part.get("text")
        if not isinstance(text, str):
            raise _refuse(f"'{where}.text' must be a string", f"{where}.text")
        return {"type": "text", "text": text}
    if kind == "refusal":
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise _refuse(f"'{where}.refusal' must be a string", f"{where}.refusal")
        return {"type": "text", "text": refusal}
    if kind == "input_image":
        url = part.get("image_url")
        if isinstance(url, str) and url:
            image: dict[str, Any] = {"url": url}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            return {"type": "image_url", "image_url": image}
        raise _refuse(
            f"'{where}': an input_image by file_id is not supported: files are stored "
            "server-side and the router keeps none; send the image as an image_url (a URL or a "
            "data: URL)",
            where,
        )
    if kind == "input_file":
        raise _refuse(
            f"'{where}': input_file is not supported: the chat form has no file part; send the "
            "file's text as input_text",
            where,
        )
    raise _refuse(f"'{where}': content part type {kind!r} is not supported", f"{where}.type")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [_text_part(part, f"{where}[{i}]") for i, part in enumerate(content)]
    raise _refuse(f"'{where}' must be a string or a list of content parts", where)


def _plain_text(content: str | list[dict[str, Any]]) -> str | None:
    """The text of an assistant message as vLLM takes it (its first part's text)."""
    if isinstance(content, str):
        return content
    return str(content[0].get("text", "")) if content else None


def _previous_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    last = messages[-1] if messages else None
    return last if last is not None and last.get("role") == "assistant" else None


def _input_item(item: Any, where: str, messages: list[dict[str, Any]]) -> None:
    """Append ``item`` to ``messages`` in its chat form, merging into the previous assistant
    message as vLLM does (a reasoning item, then its text and tool calls, are one turn)."""
    if not isinstance(item, dict):
        raise _refuse(f"'{where}' must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    previous = _previous_assistant(messages)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _refuse(
                f"'{where}.role' must be one of user, system, developer, assistant",
                f"{where}.role",
            )
        content = _content(item.get("content"), f"{where}.content")
        if role != "assistant":
            messages.append({"role": role, "content": content})
            return
        text = _plain_text(content)
        if previous is not None and previous.get("content") is None:
            previous["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
        return
    if kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
            if not isinstance(value, str):
                raise _refuse(f"'{where}.{field}' must be a string", f"{where}.{field}")
        if item.get("namespace"):
            raise _refuse(
                f"'{where}.namespace': namespaced tools are not supported", f"{where}.namespace"
            )
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise _refuse(f"'{where}.call_id' must be a string", f"{where}.call_id")
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": _content(output, f"{where}.output"),
            }
        )
        return
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise _refuse(
                f"'{where}.encrypted_content': encrypted reasoning is not supported (vLLM "
                "cannot decrypt it); send the reasoning item's content as reasoning_text",
                f"{where}.encrypted_content",
            )
        reasoning = ""
        for source in (item.get("content"), item.get("summary")):
            if isinstance(source, list) and source and isinstance(source[0], dict):
                reasoning = str(source[0].get("text", ""))
                break
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        return
    raise _refuse(
        f"'{where}': input items of type {kind!r} are not supported: the router serves "
        "messages, function_call, function_call_output and reasoning items (the chat form "
        "cannot express the others, or they need server-side state)",
        where,
    )


def _continues_final(items: list[Any]) -> bool:
    """vLLM's ``should_continue_final_message``: an unfinished last assistant message (or
    reasoning item) is continued rather than answered."""
    last = items[-1] if items else None
    if not isinstance(last, dict) or last.get("type", "message") not in ("message", "reasoning"):
        return False
    return last.get("status") in ("in_progress", "incomplete")


def _messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _refuse("'instructions' must be a string", "instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages, False
    if not isinstance(given, list) or not given:
        raise _refuse("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(given):
        _input_item(item, f"input[{i}]", messages)
    return messages, _continues_final(given)


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _refuse("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _refuse(f"'{where}' must be an object", where)
        kind = tool.get("type")
        if _named(kind, _BUILTIN_TOOLS):
            raise _refuse(f"'{where}': the built-in tool {kind!r} {_BUILTIN_WHY}", where)
        if kind != "function":
            raise _refuse(
                f"'{where}': tools of type {kind!r} are not supported: the router serves "
                "function tools only",
                where,
            )
        if not isinstance(tool.get("name"), str):
            raise _refuse(f"'{where}.name' must be a string", f"{where}.name")
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            if not isinstance(choice.get("name"), str):
                raise _refuse("'tool_choice.name' must be a string", "tool_choice.name")
            return {"type": "function", "function": {"name": choice["name"]}}
        if _named(kind, _BUILTIN_TOOLS) or (
            isinstance(kind, str) and kind.startswith("web_search")
        ):
            raise _refuse(
                f"'tool_choice': the built-in tool {kind!r} {_BUILTIN_WHY}", "tool_choice"
            )
    raise _refuse(
        "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\"}"
        " (allowed_tools, custom and built-in tool choices are not supported)",
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _refuse("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _refuse("'text.format' must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise _refuse("'text.format.name' must be a string", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise _refuse("'text.format.schema' must be an object", "text.format.schema")
        spec = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _refuse("'text.format.type' must be text, json_object or json_schema", "text.format.type")


def _include(body: dict[str, Any]) -> bool:
    """Whether output logprobs are asked for; refuses entries the router cannot serve."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list):
        raise _refuse("'include' must be a list", "include")
    logprobs = False
    for i, entry in enumerate(include):
        if entry == _INCLUDE_LOGPROBS:
            logprobs = True
        elif not _named(entry, _INCLUDE_IGNORED):
            raise _refuse(
                f"'include[{i}]': {entry!r} is not supported: it belongs to built-in tools or "
                "to stored input items, and the router runs no built-in tool and keeps no state",
                f"include[{i}]",
            )
    return logprobs


def _echo(body: dict[str, Any], max_tokens: int | None, logprobs: bool) -> dict[str, Any]:
    """The request fields a ``response`` object repeats, as vLLM's ``from_request`` does: the
    output cap and top logprobs as applied (``4``, not the ``"4"`` sent; top logprobs only when
    logprobs are included)."""
    parallel = body.get("parallel_tool_calls")
    return {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": body.get("temperature"),
        # vLLM's check_tool_usage: without tools, auto (the default) and none read as none.
        "tool_choice": (body.get("tool_choice") or "auto") if body.get("tools") else "none",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "background": False,
        "max_output_tokens": max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "store": False,
        "text": body.get("text") or {"format": {"type": "text"}},
        "top_logprobs": lax_int(body.get("top_logprobs")) if logprobs else None,
        "truncation": "disabled",
        "user": body.get("user"),
    }


def to_chat_body(body: dict[str, Any]) -> ResponsesRequest:
    """The chat-completions request that serves ``body`` (raises :class:`InvalidRequest` naming
    the field for what it cannot serve). ``store`` is answered false whatever was asked, as
    vLLM answers without its store (its default): the router stores nothing, and a client that
    sends OpenAI's default (true) gets a stateless answer rather than an error."""
    previous = body.get("previous_response_id")
    if not _is_off(previous):
        # vLLM's answer to an id its store does not hold (404), and why none is held here.
        raise NotFound(
            f"Response with id '{previous}' not found: the router stores no responses; send "
            "the whole conversation in 'input'",
            "previous_response_id",
        )
    for name, why in _STATEFUL.items():
        if name in body and (name == "kv_transfer_params" or not _is_off(body[name])):
            raise _refuse(why, name)
    if body.get("truncation") not in (None, "disabled"):
        raise _refuse(
            "truncation 'auto' is not supported: the router does not cut conversations; send "
            "'disabled' and keep the input within the model's context",
            "truncation",
        )
    raw_stream = body.get("stream")
    stream = False if raw_stream is None else lax_bool(raw_stream)  # "true", 1: as vLLM
    if stream is None:
        raise _refuse("'stream' must be a boolean", "stream")
    messages, continue_final = _messages(body)
    # vLLM's Responses path tokenizes the rendered conversation with special tokens added
    # (its TokenizeParams default; the chat path's default is off): the engines get the
    # prompt tokens vLLM's own /v1/responses would give them (a BOS more, for a template
    # that writes its own).
    chat: dict[str, Any] = {"messages": messages, "add_special_tokens": True}
    if "model" in body:
        chat["model"] = body["model"]  # checked by the chat path, as for /v1/chat/completions
    cap = body.get("max_output_tokens")
    if cap is not None:
        tokens = lax_int(cap)  # 4.0 or "4", as vLLM reads it
        if tokens is None or tokens < 1:
            raise _refuse("'max_output_tokens' must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = tokens
    for name in _SAME_IN_CHAT:
        if body.get(name) is not None:
            chat[name] = body[name]
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if tools is not None and choice is not None:
        chat["tool_choice"] = choice
    elif tools is None and choice not in (None, "auto", "none"):
        # vLLM's ResponsesRequest.check_tool_usage: without tools, auto and none mean none.
        raise _refuse(
            "a tool_choice of 'required' or a named function needs 'tools'", "tool_choice"
        )
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _refuse("'reasoning' must be an object", "reasoning")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    logprobs = _include(body)
    if logprobs:
        chat["logprobs"] = True
        if body.get("top_logprobs"):
            chat["top_logprobs"] = body["top_logprobs"]
    if continue_final:
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    if stream:
        chat["stream"] = True
        # The usage of a Responses stream is in its response.completed event: always ask.
        chat["stream_options"] = {"include_usage": True}
    return ResponsesRequest(
        chat_body=chat,
        stream=bool(stream),
        logprobs=logprobs,
        echo=_echo(body, chat.get("max_tokens"), logprobs),
    )


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    """The request body as received, parsed and translated (errors as the chat path words
    them)."""
    return to_chat_body(parse_json_object(raw))

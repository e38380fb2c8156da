"""The OpenAI request fields beyond a plain greedy completion, as vLLM 0.32 answers them: the
sampling knobs (validated as vLLM validates them, though a deterministic simulation ignores
their values), ``n`` choices, logprobs, and the outputs guided decoding forces (a named or
required tool call, a ``json_object`` / ``json_schema`` response format).

What the simulator stands in for is ``vllm serve`` with ``--enable-auto-tool-choice`` and a
``--tool-call-parser`` whose parser handles named and required tool choice with vLLM's JSON
grammar (as hermes does): without a parser vLLM 0.32 refuses every tool_choice but ``none``
(``"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set``,
``tool_choice="required" requires --tool-call-parser to be set``), which would leave nothing
for a router to pass through. With ``auto`` the simulated model never decides to call a tool,
so ``auto`` answers plain text, as ``none`` does.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from narwhal.engines.lax import lax_bool
from narwhal.simengine.generation import GenerationModel
from narwhal.simengine.vocab import NUM_BYTE_TOKENS, Vocabulary

__all__ = [
    "MAX_LOGPROBS",
    "ChoiceState",
    "GuidedOutput",
    "Invalid",
    "StepOutput",
    "SurfaceOptions",
    "minimal_instance",
    "parse_surface",
]

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
_INT64 = 2**63
_SAMPLING_EPS = 1e-5  # below it vLLM samples greedily
_MAX_SCHEMA_DEPTH = 32


class Invalid(Exception):
    """A request vLLM answers with 400 (the caller turns it into its protocol error)."""

    def __init__(self, message: str, param: str | None = None, type_: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type_


def _vllm_error(message: str, parameter: str | None = None, value: Any = None) -> Invalid:
    """A ``VLLMValidationError`` as vLLM's error response shows it: ``str(exc)`` appends the
    parameter and value it names."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    text = f"{message} ({', '.join(extras)})" if extras else message
    return Invalid(text, parameter)


def _pydantic_error(name: str, kind: str, msg: str, value: Any) -> Invalid:
    """A type error as vLLM's RequestValidationError handler words it (type "Bad Request",
    param the field's dotted location)."""
    shown: Any = value
    if isinstance(value, list | tuple | dict):
        shown = f"<{type(value).__name__} of {len(value)} items>"
    elif not isinstance(value, str):
        shown = str(value)
    error = {"type": kind, "loc": f"body.{name}", "msg": msg, "input": shown}
    return Invalid(f"1 validation error:\n  {error}", f"body.{name}", "Bad Request")


@dataclass(frozen=True)
class GuidedOutput:
    """What guided decoding makes the model write. ``tool_mode``: ``named`` (the text is the
    named tool's arguments), ``required`` (a JSON array of ``{"name", "parameters"}``, one call
    here) or None (a response_format document). For ``required`` the offsets of the call's
    name end and parameters value in ``text`` drive the streamed tool-call deltas."""

    text: str
    tool_mode: str | None = None
    tool_name: str | None = None
    name_end: int = 0
    args_start: int = 0
    args_end: int = 0


@dataclass(frozen=True)
class SurfaceOptions:
    n: int = 1
    # Chat: top_logprobs when logprobs is true; completions: logprobs. None: no logprobs.
    logprobs: int | None = None
    guided: GuidedOutput | None = None
    forced: tuple[int, ...] | None = None  # the guided text's tokens
    # What vLLM's SamplingParams.verify refuses as the request reaches the engine, after every
    # check of the HTTP layer: a whole request gets it as a 400, a streamed one as the only
    # event of a 200 stream (vLLM 0.32, checked against the engines: docs/vllm-interop.md).
    refusal: Invalid | None = None
    stop: tuple[str, ...] = ()  # stop strings, applied as vLLM applies them (StopStrings)
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False


# --- field types --------------------------------------------------------------------------


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _pydantic_error(name, "float_type", "Input should be a valid number", value)
    if isinstance(value, str):
        # pydantic's lax mode parses numeric strings, as vLLM's request models do.
        try:
            return float(value)
        except ValueError:
            raise _pydantic_error(
                name,
                "float_parsing",
                "Input should be a valid number, unable to parse string as a number",
                value,
            ) from None
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _pydantic_error(name, "int_type", "Input should be a valid integer", value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise _pydantic_error(
                name,
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
                value,
            ) from None
    if isinstance(value, float):
        if not value.is_integer():
            raise _pydantic_error(
                name,
                "int_from_float",
                "Input should be a valid integer, got a number with a fractional part",
                value,
            )
        return int(value)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _pydantic_error(name, "bool_type", "Input should be a valid boolean", value)


# --- sampling parameters --------------------------------------------------------------------


def _check_sampling(body: dict[str, Any], n: int) -> None:
    """vLLM's ``SamplingParams._verify_args``, with its defaults (temperature 1, top_p 1, ...)
    for what the request leaves out; a simulation ignores the values themselves."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise _vllm_error(f"{name} must be in [-2, 2], got {value}.")
    repetition = _number(body, "repetition_penalty")
    if repetition is not None:
        if not math.isfinite(repetition):
            raise _vllm_error(f"repetition_penalty must be a finite number, got {repetition}.")
        if repetition <= 0.0:
            raise _vllm_error(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = _number(body, "temperature")
    if temperature is not None:
        if not math.isfinite(temperature):
            raise _vllm_error(
                f"temperature must be a finite number, got {temperature}.",
                "temperature",
                temperature,
            )
        if temperature < 0.0:
            raise _vllm_error(
                f"temperature must be non-negative, got {temperature}.", "temperature", temperature
            )
        if temperature > 2.0:
            raise _vllm_error(
                f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature
            )
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k < -1:
        raise _vllm_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = _number(body, "min_p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise _vllm_error(f"min_p must be in [0, 1], got {min_p}.")
    seed = _integer(body, "seed")
    if seed is not None and not -_INT64 <= seed < _INT64:
        bound = ("greater_than_equal", f"greater than or equal to {-_INT64}")
        if seed >= _INT64:
            bound = ("less_than_equal", f"less than or equal to {_INT64 - 1}")
        raise _pydantic_error("seed", bound[0], f"Input should be {bound[1]}", seed)
    # Zero temperature is greedy sampling: one answer only.
    if temperature is not None and temperature < _SAMPLING_EPS and n > 1:
        raise _vllm_error(f"n must be 1 when using greedy sampling, got {n}.")


def _check_stops(body: dict[str, Any]) -> tuple[tuple[str, ...], frozenset[int]]:
    """The stop strings and stop token ids, validated as vLLM validates them."""
    stop = body.get("stop")
    if isinstance(stop, list):
        for i, item in enumerate(stop):
            if not isinstance(item, str):
                raise _pydantic_error(
                    f"stop.{i}", "string_type", "Input should be a valid string", item
                )
        if len(stop) > MAX_STOP_STRINGS:
            raise _pydantic_error(
                "stop",
                "too_long",
                f"List should have at most {MAX_STOP_STRINGS} items after validation,"
                f" not {len(stop)}",
                stop,
            )
        stops = stop
    elif stop is None or isinstance(stop, str):
        stops = [stop] if stop is not None else []
    else:
        raise _pydantic_error("stop", "string_type", "Input should be a valid string", stop)
    if any(not s for s in stops):
        raise _vllm_error("stop cannot contain an empty string.")
    ids = body.get("stop_token_ids")
    if ids is None:
        return tuple(stops), frozenset()
    if not isinstance(ids, list):
        raise _pydantic_error("stop_token_ids", "list_type", "Input should be a valid list", ids)
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise _pydantic_error(
                f"stop_token_ids.{i}", "int_type", "Input should be a valid integer", token
            )
    return tuple(stops), frozenset(ids)


def _token_key(key: Any) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def _check_logit_bias(body: dict[str, Any]) -> None:
    """vLLM turns ``logit_bias`` keys into token ids before anything else (a 400 either way)."""
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        bad = [key for key in bias if _token_key(key) is None]
        if bad:
            raise _vllm_error(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad}",
                "logit_bias",
                bad,
            )


def _out_of_vocab(field: str, ids: list[int], vocab: Vocabulary) -> Invalid | None:
    bad = [t for t in ids if not 0 <= t < vocab.size]
    if not bad:
        return None
    return _vllm_error(
        f"token_id(s) {bad} in {field} contain out-of-vocab token ids."
        f" Vocabulary size: {vocab.size}",
        field,
        bad,
    )


def _engine_refusal(
    body: dict[str, Any], logprobs: int | None, vocab: Vocabulary
) -> Invalid | None:
    """vLLM 0.32's ``SamplingParams.verify``, in its order (the checks the simulator models):
    the logprobs against ``--max-logprobs``, then ``logit_bias`` and ``stop_token_ids`` against
    the vocabulary."""
    if logprobs is not None:
        requested = vocab.size if logprobs == -1 else logprobs
        if requested > MAX_LOGPROBS:
            return _vllm_error(
                f"Requested sample logprobs of {requested}, which is greater than max allowed:"
                f" {MAX_LOGPROBS}",
                "logprobs",
                requested,
            )
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        keys = [key for key in map(_token_key, bias) if key is not None]
        if (refusal := _out_of_vocab("logit_bias", keys, vocab)) is not None:
            return refusal
    ids = body.get("stop_token_ids")
    if isinstance(ids, list):
        return _out_of_vocab("stop_token_ids", ids, vocab)
    return None


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if chat:
        wanted = _boolean(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int | float)):
            raise _vllm_error("`top_logprobs` must be an integer.", "top_logprobs", top)
        count = 0 if top is None else _integer(body, "top_logprobs")
        assert count is not None
        if count < 0 and count != -1:
            raise _vllm_error(
                "`top_logprobs` must be a positive value or -1.", "top_logprobs", count
            )
        if (count == -1 or count > 0) and not wanted:
            raise _vllm_error(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
        if not wanted:
            return None
        return count
    value = body.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _vllm_error("`logprobs` must be an integer.", "logprobs", value)
    count = _integer(body, "logprobs")
    assert count is not None
    if count < 0 and count != -1:
        raise _vllm_error("`logprobs` must be a positive value or -1.", "logprobs", count)
    return count


# --- tools and response formats -------------------------------------------------------------


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _pydantic_error("tools", "list_type", "Input should be a valid list", tools)
    if not tools:
        raise _vllm_error(
            "`tools` must not be an empty array. Either provide at least one tool or omit the"
            " field entirely.",
            "tools",
        )
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _pydantic_error(where, "model_type", "Input should be an object", tool)
        if tool.get("type", "function") != "function":
            raise _pydantic_error(
                f"{where}.type", "literal_error", "Input should be 'function'", tool["type"]
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _pydantic_error(
                f"{where}.function",
                "missing" if function is None else "model_type",
                "Field required" if function is None else "Input should be an object",
                tool if function is None else function,
            )
        if not isinstance(function.get("name"), str):
            missing = "name" not in function
            raise _pydantic_error(
                f"{where}.function.name",
                "missing" if missing else "string_type",
                "Field required" if missing else "Input should be a valid string",
                function if missing else function["name"],
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _pydantic_error(
                f"{where}.function.description",
                "string_type",
                "Input should be a valid string",
                description,
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise _pydantic_error(
                f"{where}.function.parameters",
                "dict_type",
                "Input should be a valid dictionary",
                parameters,
            )
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
    """vLLM's ``ChatCompletionRequest.check_tool_usage``: the effective tool_choice."""
    if "tool_choice" not in body:
        return "auto" if tools else "none"
    choice = body["tool_choice"]
    if choice is None or choice == "none":
        return choice
    if tools is None:
        raise _vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise _vllm_error(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto"'
            ' or "required" are supported.',
            "tool_choice",
        )
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise _vllm_error(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise _vllm_error(
                f"Expected field `name` in `function` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise _vllm_error(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        if not any(tool["function"]["name"] == name for tool in tools):
            raise _vllm_error(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        if choice.get("type", "function") != "function":
            raise _pydantic_error(
                "tool_choice.type", "literal_error", "Input should be 'function'", choice["type"]
            )
    return choice


def _response_format(body: dict[str, Any]) -> tuple[str, dict[str, Any] | None] | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _pydantic_error("response_format", "model_type", "Input should be an object", fmt)
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise _vllm_error(
                "When response_format type is 'json_schema', the 'json_schema' field must be"
                " provided.",
                "response_format",
            )
        if not isinstance(spec, dict):
            raise _pydantic_error(
                "response_format.json_schema", "model_type", "Input should be an object", spec
            )
        if not isinstance(spec.get("name"), str):
            raise _pydantic_error(
                "response_format.json_schema.name", "missing", "Field required", spec
            )
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise _pydantic_error(
                "response_format.json_schema.schema",
                "dict_type",
                "Input should be a valid dictionary",
                schema,
            )
        return kind, schema
    if kind in ("text", "json_object"):
        return kind, None
    if kind in ("structural_tag", "structural-tag"):
        raise Invalid(
            "response_format type 'structural_tag' is not supported by the simulator",
            "response_format",
        )
    raise _pydantic_error(
        "response_format.type",
        "literal_error",
        "Input should be 'text', 'json_object' or 'json_schema'",
        kind,
    )


def minimal_instance(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """The smallest JSON value valid for ``schema`` that a grammar-forced greedy model would
    write: required properties only, each the least value of its type (``""``, ``0``,
    ``false``, ``null``, ``minItems`` items), ``const`` or the first ``enum`` value, the first
    branch of ``anyOf`` / ``oneOf``, local ``$ref`` followed. No schema (or ``{}``): ``{}``,
    as a function without ``parameters`` takes an empty object."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return {}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return minimal_instance(target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return minimal_instance(schema[key][0], root, depth + 1)
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                for k, v in part.items():
                    if k == "required" and isinstance(v, list):
                        merged["required"] = [*merged.get("required", []), *v]
                    elif k == "properties" and isinstance(v, dict):
                        merged["properties"] = {**merged.get("properties", {}), **v}
                    else:
                        merged.setdefault(k, v)
        return minimal_instance(merged, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else None
    if kind == "string":
        return "a" * int(schema.get("minLength", 0) or 0)
    if kind in ("integer", "number"):
        low = schema.get("minimum")
        if isinstance(schema.get("exclusiveMinimum"), int | float):
            low = schema["exclusiveMinimum"] + 1
        value = low if isinstance(low, int | float) and low > 0 else 0
        if isinstance(schema.get("maximum"), int | float) and value > schema["maximum"]:
            value = schema["maximum"]
        return math.ceil(value) if kind == "integer" else value
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    if kind == "array":
        count = int(schema.get("minItems", 0) or 0)
        prefix = schema.get("prefixItems")
        items = [
            minimal_instance(prefix[i], root, depth + 1)
            if isinstance(prefix, list) and i < len(prefix)
            else minimal_instance(schema.get("items"), root, depth + 1)
            for i in range(count)
        ]
        return items
    if kind == "object":
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        out: dict[str, Any] = {}
        for name in required if isinstance(required, list) else []:
            if isinstance(name, str):
                out[name] = minimal_instance(properties.get(name), root, depth + 1)
        return out
    return None if kind is None and schema else {}


def _dumps(value: Any) -> str:
    # json.dumps as vLLM re-serializes a required tool call's parameters.
    return json.dumps(value, ensure_ascii=False)


def _guided(
    body: dict[str, Any], chat: bool, tools: list[dict[str, Any]] | None, tool_choice: Any
) -> GuidedOutput | None:
    fmt = _response_format(body)
    if chat and tools is not None and isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        # A forced tool call wins over response_format, as vLLM ignores the latter then.
        return GuidedOutput(
            _dumps(minimal_instance(tool["function"].get("parameters"))), "named", name
        )
    if chat and tools is not None and tool_choice == "required":
        # One call, to the first tool: a greedy model's pick of the array vLLM's grammar allows.
        function = tools[0]["function"]
        name_json = _dumps(function["name"])
        args = _dumps(minimal_instance(function.get("parameters")))
        head = '[{"name": ' + name_json
        args_start = len(head) + len(', "parameters": ')
        text = f'{head}, "parameters": {args}}}]'
        return GuidedOutput(
            text, "required", function["name"], len(head), args_start, args_start + len(args)
        )
    if fmt is None or fmt[0] == "text":
        return None
    if fmt[0] == "json_object":
        return GuidedOutput("{}")
    return GuidedOutput(_dumps(minimal_instance(fmt[1])))


def parse_surface(
    body: dict[str, Any], chat: bool, vocab: Vocabulary, kv_transfer_params: Any
) -> SurfaceOptions:
    """Validate the request's OpenAI fields as vLLM 0.32 does (raises :class:`Invalid`)."""
    if body.get("use_beam_search") is not None and lax_bool(body["use_beam_search"]) is not False:
        raise Invalid("use_beam_search is not supported by the simulator", "use_beam_search")
    if body.get("prompt_logprobs") is not None:
        raise Invalid("prompt_logprobs is not supported by the simulator", "prompt_logprobs")
    n = _integer(body, "n")
    n = 1 if n is None else n
    if n < 1:
        raise _vllm_error(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise _vllm_error(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the"
            " VLLM_MAX_N_SEQUENCES environment variable."
        )
    if (
        n > 1
        and isinstance(kv_transfer_params, dict)
        and (
            kv_transfer_params.get("do_remote_decode")
            or kv_transfer_params.get("do_remote_prefill")
        )
    ):
        # vLLM 0.32 does not refuse this: it fans the request out into n child requests that
        # each carry the same kv_transfer_params, so a prefill leg holds n copies of the
        # prompt's KV but hands out one kv_transfer_params (the others leak until their lease
        # expires) and a decode leg's n children race to pull one hold that the first pull
        # frees. The simulator refuses it instead of modelling that breakage: a P/D router
        # sends its legs with n = 1.
        raise Invalid(
            "n > 1 with kv_transfer_params (a disaggregated prefill or decode leg) is not"
            " supported by the simulator",
            "n",
        )
    _check_sampling(body, n)
    _check_logit_bias(body)
    stop, stop_token_ids = _check_stops(body)
    raw_include = body.get("include_stop_str_in_output")
    include_stop = False if raw_include is None else lax_bool(raw_include)
    if include_stop is None:
        raise _pydantic_error(
            "include_stop_str_in_output", "bool_parsing", "Input should be a valid boolean",
            raw_include,
        )  # fmt: skip
    logprobs = _logprobs(body, chat)
    tools = tool_choice = None
    if chat:
        tools = _tools(body)
        tool_choice = _tool_choice(body, tools)
        _boolean(body, "parallel_tool_calls")
    guided = _guided(body, chat, tools, tool_choice)
    forced = None if guided is None else tuple(vocab.encode(guided.text))
    refusal = _engine_refusal(body, logprobs, vocab)
    return SurfaceOptions(
        n=n,
        logprobs=logprobs,
        guided=guided,
        forced=forced,
        refusal=refusal,
        # Guided output (a forced tool call, a response format) is written whole, as the
        # grammar makes the model write it: stop strings are not applied to it here.
        stop=stop if guided is None else (),
        stop_token_ids=stop_token_ids if guided is None else frozenset(),
        include_stop_str_in_output=include_stop,
    )


# --- building the answer ---------------------------------------------------------------------


@dataclass
class StepOutput:
    """One generated token as a stream chunk shows it; ``skip``: vLLM sends no chunk for it
    (a required tool call whose first call is not yet streamable); ``stop_reason``: the stop
    string or stop token id that ended the choice."""

    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    skip: bool = False
    stop_reason: str | int | None = None


@dataclass
class StopStrings:
    """A choice's stop strings as vLLM 0.32's detokenizer applies them
    (``v1/engine/detokenizer.py``): checked after each token once the output holds more than
    ``min_tokens`` tokens, in the text that token added (and the stop string's length before
    it); the one that completes earliest wins (ties: the list's order); the text is cut before
    it (after it with ``include_stop_str_in_output``) and the request ends with finish reason
    ``stop`` and the string as its stop reason. A stream holds back the last ``len - 1``
    characters of the longest stop string until the choice ends, so that a client never sees
    the start of one that completes later (none held back with ``include_stop_str_in_output``)."""

    stops: tuple[str, ...]
    include: bool
    min_tokens: int
    text: str = ""
    tokens: int = 0
    released: int = 0  # characters a stream has sent
    matched: str | None = None

    @property
    def holdback(self) -> int:
        return 0 if self.include else max(len(s) for s in self.stops) - 1

    def add(self, token_text: str) -> str | None:
        """The text of the next token; the stop string it completed, or None."""
        before = len(self.text)
        self.text += token_text
        self.tokens += 1
        new = len(self.text) - before
        if self.matched is not None or self.tokens <= self.min_tokens or not new:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, string)
        for stop in self.stops:
            start = self.text.find(stop, 1 - new - len(stop))
            if start != -1 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self.text = self.text[:end] if self.include else self.text[:start]
        self.matched = stop
        return stop

    def release(self, finished: bool) -> str:
        """The text a stream sends now: what is new, less the hold-back until ``finished``."""
        upto = len(self.text) - (0 if finished else self.holdback)
        if upto <= self.released:
            return ""
        out = self.text[self.released : upto]
        self.released = upto
        return out


def _tool_call_id(response_id: str, index: int) -> str:
    # vLLM's ids are random ("chatcmpl-tool-" + 32 hex digits); deterministic here.
    digest = hashlib.blake2b(f"{response_id}:{index}".encode(), digest_size=16).hexdigest()
    return f"chatcmpl-tool-{digest}"


@dataclass
class ChoiceState:
    """One choice's answer as it is generated: its text as the detokenizer releases it, its
    logprobs, and its tool-call deltas. A token's logprobs are drawn from the key of the
    context it was generated at (:attr:`TokenEvent.key`), so they too depend only on the
    prompt and the tokens before it."""

    index: int
    chat: bool
    options: SurfaceOptions
    vocab: Vocabulary
    generation: GenerationModel
    response_id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    pending: bytearray = field(default_factory=bytearray)
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    tool_started: bool = False
    min_tokens: int = 0
    stop: StopStrings | None = None

    def __post_init__(self) -> None:
        if self.options.stop:
            self.stop = StopStrings(
                self.options.stop, self.options.include_stop_str_in_output, self.min_tokens
            )

    def _decode(self, token: int, final: bool) -> str:
        """The text ``token`` releases: byte tokens are held until they complete a UTF-8
        character (a JSON value's non-ASCII characters are byte tokens)."""
        out = ""
        if 0 <= token < NUM_BYTE_TOKENS:
            self.pending.append(token)
            try:
                out = self.pending.decode("utf-8")
                self.pending.clear()
            except UnicodeDecodeError as exc:
                if exc.reason != "unexpected end of data" or len(self.pending) >= 4:
                    out = self.pending.decode("utf-8", errors="replace")
                    self.pending.clear()
        else:
            if self.pending:
                out = self.pending.decode("utf-8", errors="replace")
                self.pending.clear()
            out += self.vocab.token_text(token)
        if final and self.pending:
            out += self.pending.decode("utf-8", errors="replace")
            self.pending.clear()
        return out

    def stopped_by(self, token: int, final: bool) -> str | None:
        """A non-streamed answer's next token: the stop string it completed, or None (the
        text is read whole at the end: ``stop.text`` once a stop string ended it)."""
        assert self.stop is not None
        return self.stop.add(self._decode(token, final))

    def _entries(self, tokens: list[int], keys: list[bytes]) -> list[list[tuple[int, float]]]:
        k = self.options.logprobs or 0
        return [
            self.generation.logprobs(key, token, k) for token, key in zip(tokens, keys, strict=True)
        ]

    def logprobs_for(
        self, tokens: list[int], keys: list[bytes], text_offset: int
    ) -> dict[str, Any]:
        """The logprobs of ``tokens``, generated at context keys ``keys``, in vLLM's shape;
        ``text_offset``: where the first token's text starts (completions)."""
        k = self.options.logprobs or 0
        entries = self._entries(tokens, keys)
        token_text = self.vocab.token_text
        if self.chat:
            content = []
            for ranked in entries:
                text = token_text(ranked[0][0])
                content.append(
                    {
                        "token": text,
                        "logprob": ranked[0][1],
                        "bytes": list(text.encode("utf-8", errors="replace")),
                        # vLLM lists the first top_logprobs entries of the logprobs dict,
                        # which holds the sampled token first.
                        "top_logprobs": [
                            {
                                "token": (alt := token_text(t)),
                                "logprob": lp,
                                "bytes": list(alt.encode("utf-8", errors="replace")),
                            }
                            for t, lp in ranked[:k]
                        ],
                    }
                )
            return {"content": content}
        offsets: list[int] = []
        texts: list[str] = []
        for ranked in entries:
            text = token_text(ranked[0][0])
            offsets.append(text_offset)
            text_offset += len(text)
            texts.append(text)
        return {
            "text_offset": offsets,
            "token_logprobs": [ranked[0][1] for ranked in entries],
            "tokens": texts,
            # vLLM keeps logprobs + 1 entries of a dict holding max(logprobs, 1).
            "top_logprobs": [{token_text(t): lp for t, lp in ranked} for ranked in entries],
        }

    def step(
        self, token: int, finish_reason: str | None, key: bytes, stop_token: bool = False
    ) -> StepOutput:
        """The stream chunk of the choice's next token, generated at context key ``key``;
        ``stop_token``: it is one of the request's stop token ids (it ends the choice, its
        text left out unless include_stop_str_in_output, as vLLM's detokenizer does)."""
        self.tokens.append(token)
        before = self.text
        delta_text = self._decode(token, finish_reason is not None)
        if stop_token and not self.options.include_stop_str_in_output:
            delta_text = ""
        stop_reason: str | int | None = token if stop_token else None
        if self.stop is not None:
            matched = self.stop.add(delta_text)
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
            delta_text = self.stop.release(finish_reason is not None)
            self.text = self.stop.text
        else:
            self.text += delta_text
        logprobs = None
        if self.options.logprobs is not None:
            logprobs = self.logprobs_for([token], [key], self.text_offset)
            if not self.chat:
                self.text_offset += len(self.vocab.token_text(token))
        guided = self.options.guided
        if not self.chat or guided is None or guided.tool_mode is None:
            return StepOutput(delta_text, finish_reason, logprobs, stop_reason=stop_reason)
        if guided.tool_mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta_text}}
            if not self.tool_started:
                call = {
                    "id": _tool_call_id(self.response_id, self.index),
                    "type": "function",
                    "index": 0,
                    "function": {"name": guided.tool_name, "arguments": delta_text},
                }
                self.tool_started = True
            return StepOutput(delta_text, finish_reason, logprobs, {"tool_calls": [call]})
        return self._required_step(before, finish_reason, logprobs)

    def _required_step(
        self, before: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> StepOutput:
        """vLLM's ``extract_required_tool_call_streaming`` for the one call the simulated
        model writes: nothing until the call's name is complete and its parameters value has
        begun, then the first delta (id, type, name and the arguments so far), then the new
        argument text only, with ``name: null``; the array's closing characters send nothing."""
        guided = self.options.guided
        assert guided is not None
        current = self.text
        ready_now = guided.name_end <= len(current) and guided.args_start < len(current)
        ready_before = guided.name_end <= len(before) and guided.args_start < len(before)
        end = min(guided.args_end, len(current))
        delta: dict[str, Any] | None = None
        if ready_now and not ready_before:
            call: dict[str, Any] = {
                "id": _tool_call_id(self.response_id, self.index),
                "type": "function",
                "index": 0,
                "function": {
                    "name": guided.tool_name,
                    "arguments": current[guided.args_start : end],
                },
            }
            delta = {"tool_calls": [call]}
            self.tool_started = True
        elif ready_before and current[min(end, len(before)) : end]:
            new = current[min(end, len(before)) : end]
            delta = {"tool_calls": [{"index": 0, "function": {"name": None, "arguments": new}}]}
        if finish_reason == "stop" and self.tool_started:
            finish_reason = "tool_calls"
        if delta is None:
            # vLLM sends a chunk with an empty delta only when it has something else to carry.
            if finish_reason is None and logprobs is None:
                return StepOutput("", None, None, None, skip=True)
            delta = {}
        return StepOutput("", finish_reason, logprobs, delta)

    def message(
        self, text: str, finish_reason: str
    ) -> tuple[str | None, list[dict[str, Any]] | None, str]:
        """The non-streamed answer: (content, tool_calls, finish_reason); None: unchanged."""
        guided = self.options.guided
        if not self.chat or guided is None or guided.tool_mode is None:
            return None, None, finish_reason
        calls: list[dict[str, Any]] = []
        if guided.tool_mode == "named":
            if text.strip():
                calls.append(self._call(guided.tool_name or "", text))
        else:
            for name, parameters in _parse_required(text):
                calls.append(self._call(name, _dumps(parameters)))
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        # Named and required tool choice both answer content "" beside the calls.
        return "", calls, finish_reason

    def _call(self, name: str, arguments: str) -> dict[str, Any]:
        return {
            "id": _tool_call_id(self.response_id, self.index),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }


def _parse_required(text: str) -> list[tuple[str, Any]]:
    """vLLM's ``TypeAdapter(list[FunctionDefinition]).validate_json``: the calls of a complete
    array, none if it does not parse (a truncated answer)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, list):
        return []
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        parameters = item.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            return []
        calls.append((item["name"], parameters))
    return calls

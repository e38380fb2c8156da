"""The one place that builds the bodies of the two legs of a P/D request (vLLM's protocol).

Prefill leg: the client's body with ``max_tokens: 1`` (chat: also ``max_completion_tokens: 1``),
``stream: false``, ``kv_transfer_params`` asking the engine to keep the prompt's KV for a remote
decode, and without the fields that only shape the output (``_NOT_ON_PREFILL``): its one token
is thrown away, and vLLM hands the KV over only when that token stops the request on its length
cap, so a stop string or token, or ``min_tokens``, there could only cost the handoff; logprobs
and output constraints would only cost time. Everything that renders into the prompt stays
(``messages``, ``tools``, ``tool_choice``, the chat template's arguments), so both engines see
the same prompt tokens. Decode leg: the client's body plus the ``kv_transfer_params`` the
prefill engine returned, unchanged, streamed with usage so the router sees every token, the
first-token deadline and the completion token count whatever the client asked for. Release leg:
the prefill leg's body with the ``kv_transfer_params`` the prefill engine returned, sent to a
decode engine that refused the decode leg (a field only that leg carries), so that it pulls the
prompt's KV, and the prefill engine frees it, instead of the KV staying held until its lease
expires.
"""

from __future__ import annotations

from typing import Any

from narwhal.engines.lax import lax_bool

__all__ = [
    "PREFILL_KV_REQUEST",
    "STRUCTURED_OUTPUT_FIELDS",
    "decode_leg_body",
    "prefill_leg_body",
    "release_leg_body",
]

PREFILL_KV_REQUEST: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The fields that constrain the output to a structure (vLLM's structured outputs).
STRUCTURED_OUTPUT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)

_NOT_ON_PREFILL = frozenset(
    (
        "stream_options",
        "min_tokens",
        "min_completion_tokens",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "logprobs",
        "top_logprobs",
        "logprob_token_ids",
        "logit_bias",
        *STRUCTURED_OUTPUT_FIELDS,
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    )
)


def prefill_leg_body(client_body: dict[str, Any], chat: bool) -> dict[str, Any]:
    body = {k: v for k, v in client_body.items() if k not in _NOT_ON_PREFILL}
    body["max_tokens"] = 1
    if chat:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = dict(PREFILL_KV_REQUEST)
    return body


def release_leg_body(
    client_body: dict[str, Any], chat: bool, kv_transfer_params: Any
) -> dict[str, Any]:
    body = prefill_leg_body(client_body, chat)
    body["kv_transfer_params"] = kv_transfer_params
    return body


def decode_leg_body(client_body: dict[str, Any], kv_transfer_params: Any) -> dict[str, Any]:
    body = dict(client_body)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    else:
        body.pop("kv_transfer_params", None)
    body["stream"] = True
    options = dict(client_body.get("stream_options") or {})
    if not lax_bool(options.get("include_usage")):
        # vLLM puts usage in every chunk only for a client that asked for usage at all; the
        # leg asks for it (the router counts with it), so it must not ask for that too.
        options.pop("continuous_usage_stats", None)
    options["include_usage"] = True
    body["stream_options"] = options
    return body

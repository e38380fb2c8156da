"""docs/router.md's table of request fields is what the router does: every field vLLM 0.32
accepts has a row, and each row's rule (both legs, decode only, refused) holds for the leg
bodies and the client-request checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from narwhal.engines.legs import decode_leg_body, prefill_leg_body
from narwhal.serve.errors import RouterError
from narwhal.serve.validation import parse_client_request

DOC = Path(__file__).resolve().parents[2] / "docs" / "router.md"
MODEL = "m"

# vLLM 0.32's ChatCompletionRequest and CompletionRequest fields (model_fields), and the
# OpenAI fields vLLM no longer has.
VLLM_CHAT = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "thinking_token_budget",
    "include_reasoning",
    "parallel_tool_calls",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
]
VLLM_COMPLETION = [
    "model",
    "prompt",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "prompt_embeds",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
]
OPENAI_ONLY = ["best_of", "functions", "function_call"]
# A value that turns each refused field on.
ON = {
    "best_of": 2,
    "echo": True,
    "prompt_logprobs": 1,
    "use_beam_search": True,
    "suffix": "x",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "kv_transfer_params": {},
    "ec_transfer_params": {},
}


def _rows() -> list[tuple[list[str], str]]:
    text = DOC.read_text()
    section = text[text.index("## Request fields") :]
    section = section[: section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, rule = line.strip("|").split("|", 1)
        names = [n.split()[0] for n in re.findall(r"`([^`]+)`", first) if n not in ("C", "P")]
        rows.append((names, rule.strip()))
    return rows


ROWS = _rows()
RULES = {name: rule for names, rule in ROWS for name in names}


def test_every_vllm_field_has_a_row() -> None:
    missing = sorted(set(VLLM_CHAT + VLLM_COMPLETION + OPENAI_ONLY) - set(RULES))
    assert not missing, f"fields without a row in docs/router.md: {missing}"


def _rule_of(rule: str) -> str:
    for kind in ("both legs", "decode only", "refused", "handled by the router", "passed through"):
        if rule.startswith(kind):
            return kind
    return rule.split(";")[0]


@pytest.mark.parametrize(
    "name", sorted(n for n, r in RULES.items() if _rule_of(r) in ("both legs", "passed through"))
)
def test_both_leg_fields_reach_both_engines(name: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], name: "v"}
    if name in ("messages", "prompt"):
        body[name] = [{"role": "user", "content": "x"}] if name == "messages" else "x"
    assert prefill_leg_body(body, chat=True)[name] == body[name]
    assert decode_leg_body(body, {"k": 1})[name] == body[name]


@pytest.mark.parametrize(
    "name", sorted(n for n, r in RULES.items() if _rule_of(r) == "decode only")
)
def test_decode_only_fields_skip_the_prefill_leg(name: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], name: "v"}
    assert name not in prefill_leg_body(body, chat=True)
    assert decode_leg_body(body, {"k": 1})[name] == "v"


@pytest.mark.parametrize("name", sorted(n for n, r in RULES.items() if _rule_of(r) == "refused"))
@pytest.mark.parametrize("chat", [False, True])
def test_refused_fields_are_refused_by_name(name: str, chat: bool) -> None:
    body = {"model": MODEL, name: ON[name], "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    with pytest.raises(RouterError) as info:
        parse_client_request(json.dumps(body).encode(), chat, MODEL, 100)
    assert info.value.status == 400 and info.value.param == name
    assert (
        "P/D" in info.value.message
        or "router" in info.value.message
        or "vLLM" in (info.value.message)
    )


def test_the_prefill_leg_gets_one_token_and_no_stream() -> None:
    assert RULES["max_tokens"].startswith("decode leg as sent")
    body = {"model": MODEL, "messages": [], "max_tokens": 9, "max_completion_tokens": 9}
    prefill = prefill_leg_body({**body, "stream": True}, chat=True)
    assert prefill["max_tokens"] == prefill["max_completion_tokens"] == 1
    assert prefill["stream"] is False and prefill["kv_transfer_params"]["do_remote_decode"]
    decode = decode_leg_body(body, {"k": 1})
    assert decode["max_tokens"] == 9 and decode["stream"] is True
    assert decode["stream_options"] == {"include_usage": True}

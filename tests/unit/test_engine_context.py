"""vLLM 0.32's context rule (engines.context), held to what its engines answered the interop
suite (tiny model, max_model_len 2048): the router and the simulator both answer with it."""

from __future__ import annotations

from narwhal.engines.context import (
    ContextRefusal,
    cut_max_tokens,
    max_tokens_refusal,
    min_tokens_refusal,
    output_cap,
    prompt_refusal,
    range_refusal,
    text_prompt_refusal,
)


def test_the_messages_are_vllms() -> None:
    refusal = max_tokens_refusal(10_000_000, "max_tokens", 2048)
    assert refusal is not None and refusal.param == "max_tokens"
    assert refusal.message == (
        "max_tokens=10000000 cannot be greater than max_model_len=2048. Please request fewer"
        " output tokens. (parameter=max_tokens, value=10000000)"
    )
    refusal = prompt_refusal(2049, 2048, counted=True)
    assert refusal is not None and refusal.param == "input_tokens"
    assert refusal.message == (
        "This model's maximum context length is 2048 tokens. However, your prompt contains at"
        " least 2049 input tokens, which exceeds this limit even without any output tokens."
        " Please reduce the length of the input prompt. (parameter=input_tokens, value=2049)"
    )
    cut, refusal = cut_max_tokens(1, 2048, 2048)
    assert cut == 0 and refusal is not None and refusal.param == "max_tokens"
    assert (
        refusal.message == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    )
    refusal = min_tokens_refusal(1200, 1048)
    assert refusal is not None and refusal.param is None
    assert refusal.message == "min_tokens must be less than or equal to max_tokens=1048, got 1200."


def test_a_max_tokens_past_what_the_prompt_leaves_is_cut() -> None:
    assert cut_max_tokens(1500, 1000, 2048) == (1048, None)
    assert cut_max_tokens(10, 1000, 2048) == (10, None)
    assert max_tokens_refusal(2048, "max_tokens", 2048) is None
    assert max_tokens_refusal(None, "max_tokens", 2048) is None
    assert min_tokens_refusal(1048, 1048) is None


def test_a_prompt_past_the_context_is_counted_or_said_at_least() -> None:
    assert prompt_refusal(2048, 2048, counted=True) is None
    counted = prompt_refusal(3000, 2048, counted=True)
    assert counted is not None and "contains 3000 input tokens" in counted.message
    text = prompt_refusal(3000, 2048, counted=False)  # tokenized to one past the context
    assert text is not None and "contains at least 2049 input tokens" in text.message
    assert text_prompt_refusal(2048) == text


def test_a_chat_cap_names_its_own_field() -> None:
    refusal = max_tokens_refusal(5000, "max_completion_tokens", 2048)
    assert refusal is not None and refusal.param == "max_completion_tokens"
    assert refusal.message.startswith("max_completion_tokens=5000 cannot be greater")


def test_a_chat_requests_max_completion_tokens_caps_over_max_tokens() -> None:
    assert output_cap(100, 50) == (50, "max_completion_tokens")
    assert output_cap(100, None) == (100, "max_tokens")
    assert output_cap(None, None) == (None, "max_tokens")


def test_a_count_below_its_range_is_refused_in_vllms_words() -> None:
    # As vLLM 0.32 answered them through the router (SamplingParams._verify_args).
    assert range_refusal("max_tokens", 1) is None and range_refusal("min_tokens", 0) is None
    refusal = range_refusal("max_tokens", -1)
    assert refusal == ContextRefusal(
        "max_tokens must be at least 1, got -1. (parameter=max_tokens, value=-1)", "max_tokens"
    )
    assert range_refusal("max_completion_tokens", 0) == range_refusal("max_tokens", 0)
    assert range_refusal("n", 0) == ContextRefusal("n must be at least 1, got 0.", None)
    assert range_refusal("min_tokens", -1) == ContextRefusal(
        "min_tokens must be greater than or equal to 0, got -1.", None
    )

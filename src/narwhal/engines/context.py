"""vLLM 0.32's context rule, in its words: the one place the router's validation and the
simulated engine take it from (probed on the interop suite's engines; vLLM's
``renderers/params.py`` and ``get_max_tokens``).

A ``max_tokens`` past ``max_model_len`` is refused whatever the prompt; a prompt past it is
refused (a token-id prompt by its length, a text prompt tokenized to one token past the
context: "at least"); otherwise ``max_tokens`` is cut to what the prompt leaves, and a prompt
that fills the context leaves 0, refused; a ``min_tokens`` past the cut value is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_COMPLETIONS_MAX_TOKENS",
    "ContextRefusal",
    "cut_max_tokens",
    "max_tokens_refusal",
    "min_tokens_refusal",
    "output_cap",
    "prompt_refusal",
    "range_refusal",
    "text_prompt_refusal",
]


# vLLM's max_tokens for a completions request that sets none (a chat request's: the context
# the prompt leaves).
DEFAULT_COMPLETIONS_MAX_TOKENS = 16


@dataclass(frozen=True)
class ContextRefusal:
    """A 400 as vLLM words it: its message and the field it names (None: none)."""

    message: str
    param: str | None


def output_cap(max_tokens: int | None, max_completion_tokens: int | None) -> tuple[int | None, str]:
    """The output cap a request set and the field that set it: a chat request's
    ``max_completion_tokens`` over its ``max_tokens`` (pass None for a completions request,
    which has no such field)."""
    if max_completion_tokens is not None:
        return max_completion_tokens, "max_completion_tokens"
    return max_tokens, "max_tokens"


def max_tokens_refusal(
    max_tokens: int | None, field: str, max_model_len: int
) -> ContextRefusal | None:
    """``field`` (``max_tokens``, or ``max_completion_tokens`` when a chat request set it)
    past the context, whatever the prompt."""
    if max_tokens is None or max_tokens <= max_model_len:
        return None
    return ContextRefusal(
        f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. Please"
        f" request fewer output tokens. (parameter={field}, value={max_tokens})",
        field,
    )


def prompt_refusal(prompt_tokens: int, max_model_len: int, counted: bool) -> ContextRefusal | None:
    """A prompt past the context. ``counted``: its length is known (token ids); otherwise it is
    a text prompt, refused as ``text_prompt_refusal`` words it."""
    if prompt_tokens <= max_model_len:
        return None
    if not counted:
        return text_prompt_refusal(max_model_len)
    return _input_too_long(prompt_tokens, max_model_len)


def text_prompt_refusal(max_model_len: int) -> ContextRefusal:
    """A text prompt past the context: vLLM tokenizes it to one token past the context and says
    "at least" that."""
    return _input_too_long(max_model_len + 1, max_model_len)


def _input_too_long(count: int, max_model_len: int) -> ContextRefusal:
    at_least = "at least " if count == max_model_len + 1 else ""
    return ContextRefusal(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt"
        f" contains {at_least}{count} input tokens, which exceeds this limit even without any"
        f" output tokens. Please reduce the length of the input prompt. (parameter=input_tokens,"
        f" value={count})",
        "input_tokens",
    )


# The least value of each count field vLLM checks (SamplingParams._verify_args).
_LEAST = {"max_tokens": 1, "max_completion_tokens": 1, "n": 1, "min_tokens": 0}


def range_refusal(name: str, value: int) -> ContextRefusal | None:
    """A count field below its least value, in vLLM 0.32's words (probed through the router):
    ``max_completion_tokens`` is named ``max_tokens``, as vLLM maps it."""
    least = _LEAST[name]
    if value >= least:
        return None
    if name in ("max_tokens", "max_completion_tokens"):
        return _max_tokens_below_one(value)
    if name == "n":
        return ContextRefusal(f"n must be at least 1, got {value}.", None)
    return ContextRefusal(f"min_tokens must be greater than or equal to 0, got {value}.", None)


def _max_tokens_below_one(value: int) -> ContextRefusal:
    return ContextRefusal(
        f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})",
        "max_tokens",
    )


def cut_max_tokens(
    max_tokens: int, prompt_tokens: int, max_model_len: int
) -> tuple[int, ContextRefusal | None]:
    """``max_tokens`` cut to what a prompt that fits leaves of the context; refused when that
    is nothing."""
    cut = min(max_tokens, max_model_len - prompt_tokens)
    if cut >= 1:
        return cut, None
    return cut, _max_tokens_below_one(cut)


def min_tokens_refusal(min_tokens: int, max_tokens: int) -> ContextRefusal | None:
    if min_tokens <= max_tokens:
        return None
    return ContextRefusal(
        f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
        None,
    )

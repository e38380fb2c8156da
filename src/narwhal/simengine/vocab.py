"""The simulator's built-in vocabulary and tokenizer.

Ids 0..255 are raw bytes, so any text tokenizes; the next ids are four-letter words with a
leading space (" kalo"), which is what generation emits, so generated text reads as words and
tokenizes back to the same ids; three special tokens close the vocabulary. ``vocab_seed``
permutes the word ids: two engines with different seeds disagree on tokenization, which is what
the preflight tokenization gate must catch.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatTemplateError", "Vocabulary", "render_chat"]

_CONSONANTS = "bcdfghjklmnprstvwxyz"
_VOWELS = "aeiou"
NUM_BYTE_TOKENS = 256
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS = "<|eos|>"
_TOKEN_RE = re.compile(r" [a-z]{4}|<\|im_start\|>|<\|im_end\|>|<\|eos\|>|.", re.S)


def _words() -> list[str]:
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    return [" " + a + b for a in syllables for b in syllables]


@dataclass(frozen=True)
class Vocabulary:
    seed: int = 0
    words: tuple[str, ...] = field(init=False)
    word_ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        words = _words()
        if self.seed:
            random.Random(self.seed).shuffle(words)
        object.__setattr__(self, "words", tuple(words))
        ids = {w: NUM_BYTE_TOKENS + i for i, w in enumerate(words)}
        ids[IM_START] = self.im_start_id
        ids[IM_END] = self.im_end_id
        ids[EOS] = self.eos_id
        object.__setattr__(self, "word_ids", ids)

    @property
    def num_words(self) -> int:
        return len(self.words)

    @property
    def first_word_id(self) -> int:
        return NUM_BYTE_TOKENS

    @property
    def im_start_id(self) -> int:
        return NUM_BYTE_TOKENS + len(self.words)

    @property
    def im_end_id(self) -> int:
        return self.im_start_id + 1

    @property
    def eos_id(self) -> int:
        return self.im_start_id + 2

    @property
    def size(self) -> int:
        return self.eos_id + 1

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        lookup = self.word_ids
        for match in _TOKEN_RE.finditer(text):
            piece = match.group()
            token = lookup.get(piece)
            if token is not None:
                ids.append(token)
            elif len(piece) == 1:
                ids.extend(piece.encode("utf-8"))
            else:
                # " abcd" that is not a vocabulary word: fall back to bytes.
                ids.extend(piece.encode("utf-8"))
        return ids

    def token_text(self, token: int) -> str:
        if NUM_BYTE_TOKENS <= token < self.im_start_id:
            return self.words[token - NUM_BYTE_TOKENS]
        if token == self.im_start_id:
            return IM_START
        if token == self.im_end_id:
            return IM_END
        if token == self.eos_id:
            return ""
        if 0 <= token < NUM_BYTE_TOKENS:
            return bytes([token]).decode("utf-8", errors="replace")
        raise ValueError(f"token id {token} is outside the vocabulary (size {self.size})")

    def decode(self, tokens: Iterable[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for token in tokens:
            if 0 <= token < NUM_BYTE_TOKENS:
                pending.append(token)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            out.append(self.token_text(token))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def check_ids(self, tokens: Sequence[int]) -> int | None:
        """Return the first id outside the vocabulary, or None."""
        size = self.size
        for token in tokens:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < size:
                return token
        return None


class ChatTemplateError(ValueError):
    pass


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
        return "".join(parts)
    raise ChatTemplateError(f"messages[{index}].content: expected a string or a list of parts")


def render_chat(messages: Any, add_generation_prompt: bool = True) -> str:
    """ChatML-style template: what the engine tokenizes for a chat request."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages: expected a non-empty list")
    out: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}]: expected an object with a 'role'")
        out.append(
            f"{IM_START}{message['role']}\n{_content_text(message.get('content'), i)}{IM_END}\n"
        )
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)

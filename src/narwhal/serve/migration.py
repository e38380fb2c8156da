"""Request migration: a decode leg that breaks after its first token (the engine died, answered
an error event, or stalled) is continued on another pair from the tokens the client already
received, and the new stream is spliced into the client's.

Continuing exactly needs token ids, not text: re-tokenising text is not always the same ids.
So while migration is possible the decode leg asks the engine for ``return_token_ids`` (vLLM:
the prompt's ids on the first chunk, each chunk's own ids beside its text), the trace keeps them,
and the ids are blanked from what the client sees unless it asked for them. The continuation is
a completions request whose prompt is those ids (the chat template already applied: the ids are
what the engine decoded from), ``max_tokens`` reduced by what was generated, the sampling
parameters unchanged; it goes through a prefill leg and a KV handoff like any request, and its
chunks are rewritten into the client's shape (its id, object and choice format; usage counting
the original prompt and everything the client received).

What cannot be continued exactly, and so is not migrated (the stream ends with an error event
as before): a chat request with tools the engine may call (its tool parser's state is in the
broken engine), a structured output (``response_format``, guided decoding: the grammar would
restart mid-answer), chat logprobs (the completions format they would come back in loses the
order of equal-text alternatives), a choice of an ``n > 1`` or batched request (each choice is
its own generation, seeded from the request: the continuation's is not), and any stream in
which the engine sent reasoning or tool-call deltas. At temperature > 0 a continuation samples
from the same distribution but not the same draw (a seed restarts with the continuation).

With stop strings the engine holds back the last ``len(longest stop) - 1`` characters of its
text until no stop string can begin in them (vLLM's detokenizer), while their tokens' ids have
gone out: the continuation starts after every id, so the router asks an engine to detokenize
the ids and sends the client the characters it did not get before the continuation's text. Stop
strings are matched in the continuation's text only, so one straddling the splice is missed.
Presence and frequency penalties and multi-token ``bad_words`` apply to generated tokens only,
and the continuation's prompt holds the ids generated before the splice: with them the answer
past the splice may differ from the unbroken one even at temperature 0.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal.contract import Migration
from narwhal.engines.lax import lax_bool
from narwhal.engines.legs import STRUCTURED_OUTPUT_FIELDS
from narwhal.serve.errors import RouterError
from narwhal.serve.pd import DEFAULT_COMPLETIONS_MAX_TOKENS, DecodeStream, PDRouter
from narwhal.serve.record import RequestRecord
from narwhal.serve.stalls import StallDeadline, StallSweeper
from narwhal.serve.token_ids import blank_token_ids, parse_ids
from narwhal.serve.tokenizer_calls import ask_tokenizer
from narwhal.serve.validation import ClientRequest

__all__ = ["MigrationTrace", "Migrator", "continuation_request", "new_trace", "not_migratable"]

# Sampling and output fields a continuation carries unchanged (vLLM's names; both routes).
_CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "priority",
    "cache_salt",
    "user",
)


_STRUCTURED_OUTPUT = frozenset(STRUCTURED_OUTPUT_FIELDS)
# Received characters a recovered text must end with, beyond the holdback.
_TAIL_CHARS = 32
# Prompt ids decoded before the generated ones when the held-back text is recovered (vLLM's
# incremental detokenizer starts from the prompt's last few tokens).
_CONTEXT_IDS = 8
# Per engine asked to detokenize at a migration (the client waits on it).
_DETOKENIZE_TIMEOUT_S = 5.0


def not_migratable(request: ClientRequest) -> str | None:
    """Why ``request`` cannot be continued exactly on another engine, or None when it can."""
    body = request.body
    if request.choices:
        return "n > 1 or batched prompts"
    if request.chat:
        if body.get("tools") and body.get("tool_choice") != "none":
            return "tools"
        if body.get("logprobs"):
            return "chat logprobs"
    # Most requests name none of the fields: one set operation rules them all out.
    if not _STRUCTURED_OUTPUT.isdisjoint(body) and any(
        body.get(name) is not None for name in STRUCTURED_OUTPUT_FIELDS
    ):
        return "structured output"
    return None


@dataclass(eq=False, slots=True)
class MigrationTrace:
    """What the client of one request has received, kept as the stream goes so that the
    request can be continued elsewhere; and, once it has been, the rewriting of the
    continuation's chunks into the client's."""

    chat: bool
    settings: Migration
    max_model_len: int
    # The client's max_tokens (None: up to the model's length, a chat request's default).
    max_tokens: int | None
    client_ids: bool  # the client asked for token ids: they stay in its chunks
    logprobs: bool  # completions with logprobs: their text_offset continues
    # Characters the engine holds back while a stop string may begin in them (vLLM's
    # detokenizer: the longest stop string's length - 1; 0 without stop strings, or when they
    # are kept in the output).
    holdback: int = 0
    # The prompt's ids: parsed, or (:meth:`keep_prompt_ids`) as the engine wrote them, parsed
    # when asked for (``prompt_ids``).
    _prompt_ids: list[int] | None = None
    _prompt_raw: bytes | None = None
    # The generated ids: parsed, then those the relay kept as the engine wrote them (parsed
    # when asked for: ``generated``; ``serve.relay.EventRenderer.render`` cuts them out).
    _ids: list[int] = field(default_factory=list)
    kept_ids: list[bytes] = field(default_factory=list)
    head: dict[str, Any] | None = None  # id, object, created, model of the client's chunks
    exact: bool = True  # False once the engine sent what a continuation cannot reproduce
    finished: bool = False  # a finish_reason arrived: the answer is whole
    # Characters of text the client received, counted when the trace observes text
    # (``observes_text``): logprobs' text_offset, and the text an engine held back.
    text_chars: int = 0
    # Held-back text a migration recovered, sent with the continuation's first choice.
    pending_text: str = ""
    # The last characters the client received (with a holdback): what a detokenized text must
    # end its received part with, or it is not the text the client had.
    sent_tail: str = ""
    # Characters the client had when the current continuation began: the engine's offsets
    # count from 0 at its own start and run on through its text, so this, not text_chars
    # (which grows with that text), is what they are shifted by.
    text_shift: int = 0
    migrations: int = 0
    completion_offset: int = 0  # tokens the earlier legs generated (the client's usage)
    # The client's prompt's usage details (its first prefill leg's), which a continuation's
    # usage reports in place of its own prompt's; None: not known (left out).
    prompt_details: dict[str, Any] | None = None

    @property
    def observes_text(self) -> bool:
        """Every chunk is observed whole and its text counted (not only its ids kept)."""
        return self.logprobs or self.holdback > 0

    def held_back(self, text: str) -> str | None:
        """What the client has not received of ``text``, the text of every generated id as a
        tokenizer decoded it; None when ``text`` does not begin with what the client received
        (a tokenizer that decodes the ids alone otherwise than in the stream: a leading
        space, special tokens)."""
        received = text[: self.text_chars]
        if len(received) < self.text_chars or not received.endswith(self.sent_tail):
            return None
        return text[self.text_chars :]

    def _sent(self, text: str) -> None:
        if text:
            self.text_chars += len(text)
            self.sent_tail = (self.sent_tail + text)[-(self.holdback + _TAIL_CHARS) :]

    def observe(self, obj: dict[str, Any]) -> None:
        """One chunk of the stream the client is receiving (already relayed as it came)."""
        choices = obj.get("choices")
        if not choices:
            return
        if self.head is None:
            self.set_head(obj)
        for choice in choices:
            ids = choice.get("token_ids")
            if ids:
                self.generated.extend(ids)
            if self.chat:
                delta = choice.get("delta")
                if delta and (
                    delta.get("tool_calls")
                    or delta.get("reasoning")
                    or delta.get("reasoning_content")
                ):
                    self.exact = False
                if self.holdback and delta:
                    self._sent(delta.get("content") or "")
            elif self.holdback:
                self._sent(choice.get("text") or "")
            elif self.logprobs:
                self.text_chars += len(choice.get("text") or "")
            if choice.get("finish_reason"):
                self.finished = True

    def set_head(self, obj: dict[str, Any]) -> None:
        """The stream's first chunk with a choice: the head of the client's chunks (id,
        object, created, model), and the prompt's ids when the chunk still has them parsed (a
        client that asked for ids: they were not cut out)."""
        self.head = {
            "id": obj.get("id"),
            "object": obj.get("object"),
            "created": obj.get("created"),
            "model": obj.get("model"),
        }
        ids = obj.get("prompt_token_ids")
        choices = obj.get("choices")
        if ids is None and choices and isinstance(choices[0], dict):
            ids = choices[0].get("prompt_token_ids")
        if isinstance(ids, list):
            self._prompt_ids = ids

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's ids as the engine returned them, or None (not yet, or never)."""
        if self._prompt_ids is None and self._prompt_raw is not None:
            self._prompt_ids = parse_ids(self._prompt_raw)
            self._prompt_raw = None
        return self._prompt_ids

    def keep_prompt_ids(self, raw: bytes) -> None:
        """The prompt's ids as the engine wrote them on its first chunk, cut out of it before
        the parse (``PDRouter`` does: ``DecodeStream.decode_prompt_ids``), parsed only when a
        migration needs them (``prompt_ids``)."""
        self._prompt_raw = raw

    def take(self, payload: bytes, obj: dict[str, Any]) -> bytes:
        """A chunk of a completions stream with logprobs (``payload``, parsed as ``obj``; their
        text offsets continue, so every chunk is observed whole): observed, and returned as the
        client gets it (:meth:`observe`, :meth:`strip`). The other streams' chunks only have
        their ids kept, unparsed (``kept_ids``), by the relay (``EventRenderer.render``)."""
        self.observe(obj)
        return self.strip(payload)

    def note(self, obj: dict[str, Any]) -> None:
        """One chunk of a stream the router collects for a non-streamed answer (no client
        bytes to blank): the first (and every one with logprobs) observed, then only its ids
        kept, as the parse left them."""
        if self.head is None or self.observes_text:
            self.observe(obj)
            return
        for choice in obj.get("choices") or ():
            ids = choice.get("token_ids")
            if ids:
                self._ids += ids

    @property
    def generated(self) -> list[int]:
        """Every id generated so far, in order."""
        if self.kept_ids:
            ids = self._ids
            for raw in self.kept_ids:
                ids += parse_ids(raw)
            self.kept_ids.clear()
        return self._ids

    def strip(self, payload: bytes) -> bytes:
        """The chunk as the client would have had it without the ids the router asked for."""
        return payload if self.client_ids else blank_token_ids(payload)

    def blocked(
        self, token_events: int, finished: bool = False, non_text: bool = False
    ) -> str | None:
        """Why the stream cannot be continued now, or None when it can. ``finished`` and
        ``non_text``: what the relay's tally saw of the chunks whose ids it kept without
        looking (a finish reason; a reasoning or tool-call delta)."""
        if not self.exact or non_text:
            return "the engine sent reasoning or tool-call deltas"
        if self.finished or finished:
            return "the answer was complete"
        if self.migrations >= self.settings.limit:
            return f"the migration limit ({self.settings.limit}) is reached"
        if self.prompt_ids is None or self.head is None:
            return "the engine did not return the prompt's token ids"
        if token_events and not self.generated:
            return "the engine did not return the generated token ids"
        length = len(self.prompt_ids) + len(self.generated)
        bound = min(self.settings.max_sequence_tokens or self.max_model_len, self.max_model_len)
        if length >= bound:
            return f"the sequence ({length} tokens) reaches the bound ({bound})"
        if self.remaining() < 1:
            return "no tokens left to generate"
        return None

    def remaining(self) -> int:
        assert self.prompt_ids is not None
        done = len(self.generated)
        if self.max_tokens is not None:
            return self.max_tokens - done
        return self.max_model_len - len(self.prompt_ids) - done

    def translate(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A continuation's chunk (a completions chunk) as the client's stream would carry it:
        the client's id, object and choice format; usage of the original prompt and of every
        token the client received."""
        assert self.head is not None and self.prompt_ids is not None
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt = len(self.prompt_ids)
            completion = (usage.get("completion_tokens") or 0) + self.completion_offset
            # The continuation's prompt details (its cached tokens) are not the client's
            # prompt's: the first prefill leg's stand in, or, unknown, they are left out as an
            # engine leaves out what it does not report.
            usage = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
            if self.prompt_details is not None:
                usage["prompt_tokens_details"] = self.prompt_details
            obj["usage"] = {
                **usage,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        choices = obj.get("choices")
        if not choices:
            return {**obj, **self.head}
        out = []
        for choice in choices:
            ids = choice.get("token_ids")
            if ids:
                self.generated.extend(ids)
            text = choice.get("text") or ""
            if self.pending_text:
                text = self.pending_text + text
                self.pending_text = ""
            if choice.get("finish_reason"):
                self.finished = True
            if self.chat:
                rewritten: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": choice.get("finish_reason"),
                    "stop_reason": choice.get("stop_reason"),
                    "token_ids": ids if self.client_ids else None,
                }
            else:
                rewritten = {
                    **choice,
                    "index": 0,
                    "text": text,
                    "token_ids": ids if self.client_ids else None,
                    "prompt_token_ids": None,
                }
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
                    shift = self.text_shift
                    rewritten["logprobs"] = {
                        **logprobs,
                        "text_offset": [o + shift for o in logprobs["text_offset"]],
                    }
            if self.holdback:
                self._sent(text)
            else:
                self.text_chars += len(text)
            out.append(rewritten)
        return {**obj, **self.head, "choices": out}

    def begin(self, held_back: str = "") -> None:
        """A continuation starts: its chunks are translated from now on, the first choice's
        text after ``held_back`` (:meth:`held_back`)."""
        self.migrations += 1
        self.completion_offset = len(self.generated)
        self.pending_text = held_back
        self.text_shift = self.text_chars + len(held_back)


def new_trace(
    request: ClientRequest, settings: Migration, max_model_len: int
) -> MigrationTrace | None:
    """The trace of a request that can be migrated, or None (migration off, or the request
    is of a kind a continuation cannot reproduce)."""
    if not settings.limit or not_migratable(request) is not None:
        return None
    max_tokens = request.max_tokens
    if max_tokens is None and not request.chat:
        max_tokens = DEFAULT_COMPLETIONS_MAX_TOKENS
    body = request.body
    # Positional: matching keywords would cost as much as making the object (one per request).
    trace = MigrationTrace(
        request.chat,
        settings,
        max_model_len,
        max_tokens,
        bool(body.get("return_token_ids")),  # client_ids
        not request.chat and body.get("logprobs") is not None,  # logprobs
    )
    stop = body.get("stop")
    if stop and not lax_bool(body.get("include_stop_str_in_output")):
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ()
        trace.holdback = max(0, max((len(s) for s in stops if isinstance(s, str)), default=0) - 1)
    return trace


class Migrator:
    """One request's migrations: the decode stream it holds now, and the continuation of it on
    another pair when it breaks."""

    __slots__ = ("record", "request", "router", "stream", "trace")

    def __init__(
        self,
        router: PDRouter,
        request: ClientRequest,
        record: RequestRecord,
        stream: DecodeStream,
        trace: MigrationTrace | None,
    ) -> None:
        self.router = router
        self.request = request
        self.record = record
        self.stream = stream
        self.trace = trace
        if trace is not None:
            if stream.decode_prompt_ids is not None:
                trace.keep_prompt_ids(stream.decode_prompt_ids)
            # The first prefill leg has answered: its usage details stand in for the client's
            # prompt's wherever the decode engine's are lost (a continuation, a cut stream).
            trace.prompt_details = record.prefill_prompt_details

    @property
    def stall_deadline(self) -> StallDeadline | None:
        """How long the current stream may go without a token before it counts as stalled,
        and the router's sweeper that watches it (None: never, when the request cannot be
        migrated): the migrator itself, whose period is worked out when asked."""
        return None if self.trace is None else self

    @property
    def stall_s(self) -> float:
        return self.router.stall_s(self.stream)

    @property
    def sweeper(self) -> StallSweeper:
        return self.router.stalls

    async def resume(self, reason: str, message: str) -> DecodeStream | None:
        """Continue the request on another pair after its stream broke (``reason``); the new
        stream (positioned after its first event), or None when no pair could take it (then
        the break is the client's, as without migration)."""
        trace = self.trace
        assert trace is not None
        number = trace.migrations + 1
        held_back = ""
        if trace.holdback and trace.generated:
            recovered = await self._recover_held_back(trace)
            if recovered is None:
                self.record.attempt(
                    "migration",
                    self.stream.engine,
                    "failed",
                    reason=reason,
                    error="the text the engine held back could not be recovered",
                )
                return None
            held_back = recovered
        continuation = continuation_request(self.request, trace)
        try:
            stream = await self.router.continue_on(
                self.stream, continuation, self.record, reason, number, len(trace.generated)
            )
        except RouterError as exc:
            self.record.attempt(
                "migration", self.stream.engine, "failed", reason=reason, error=exc.message
            )
            return None
        trace.begin(held_back)
        self.stream = stream
        self.record.migrations = number
        return stream

    async def _recover_held_back(self, trace: MigrationTrace) -> str | None:
        """The text the engine held back, from an engine's tokenizer. Decoded as vLLM's
        detokenizer decodes a stream, after a few of the prompt's ids (a tokenizer that
        drops a text's leading space keeps it there), and failing that the generated ids
        alone; either only when it begins with what the client received."""
        generated = trace.generated
        context = (trace.prompt_ids or [])[-_CONTEXT_IDS:]
        if context:
            # Two independent calls: the client waits on them, so at once.
            before, whole = await asyncio.gather(
                self._detokenize(context), self._detokenize(context + generated)
            )
            if before is not None and whole is not None and whole.startswith(before):
                held = trace.held_back(whole[len(before) :])
                if held is not None:
                    return held
        alone = await self._detokenize(generated)
        return None if alone is None else trace.held_back(alone)

    async def _detokenize(self, ids: list[int]) -> str | None:
        """The text of ``ids`` as an engine's tokenizer has it (vLLM's ``/detokenize``), from
        another engine than the broken stream's; None when none answered it in time (a
        migration waits on it: a few seconds, two engines)."""
        router = self.router
        body = orjson.dumps({"model": self.request.model, "tokens": ids})
        answer, _ = await ask_tokenizer(
            router.engines,
            router.state,
            "/detokenize",
            body,
            0,
            avoid=self.stream.engine,
            attempts=2,
            attempt_timeout_s=_DETOKENIZE_TIMEOUT_S,
        )
        if answer is None or answer[0] != 200:
            return None
        try:
            text = orjson.loads(answer[1]).get("prompt")
        except (ValueError, AttributeError):
            return None
        return text if isinstance(text, str) else None


def continuation_request(request: ClientRequest, trace: MigrationTrace) -> ClientRequest:
    """The completions request that continues ``request`` from what ``trace`` has received."""
    assert trace.prompt_ids is not None
    body = request.body
    prompt = trace.prompt_ids + trace.generated
    remaining = trace.remaining()
    out: dict[str, Any] = {k: body[k] for k in _CARRIED if k in body}
    out.update(prompt=prompt, max_tokens=remaining, stream=True, return_token_ids=True)
    if body.get("min_tokens"):
        out["min_tokens"] = max(0, body["min_tokens"] - len(trace.generated))
    if not request.chat and body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
    out["stream_options"] = {"include_usage": True}
    options = body.get("stream_options")
    if (
        request.include_usage
        and isinstance(options, dict)
        and lax_bool(options.get("continuous_usage_stats"))
    ):
        # Usage in every chunk, as the client asked: it goes on past the splice.
        out["stream_options"]["continuous_usage_stats"] = True
    return ClientRequest(
        chat=False,
        body=out,
        model=request.model,
        stream=True,
        include_usage=True,
        max_tokens=remaining,
        prompt_tokens_exact=len(prompt),
    )

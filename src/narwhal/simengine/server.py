"""The simulated engine's HTTP surface: vLLM's OpenAI server endpoints, /tokenize, /metrics,
/version, an attestation endpoint, and a guarded fault-injection endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from narwhal.asgi import DisconnectAwareStreamingResponse
from narwhal.engines.lax import NOT_JSON, is_json
from narwhal.simengine.engine import (
    CRASH_EXIT_CODE,
    EngineConfig,
    EngineCore,
    ErrorEvent,
    RequestKind,
    SimRequest,
    TokenEvent,
    parse_kv_transfer_params,
)
from narwhal.simengine.faults import FaultSettings, FaultUpdate
from narwhal.simengine.generation import GenerationModel
from narwhal.simengine.kv_events import KVEventPublisher, KVEventsSettings
from narwhal.simengine.kv_transfer import KVTransferAgent
from narwhal.simengine.metrics import EngineMetrics
from narwhal.simengine.openai_surface import ChoiceState, StepOutput
from narwhal.simengine.protocol import (
    GenerationParams,
    ProtocolError,
    ResponseBuilder,
    error_body,
    parse_generation,
)
from narwhal.simengine.side_channel import PeerDirectory, serve_side_channel
from narwhal.simengine.vocab import EOS, IM_END, ChatTemplateError, Vocabulary, render_chat

__all__ = ["SimEngineSettings", "build_app"]

log = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"[^A-Za-z0-9_.:-]")
# The load gauges a lying engine reports as idle.
_LOAD_LINE_RE = re.compile(
    rb"^(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc)\{[^}]*\}) \S+$",
    re.M,
)
VLLM_PROTOCOL_VERSION = "0.32.0"


@dataclass(frozen=True)
class SimEngineSettings:
    engine: EngineConfig
    model_revision: str = "sim"
    vocab_seed: int = 0
    config_sha256: str | None = None
    shard_manifest_sha256: str | None = None
    gpu_arch: str = "sim"
    accelerator: str = "simulated"
    admin_token: str | None = None
    faults: FaultSettings = field(default_factory=FaultSettings)
    # vLLM's --enable-prompt-tokens-details and --kv-events-config.
    prompt_tokens_details: bool = False
    kv_events: KVEventsSettings | None = None
    # vLLM's --api-key (or VLLM_API_KEY): bearer keys its /v1 routes require; empty: none.
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    def declared_config_sha256(self) -> str:
        if self.config_sha256:
            return self.config_sha256
        text = f"narwhal-sim-config:{self.engine.served_model_name}:{self.engine.max_model_len}"
        return hashlib.sha256(f"{text}:vocab={self.vocab_seed}".encode()).hexdigest()

    def declared_shard_manifest_sha256(self) -> str:
        # The simulator's "weights" are its model seed: another seed is another checkpoint.
        if self.shard_manifest_sha256:
            return self.shard_manifest_sha256
        return hashlib.sha256(f"narwhal-sim-weights:{self.engine.model_seed}".encode()).hexdigest()


class _DroppedStream(Exception):
    """Raised inside a stream to make the server cut the connection (fault injection)."""


def _dropped(exc: BaseException | None) -> _DroppedStream | None:
    """The injected drop in ``exc``, also inside the exception groups Starlette's streaming
    response raises from its task group."""
    if isinstance(exc, _DroppedStream):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _dropped(inner)) is not None:
                return found
    return None


class DroppedStreamLogFilter(logging.Filter):
    """The server's "Exception in ASGI application" for a stream the fault injection cut: one
    warning line, not a traceback per dropped stream (the cut is the point)."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _dropped(record.exc_info[1] if record.exc_info else None)
        if found is not None:
            record.msg, record.args, record.exc_info, record.exc_text = str(found), (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def _error(message: str, type_: str, status: int, param: str | None = None) -> Response:
    return _json(error_body(message, type_, status, param), status)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass
class _State:
    settings: SimEngineSettings
    vocab: Vocabulary
    metrics: EngineMetrics
    generation_id: str
    started_at: float
    core: EngineCore | None = None
    kv_agent: KVTransferAgent | None = None
    side_channel: asyncio.Server | None = None


def build_app(settings: SimEngineSettings) -> Starlette:
    cfg = settings.engine
    faults = settings.faults
    vocab = Vocabulary(settings.vocab_seed)
    state = _State(
        settings=settings,
        vocab=vocab,
        # engine="0" as vLLM labels its (only) data-parallel rank: routers count distinct
        # engine label values to discover data parallelism.
        metrics=EngineMetrics(cfg.served_model_name, "0"),
        generation_id=uuid.uuid4().hex,
        started_at=time.time(),
    )
    state.metrics.cache_config(cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        pool = np.zeros((cfg.num_blocks, cfg.block_bytes), dtype=np.uint8)
        # Written once now, so every page is resident before the first request, as vLLM's KV
        # cache is: a zeroed array's pages are only mapped on first write, which cost the
        # first prompts to reach each block several milliseconds of page faults mid-step.
        pool.fill(0)
        agent = KVTransferAgent(
            agent_name=f"{cfg.engine_id}-{state.generation_id[:12]}",
            pool=pool,
            on_notification=lambda message: (
                state.core.on_notification(message) if state.core is not None else None
            ),
        )
        await loop.run_in_executor(None, agent.start, loop)
        state.kv_agent = agent
        publisher = None
        if settings.kv_events is not None:
            publisher = KVEventPublisher(settings.kv_events)
            publisher.start()
        state.core = EngineCore(
            cfg,
            GenerationModel(vocab, cfg.model_seed, cfg.eos_prob),
            state.metrics,
            faults,
            agent,
            PeerDirectory(timeout=min(5.0, cfg.kv_read_timeout_s)),
            publisher,
        )
        state.side_channel = await serve_side_channel(
            cfg.nixl_host,
            cfg.nixl_port,
            lambda: agent.peer_info(cfg.engine_id, state.generation_id),
        )
        state.core.start()
        log.info("engine %s ready (generation %s)", cfg.engine_id, state.generation_id)
        try:
            yield
        finally:
            state.side_channel.close()
            await state.core.close()
            agent.close()
            if publisher is not None:
                await publisher.close()

    def core() -> EngineCore:
        assert state.core is not None
        return state.core

    async def health(request: Request) -> Response:
        if faults.hang_health_next > 0:
            faults.hang_health_next -= 1
            await asyncio.sleep(3600)
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.served_model_name,
                        "object": "model",
                        "created": int(state.started_at),
                        "owned_by": "vllm",
                        "root": cfg.served_model_name,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [],
                    }
                ],
            }
        )

    async def version(request: Request) -> Response:
        return _json({"version": VLLM_PROTOCOL_VERSION, "simulator": "narwhal-sim"})

    async def attestation(request: Request) -> Response:
        return _json(
            {
                "schema": "narwhal.attestation/v1",
                "engine_id": cfg.engine_id,
                "model_id": cfg.served_model_name,
                "model_revision": settings.model_revision,
                "config_sha256": settings.declared_config_sha256(),
                "shard_manifest_sha256": settings.declared_shard_manifest_sha256(),
                "tp": cfg.tp_size,
                "gpu_arch": settings.gpu_arch,
                "accelerator": settings.accelerator,
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
                "nixl": {"host": cfg.nixl_host, "port": cfg.nixl_port},
                "kv_cache": {
                    "block_size": cfg.block_size,
                    "num_blocks": cfg.num_blocks,
                    "block_bytes": cfg.block_bytes,
                },
                "max_model_len": cfg.max_model_len,
                "vocab": {"seed": settings.vocab_seed, "size": vocab.size},
                "generation": state.generation_id,
                "pid": os.getpid(),
                "started_at": state.started_at,
                "simulated": True,
            }
        )

    async def metrics(request: Request) -> Response:
        mode = faults.metrics
        if mode == "stop":
            return _error("metrics unavailable (fault injection)", "ServiceUnavailable", 503)
        if mode == "hang":
            await asyncio.sleep(3600)
        text = generate_latest(state.metrics.registry)
        if mode == "lie":
            text = _LOAD_LINE_RE.sub(rb"\1 0.0", text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def read_json(request: Request) -> Any:
        if not is_json(request.headers.get("content-type")):
            # vLLM's validate_json_request, refused by its RequestValidationError handler.
            raise ProtocolError(f"1 validation error:\n  {NOT_JSON}", type_="Bad Request")
        raw = await request.body()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ProtocolError(f"invalid JSON body: {exc}") from exc

    def check_model(body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if model and model != cfg.served_model_name:  # vLLM: none or "" is the served model
            raise ProtocolError(
                f"The model `{model}` does not exist.",
                status=404,
                param="model",
                type_="NotFoundError",
            )

    def flag(body: dict[str, Any], name: str, default: bool) -> bool:
        value = body.get(name, default)
        if value is None and name == "return_token_strs":  # vLLM types it bool | None
            return False
        if not isinstance(value, bool):
            raise ProtocolError(f"{name}: Input should be a valid boolean", param=name)
        return value

    async def tokenize(request: Request) -> Response:
        # vLLM 0.32's TokenizeCompletionRequest ({"prompt"}) or TokenizeChatRequest
        # ({"messages"}) -> TokenizeResponse. The simulated vocabulary has no BOS token, so
        # add_special_tokens changes nothing here.
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ProtocolError("request body must be a JSON object")
            check_model(body)
            flag(body, "add_special_tokens", "messages" not in body)
            token_strs = flag(body, "return_token_strs", False)
            if "messages" in body:
                generation_prompt = flag(body, "add_generation_prompt", True)
                continue_final = flag(body, "continue_final_message", False)
                if generation_prompt and continue_final:
                    raise ProtocolError(
                        "Cannot set both `continue_final_message` and `add_generation_prompt` "
                        "to True."
                    )
                try:
                    text = render_chat(body["messages"], generation_prompt)
                except ChatTemplateError as exc:
                    raise ProtocolError(str(exc), param="messages") from exc
                if continue_final:
                    # The final message left open, as vLLM renders it: no end-of-turn token.
                    text = text.removesuffix(f"{IM_END}\n")
                tokens = vocab.encode(text)
            elif isinstance(body.get("prompt"), str):
                tokens = vocab.encode(body["prompt"])
            else:
                raise ProtocolError("prompt: Input should be a valid string", param="prompt")
        except ProtocolError as exc:
            return _error(exc.message, exc.type, exc.status, exc.param)
        return _json(
            {
                "count": len(tokens),
                "max_model_len": cfg.max_model_len,
                "tokens": tokens,
                "token_strs": [EOS if t == vocab.eos_id else vocab.token_text(t) for t in tokens]
                if token_strs
                else None,
            }
        )

    async def detokenize(request: Request) -> Response:
        # vLLM 0.32's DetokenizeRequest ({"tokens": [ids >= 0]}) -> DetokenizeResponse.
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise ProtocolError("request body must be a JSON object")
            check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or vocab.check_ids(tokens) is not None:
                raise ProtocolError(
                    "tokens must be a list of token ids in the vocabulary", param="tokens"
                )
        except ProtocolError as exc:
            return _error(exc.message, exc.type, exc.status, exc.param)
        return _json({"prompt": vocab.decode(tokens)})

    async def get_faults(request: Request) -> Response:
        if (denied := _check_admin(request, settings.admin_token)) is not None:
            return denied
        return _json(faults.model_dump())

    async def set_faults(request: Request) -> Response:
        if (denied := _check_admin(request, settings.admin_token)) is not None:
            return denied
        try:
            update = FaultUpdate.model_validate_json(await request.body() or b"{}")
        except ValidationError as exc:
            return _error(str(exc.errors()[0]["msg"]), "BadRequestError", 400)
        if update.crash_now:
            log.warning("fault injection: crashing now")
            os._exit(CRASH_EXIT_CODE)
        update.apply(faults)
        log.warning("fault injection: %s", faults.model_dump(exclude_defaults=True))
        return _json(faults.model_dump())

    async def clear_faults(request: Request) -> Response:
        if (denied := _check_admin(request, settings.admin_token)) is not None:
            return denied
        for name, value in FaultSettings().model_dump().items():
            setattr(faults, name, value)
        return _json(faults.model_dump())

    async def sim_state(request: Request) -> Response:
        if (denied := _check_admin(request, settings.admin_token)) is not None:
            return denied
        c = core()
        return _json(
            {
                "running": c.num_running,
                "waiting": c.num_waiting,
                "holds": sorted(c.holds),
                "free_blocks": c.allocator.num_free,
                "num_blocks": c.allocator.num_blocks,
                "generation": state.generation_id,
            }
        )

    async def reset_prefix_cache(request: Request) -> Response:
        # vLLM's (dev-mode) endpoint: refused while any block is in use.
        if not core().reset_prefix_cache():
            return _error(
                "Failed to reset prefix cache: blocks are in use", "ServiceUnavailable", 503
            )
        return Response(status_code=200)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        try:
            body = await read_json(request)
            check_model(body)
            if faults.fail_next > 0:
                faults.fail_next -= 1
                return _error("injected failure", "InternalServerError", faults.fail_status)
            params = parse_generation(body, vocab, chat, cfg.max_model_len)
        except ProtocolError as exc:
            if exc.in_stream:
                event = _sse(error_body(exc.message, exc.type, exc.status, exc.param))
                return Response(event + b"data: [DONE]\n\n", media_type="text/event-stream")
            return _error(exc.message, exc.type, exc.status, exc.param)
        base_id = (
            _REQUEST_ID_RE.sub("", request.headers.get("x-request-id", ""))[:128]
            or uuid.uuid4().hex
        )
        # One sequence per choice (vLLM fans n out into n child requests of the same prompt).
        sim_requests = [
            _new_request(core(), params, base_id, state.metrics, choice)
            for choice in range(params.surface.n)
        ]
        sim_request = sim_requests[0]
        if core().blocks_needed(sim_request) > cfg.num_blocks:
            return _error(
                "request needs more KV blocks than the engine has", "BadRequestError", 400
            )
        builder = ResponseBuilder(
            params,
            base_id,
            cfg.served_model_name,
            prompt_tokens_details=settings.prompt_tokens_details,
        )
        for each in sim_requests:
            core().submit(each)
        choices = _choice_states(params, sim_requests, builder, vocab, core())
        if params.stream:
            engine = core()

            def abort_all() -> None:
                # A client gone before the stream's first iteration never runs its finally.
                for each in sim_requests:
                    engine.abort(each)

            return DisconnectAwareStreamingResponse(
                _stream(engine, sim_requests, builder, choices, faults),
                media_type="text/event-stream",
                background=BackgroundTask(abort_all),
            )
        collect = asyncio.ensure_future(
            _collect(core(), sim_requests, builder, choices, vocab, faults)
        )
        disconnect = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            collect.cancel()
            for each in sim_requests:
                core().abort(each)
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return Response(status_code=499)
        disconnect.cancel()
        for each in sim_requests:
            core().abort(each)  # those an injected error cut short (finished ones: no-op)
        return collect.result()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/attestation", attestation, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/sim/faults", get_faults, methods=["GET"]),
        Route("/sim/faults", set_faults, methods=["POST"]),
        Route("/sim/faults", clear_faults, methods=["DELETE"]),
        Route("/sim/state", sim_state, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, tokens=settings.api_keys)
    app.state.sim = state
    return app


# The path prefixes vLLM's AuthenticationMiddleware guards (vllm/entrypoints/serve/middleware/
# authenticate.py, 0.32): /health, /metrics, /tokenize, /detokenize, /version stay open.
API_KEY_GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class ApiKeyMiddleware:
    """vLLM's ``--api-key`` check, as vLLM 0.32 does it: a request to a guarded path without
    ``Authorization: Bearer <one of the keys>`` gets 401 ``{"error": "Unauthorized"}`` (not
    the OpenAI error shape: vLLM's own answer); OPTIONS and other paths pass."""

    def __init__(self, app: ASGIApp, tokens: tuple[str, ...]) -> None:
        self.app = app
        self._hashes = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]

    def _allowed(self, headers: Headers) -> bool:
        scheme, _, param = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        # vLLM hashes the value after the first space as it is (no strip): so does this.
        digest = hashlib.sha256(param.encode("utf-8")).digest()
        matched = False
        for known in self._hashes:
            matched |= hmac.compare_digest(digest, known)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(API_KEY_GUARDED_PREFIXES) and not self._allowed(Headers(scope=scope)):
            await _json({"error": "Unauthorized"}, 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _check_admin(request: Request, token: str | None) -> Response | None:
    if not token:
        return _error(
            "admin endpoints are disabled (start the engine with --admin-token)",
            "PermissionDenied",
            403,
        )
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return _error("admin token required", "AuthenticationError", 401)
    return None


def _new_request(
    core: EngineCore,
    params: GenerationParams,
    base_id: str,
    metrics: EngineMetrics,
    choice: int = 0,
) -> SimRequest:
    kind = RequestKind.LOCAL
    remote = None
    kv = params.kv_transfer_params
    if isinstance(kv, dict) and kv.get("do_remote_decode") is True:
        kind = RequestKind.PRODUCER
    elif isinstance(kv, dict) and kv.get("do_remote_prefill"):
        remote, why = parse_kv_transfer_params(kv)
        if remote is None:
            # vLLM does not fail such a request: it prefills the prompt itself.
            log.warning(
                "request %s: unusable kv_transfer_params (%s); prefilling locally", base_id, why
            )
            metrics.get(metrics.local_prefill_fallbacks).inc()
        else:
            kind = RequestKind.CONSUMER
    elif kv is not None and not isinstance(kv, dict):
        log.warning("request %s: kv_transfer_params is not an object; ignored", base_id)
    remote_cached = kv.get("remote_prefill_cached_tokens") if remote is not None else None
    return SimRequest(
        request_id=core.new_request_id(base_id),
        cache_salt=params.cache_salt,
        remote_cached_tokens=remote_cached if isinstance(remote_cached, int) else None,
        prompt=params.prompt,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.surface.stop_token_ids,
        kind=kind,
        remote=remote,
        choice=choice,
        forced=None if params.surface.forced is None else list(params.surface.forced),
    )


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(
    request: SimRequest, faults: FaultSettings
) -> AsyncIterator[TokenEvent | ErrorEvent]:
    first = True
    while True:
        event = await request.events.get()
        if first and isinstance(event, TokenEvent) and faults.stall_first_token_s > 0:
            await asyncio.sleep(faults.stall_first_token_s)
        first = False
        yield event
        if isinstance(event, ErrorEvent) or event.finish_reason is not None:
            return


def _choice_states(
    params: GenerationParams,
    requests: list[SimRequest],
    builder: ResponseBuilder,
    vocab: Vocabulary,
    core: EngineCore,
) -> list[ChoiceState]:
    return [
        ChoiceState(
            i,
            params.chat,
            params.surface,
            vocab,
            core.generation,
            builder.response_id,
            min_tokens=params.min_tokens,
        )
        for i in range(len(requests))
    ]


async def _choice_events(
    requests: list[SimRequest], faults: FaultSettings
) -> AsyncIterator[tuple[int, TokenEvent | ErrorEvent]]:
    """Every choice's events, tagged with its index, as the engine's steps produce them."""
    if len(requests) == 1:
        async for event in _events(requests[0], faults):
            yield 0, event
        return
    merged: asyncio.Queue[tuple[int, TokenEvent | ErrorEvent | None]] = asyncio.Queue()

    async def pump(index: int, request: SimRequest) -> None:
        async for event in _events(request, faults):
            merged.put_nowait((index, event))
        merged.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        live = len(requests)
        while live:
            index, item = await merged.get()
            if item is None:
                live -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _injected_error(faults: FaultSettings, sent: int) -> bool:
    """Whether the token after the ``sent``-th is replaced by an error (error_after_tokens)."""
    return faults.error_after_tokens is not None and sent >= faults.error_after_tokens


# What vLLM 0.32 answers when generation fails mid-request (GenerationError: an output's
# finish_reason "error"): a 500, or in a stream an error event and then [DONE].
_GENERATION_ERROR = ErrorEvent("Internal server error")


async def _collect(
    core: EngineCore,
    requests: list[SimRequest],
    builder: ResponseBuilder,
    choices: list[ChoiceState],
    vocab: Vocabulary,
    faults: FaultSettings,
) -> Response:
    tokens: list[list[int]] = [[] for _ in requests]
    keys: list[list[bytes]] = [[] for _ in requests]
    finish: list[str | None] = [None] * len(requests)
    stop_reasons: list[str | int | None] = [None] * len(requests)
    # Choices a stop token id ended: its text is left out (include_stop_str_in_output aside).
    stop_tokens = [False] * len(requests)
    want_logprobs = builder.params.surface.logprobs is not None
    kv_transfer_params = None
    total = done = 0
    async for index, event in _choice_events(requests, faults):
        if finish[index] is not None:
            continue  # a choice a stop string ended: what its engine sent after it
        if isinstance(event, ErrorEvent):
            return _error(event.message, event.type, event.status)
        if _injected_error(faults, total):
            log.warning("fault injection: failing the request after %d tokens", total)
            return _error(
                _GENERATION_ERROR.message, _GENERATION_ERROR.type, _GENERATION_ERROR.status
            )
        tokens[index].append(event.token)
        if want_logprobs:
            keys[index].append(event.key)
        total += 1
        builder.cached_tokens = requests[0].reported_cached_tokens
        if faults.crash_after_tokens is not None and total >= faults.crash_after_tokens:
            os._exit(CRASH_EXIT_CODE)
        state = choices[index]
        if event.stop_token:
            stop_reasons[index] = event.token
            stop_tokens[index] = not state.options.include_stop_str_in_output
        elif state.stop is not None:
            stop_reasons[index] = state.stopped_by(event.token, event.finish_reason is not None)
            if stop_reasons[index] is not None and event.finish_reason is None:
                core.stop(requests[index])
        if event.finish_reason is not None or stop_reasons[index] is not None:
            finish[index] = "stop" if stop_reasons[index] is not None else event.finish_reason
            if index == 0:
                # The engine's, whatever the frontend's stop string made of the finish (as
                # vLLM's: a prefill leg the engine ended on length holds its KV either way).
                kv_transfer_params = event.kv_transfer_params
            done += 1
            if done == len(requests):
                break
    else:
        raise AssertionError("event stream ended without a finish")
    built = []
    logprobs = None
    for state, ids, id_keys, reason, stop_reason in zip(
        choices, tokens, keys, finish, stop_reasons, strict=True
    ):
        assert reason is not None
        if stop_tokens[state.index]:
            text = vocab.decode(ids[:-1])
        elif isinstance(stop_reason, str) and state.stop is not None:
            text = state.stop.text
        else:
            text = vocab.decode(ids)
        if state.options.logprobs is not None:
            logprobs = state.logprobs_for(ids, id_keys, 0)
        content, calls, reason = state.message(text, reason)
        built.append(
            builder.full_choice(
                state.index, text, ids, reason, logprobs, content, calls, stop_reason
            )
        )
    return _json(builder.full_choices(built, total, kv_transfer_params))


async def _stream(
    core: EngineCore,
    requests: list[SimRequest],
    builder: ResponseBuilder,
    choices: list[ChoiceState],
    faults: FaultSettings,
) -> AsyncIterator[bytes]:
    sent = done = 0
    params = builder.params
    opened = [False] * len(requests)  # whether the choice has sent a token chunk
    stopped = [False] * len(requests)  # a stop string ended the choice
    try:
        role_sent = not params.chat
        async for index, event in _choice_events(requests, faults):
            if stopped[index]:
                continue  # what its engine sent after the stop string
            if _injected_error(faults, sent):
                log.warning("fault injection: an error event after %d tokens", sent)
                event = _GENERATION_ERROR
            if isinstance(event, ErrorEvent):
                yield _sse(error_body(event.message, event.type, event.status))
                break
            if faults.drop_stream_after_tokens == 0:
                # After none: cut before the first token (the check below runs after a send).
                raise _DroppedStream("fault injection: dropping the connection before a token")
            if not role_sent:
                # vLLM sends the assistant role with its first output, not before it: one
                # chunk per choice.
                role_sent = True
                for i in range(len(requests)):
                    yield _sse(builder.role_chunk(i))
            sent += 1
            builder.cached_tokens = requests[0].reported_cached_tokens
            state = choices[index]
            step = state.step(event.token, event.finish_reason, event.key, event.stop_token)
            if step.skip and params.return_token_ids:
                # vLLM sends a token the tool parser holds back when the token ids are asked
                # for: an empty delta beside them.
                step = StepOutput("", step.finish_reason, step.logprobs, {})
            if not step.skip:
                yield _sse(
                    builder.token_chunk(
                        step.text,
                        [event.token],
                        step.finish_reason,
                        len(state.tokens),
                        index,
                        step.logprobs,
                        step.delta,
                        first=not opened[index],
                        stop_reason=step.stop_reason,
                    )
                )
                opened[index] = True
            if faults.crash_after_tokens is not None and sent >= faults.crash_after_tokens:
                await asyncio.sleep(0.05)  # let the chunk reach the client first
                os._exit(CRASH_EXIT_CODE)
            if (
                faults.drop_stream_after_tokens is not None
                and sent >= faults.drop_stream_after_tokens
            ):
                raise _DroppedStream("fault injection: dropping the connection mid-stream")
            if step.stop_reason is not None and event.finish_reason is None:
                stopped[index] = True
                core.stop(requests[index])
            if event.finish_reason is not None or step.stop_reason is not None:
                done += 1
                if done == len(requests):
                    if params.include_usage:
                        yield _sse(builder.usage_chunk(sent))
                    break  # a choice a stop string ended sends no more events
        yield b"data: [DONE]\n\n"
    finally:
        for request in requests:
            core.abort(request)

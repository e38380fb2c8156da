"""The fleet contract: one pydantic model per part of ``configs/fleet/*.json``.

Pure: no files, no sockets, no clock. The loader reads the document and hands the parsed
JSON here. Every model forbids unknown keys (a typo in a contract must fail loudly, not be
ignored) and is frozen (a loaded contract is shared by the router, scheduler and controller
and must not drift from the hash it was qualified under). Validation is strict: ``"8000"`` is
not a port and ``true`` is not a number, because the file is written by people and a silent
coercion would hide their mistake.

Field-level rules live on the fields; rules that relate several fields live in
``consistency_issues``, which ``FleetContract`` runs after its fields validate and which
reports every problem with its document path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "FLEET_SCHEMA",
    "Budgets",
    "ConsistencyIssue",
    "EngineDefaults",
    "EngineSpec",
    "FleetContract",
    "KVEventsEndpoint",
    "Loc",
    "LocalPrefill",
    "Migration",
    "ModelIdentity",
    "NixlSideChannel",
    "PrefillHedge",
    "PrefixCaching",
    "PrefixRouting",
    "ProfileStoreRef",
    "Role",
    "RoleControl",
    "RoutingPolicy",
    "SimulatedEngineSettings",
    "TransferPair",
    "consistency_issues",
    "format_loc",
]

FLEET_SCHEMA = "narwhal.fleet/v1"

Role = Literal["prefill", "decode"]

# A path into the document: keys and list indices, e.g. ("engines", 2, "roles", 0).
Loc = tuple[str | int, ...]

# Error type of every message this module words itself; the loader passes its text through.
CUSTOM_ERROR = "narwhal"
# Error type raised when the fields are individually fine but disagree with each other; its
# context carries the full list of ConsistencyIssue so the loader can report real paths.
CONSISTENCY_ERROR = "fleet_consistency"
# Error type for a kv_transfer_pairs value that is neither a string nor a list.
PAIRS_TYPE_ERROR = "pairs_type"

_SIDES: tuple[Role, Role] = ("prefill", "decode")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_ENGINE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def _error(message: str) -> PydanticCustomError:
    # Braces in user-supplied text would be read as template fields by pydantic; pass the
    # finished message through the context instead.
    return PydanticCustomError(CUSTOM_ERROR, "{message}", {"message": message})


def _check_sha256(value: str | None) -> str | None:
    if value is not None and not _SHA256_RE.fullmatch(value):
        raise _error(f"must be 64 lowercase hex digits (got {value!r})")
    return value


def _check_file_path(value: str | None) -> str | None:
    """A path field a tool opens: one the operating system can name (a NUL was a traceback
    where the file is read). Whether a ``~user`` exists is the loader's to find (it looks the
    user up)."""
    if value is not None and "\0" in value:
        raise _error("path must not contain a NUL character")
    return value


def _split_http_url(value: str) -> SplitResult:
    """Parse an http(s) URL that names a host; raise a worded error otherwise."""
    try:
        parts = urlsplit(value)
    except ValueError as exc:
        raise _error(f"is not a valid URL ({exc}) (got {value!r})") from None
    if any(c.isspace() for c in value):
        raise _error(f"URL must not contain whitespace (got {value!r})")
    if parts.scheme.lower() not in ("http", "https"):
        raise _error(f"URL scheme must be http or https (got {value!r})")
    if parts.username is not None or parts.password is not None:
        # Do not echo the value: it may carry a password.
        raise _error("URL must not carry credentials")
    if not parts.hostname:
        raise _error(f"URL has no host (got {value!r})")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise _error(f"URL port is not a number from 1 to 65535 (got {value!r})")
    return parts


# The longest duration any of the fleet's times may be: a day, as narwhal-serve's interval flags.
# A larger one is a typo or an exponent slip (``ttft_s: 1e308`` made the default prefill timeout
# infinite; ``roles.tick_s: 1e300`` a role controller that never ticks again).
MAX_DURATION_S = 86400.0
# The most attempts a leg may be given: each is a whole leg on another engine.
MAX_LEG_ATTEMPTS = 64


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=True,
        # Infinity and NaN are not JSON; a budget of inf would disable every check downstream.
        allow_inf_nan=False,
        # Dumps use the document's key names ("schema"), so a dump loads back as a contract.
        serialize_by_alias=True,
    )


class ModelIdentity(_Model):
    id: str = Field(min_length=1)
    revision: str = Field(min_length=1)
    config_sha256: str | None = None
    shard_manifest_sha256: str | None = None
    max_model_len: int = Field(gt=0)

    @field_validator("config_sha256", "shard_manifest_sha256")
    @classmethod
    def _sha256(cls, value: str | None) -> str | None:
        return _check_sha256(value)


class Budgets(_Model):
    ttft_s: float = Field(gt=0, le=MAX_DURATION_S)
    tpot_s: float = Field(gt=0, le=MAX_DURATION_S)
    attainment: float = Field(gt=0, le=1)


class PrefixCaching(_Model):
    """The engines' prefix cache (vLLM's ``--enable-prefix-caching``, on by default in vLLM),
    as the router indexes it: ``block_size`` is the engines' ``--block-size`` (the index keys a
    prompt's full blocks of it), ``capacity_blocks`` an engine's KV capacity in blocks (no
    engine's index entries exceed it), ``block_bytes`` the bytes of one block's KV on an
    engine (what a handoff moves per block: the attestation's ``kv_cache.block_bytes``;
    unset, the journal counts the blocks a handoff moved and not their bytes; a simulated
    engine's are its ``sim.block_bytes``)."""

    enabled: bool = True
    block_size: int = Field(default=16, gt=0)
    capacity_blocks: int = Field(default=65536, gt=0)
    block_bytes: int | None = Field(default=None, gt=0)


class EngineDefaults(_Model):
    first_token_timeout_s: float = Field(gt=0, le=MAX_DURATION_S)
    request_timeout_s: float = Field(default=600.0, gt=0, le=MAX_DURATION_S)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=MAX_DURATION_S)
    tp: int = Field(ge=1)
    accelerator: str = Field(min_length=1)
    gpu_arch: str = Field(min_length=1)
    kv_connector: Literal["NixlConnector"] = "NixlConnector"
    kv_role: Literal["kv_both"] = "kv_both"
    kv_buffer_device: str = Field(default="cuda", min_length=1)
    prefix_caching: PrefixCaching = Field(default_factory=PrefixCaching)
    # A file holding the engines' API key (vLLM's --api-key), sent by the router, narwhal-check
    # and narwhal-profile as "Authorization: Bearer <key>" on every engine request. A path,
    # relative to the fleet file, never the key itself: the fleet file is hashed, journaled
    # and shared, and a secret in it would travel with it. ``load_fleet`` reads it.
    api_key_file: str | None = Field(default=None, min_length=1)

    @field_validator("api_key_file")
    @classmethod
    def _api_key_file(cls, value: str | None) -> str | None:
        return _check_file_path(value)


class NixlSideChannel(_Model):
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class KVEventsEndpoint(_Model):
    """Where an engine publishes its KV cache events (vLLM's ``--kv-events-config`` with the
    zmq publisher): ``endpoint`` its PUB socket, ``replay_endpoint`` its ROUTER socket for
    missed batches, as ``tcp://host:port`` addresses the router connects to."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            zmq_connect_address(value)
        return value


# What vLLM's publisher binds to (its default ``tcp://*:5557``): addresses of no one engine.
_BIND_HOSTS = frozenset({"*", "0.0.0.0"})
_ZMQ_TCP_RE = re.compile(r"tcp://([^:/\s\[\]]+):(\d{1,5})")


def zmq_connect_address(value: str) -> tuple[str, int]:
    """``tcp://host:port`` as the router connects to an engine's event sockets: (host, port),
    or the error that says what is wrong with it."""
    if not value.startswith("tcp://"):
        raise _error(
            f"must be a tcp://HOST:PORT address of the engine's ZMQ socket (got {value!r})"
        )
    if value.startswith("tcp://["):
        raise _error(
            f"IPv6 addresses are not supported here: name the engine's host by a name or an "
            f"IPv4 address (got {value!r})"
        )
    match = _ZMQ_TCP_RE.fullmatch(value)
    if match is None:
        raise _error(f"must be tcp://HOST:PORT, a host and a port and nothing else (got {value!r})")
    host, port = match.group(1), int(match.group(2))
    if host in _BIND_HOSTS:
        raise _error(
            f"{host!r} is an address to bind to (vLLM's publisher binds tcp://*:PORT), not one "
            f"to connect to: name the engine's host, e.g. tcp://ENGINE_HOST:{port} "
            f"(got {value!r})"
        )
    # libzmq takes a port past 65535 modulo 65536: tcp://e1:99999 would reach port 34463.
    if not 1 <= port <= 65535:
        raise _error(f"port is not a number from 1 to 65535 (got {value!r})")
    return host, port


class SimulatedEngineSettings(_Model):
    """Knobs of the simulated engine. The timing knobs are a file format for the latency model
    (``narwhal.simengine.timing.sim_models`` converts them) and default to the simulator's
    calibration (``narwhal.simengine.timing.CALIBRATION``)."""

    time_scale: float = Field(default=1.0, gt=0)
    prefill_a: float = Field(default=0.02, ge=0)
    prefill_b: float = Field(default=1.0e-4, ge=0)
    prefill_c: float = Field(default=1.2e-9, ge=0)
    decode_intercept: float = Field(default=0.240, ge=0)
    decode_slope: float = Field(default=0.0015, ge=0)
    decode_ctx_coef: float = Field(default=1.3e-7, ge=0)
    block_size: int = Field(default=16, gt=0)
    num_blocks: int = Field(default=4096, gt=0)
    block_bytes: int = Field(default=16384, gt=0)
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=8192, gt=0)
    model_seed: int = 0
    vocab_seed: int = 0
    kv_lease_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    kv_read_timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    eos_prob: float = Field(default=0.0, ge=0, le=1)
    slowdown: float = Field(default=1.0, gt=0)
    # vLLM's --enable-prompt-tokens-details: usage reports prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False
    extra_args: list[str] = Field(default_factory=list)


class EngineSpec(_Model):
    id: str
    # Normalised to "scheme://host:port" (no trailing slash) so callers can append paths.
    url: str
    # Defaults to the URL's host (see _default_host); named separately because the host an
    # operator deploys to may differ from the address the router dials.
    host: str = Field(default="", min_length=1)
    roles: list[Role] = Field(min_length=1)
    initial_role: Role
    nixl: NixlSideChannel
    attestation_url: str | None = None
    # Filled by finalize-fleet once the engine's build is known; profiles are keyed on it.
    generation: str | None = None
    sim: SimulatedEngineSettings | None = None
    kv_events: KVEventsEndpoint | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_host(cls, data: object) -> object:
        if isinstance(data, dict) and "host" not in data and isinstance(data.get("url"), str):
            try:
                hostname = urlsplit(data["url"]).hostname
            except ValueError:
                hostname = None
            # An unparsable URL is reported on "url"; leave host to its placeholder default
            # rather than raise a second, derived complaint about it.
            if hostname:
                data = {**data, "host": hostname}
        return data

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        # Engine ids appear in metric labels, file names and NIXL engine names.
        if not _ENGINE_ID_RE.fullmatch(value):
            raise _error(
                f"{value!r} is not a valid engine id (1 to 63 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit)"
            )
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = _split_http_url(value)  # a port it names is a number from 1 to 65535
        port = parts.port
        if port is None:
            raise _error(f"URL must name a port (got {value!r})")
        if parts.path not in ("", "/"):
            raise _error(f"URL must not have a path (got {value!r})")
        if parts.query or parts.fragment or value.endswith(("?", "#")):
            raise _error(f"URL must not have a query or fragment (got {value!r})")
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        return f"{parts.scheme.lower()}://{host}:{port}"

    @field_validator("roles")
    @classmethod
    def _roles(cls, value: list[Role]) -> list[Role]:
        seen: set[str] = set()
        for role in value:
            if role in seen:
                raise _error(f"duplicate role {role!r}")
            seen.add(role)
        return value

    @field_validator("attestation_url")
    @classmethod
    def _attestation_url(cls, value: str | None) -> str | None:
        if value is not None:
            _split_http_url(value)
        return value

    def can(self, role: Role) -> bool:
        return role in self.roles


class TransferPair(_Model):
    prefill: str
    decode: str


def _pairs_tag(value: object) -> str | None:
    # Route "all" and lists to their own branch so a bad list reports its real element path
    # instead of pydantic's "did not match any member of the union" pair of complaints.
    if isinstance(value, str):
        return "all"
    if isinstance(value, list):
        return "pairs"
    return None


# The union tags that pydantic inserts into error paths after "kv_transfer_pairs"; the loader
# strips them so paths name document positions only.
PAIRS_UNION_TAGS = ("all", "pairs")

TransferPairs = Annotated[
    Annotated[Literal["all"], Tag("all")] | Annotated[list[TransferPair], Tag("pairs")],
    Discriminator(
        _pairs_tag,
        custom_error_type=PAIRS_TYPE_ERROR,
        custom_error_message="expected 'all' or a list of transfer pairs",
    ),
]


class RoleControl(_Model):
    enabled: bool = True
    min_prefill: int = Field(default=1, ge=0)
    min_decode: int = Field(default=1, ge=0)
    cooldown_s: float = Field(default=60.0, ge=0, le=MAX_DURATION_S)
    dwell_s: float = Field(default=120.0, ge=0, le=MAX_DURATION_S)
    tick_s: float = Field(default=5.0, gt=0, le=MAX_DURATION_S)


class LocalPrefill(_Model):
    """Let a decode engine prefill a short prompt itself instead of taking a KV handoff.

    Scheduler v1 only: for prompts of at most ``max_prompt_tokens`` it also weighs "the decode
    engine prefills it" against the best handoff pair, and takes it only when predicted faster
    with both budgets (its batch's TPOT, stalled by the prefill, included) still met. Off by
    default; a document that leaves it out hashes as before (hashes are of the document)."""

    enabled: bool = False
    max_prompt_tokens: int = Field(default=1024, ge=1)


class PrefixRouting(_Model):
    """Cache-aware routing (scheduler v1): score pairs with the prompt's prefix already cached
    on each engine, from the engines' KV events where they publish them and else from what the
    router sent them (entries of that kind live ``history_ttl_s``)."""

    enabled: bool = True
    history_ttl_s: float = Field(default=1800.0, gt=0, le=MAX_DURATION_S)


class Migration(_Model):
    """Continue a request whose decode leg broke after its first token (the engine died, answered
    an error, or stalled) on another pair, from the tokens the client already received: the
    prompt's token ids plus the generated ids go to a new prefill leg, the new stream is
    spliced into the client's. ``limit`` migrations per request (0: off); none once the
    sequence would exceed ``max_sequence_tokens`` (default: the model's max_model_len). A
    stream is stalled when no token arrived for ``stall_tpot_factor`` times its predicted time
    per output token (the budget's when there is no prediction), and never sooner than
    ``stall_floor_s``. On by default: an answer lost to one engine's failure costs the client
    more than a continuation costs the fleet."""

    limit: int = Field(default=2, ge=0)
    max_sequence_tokens: int | None = Field(default=None, ge=1)
    stall_tpot_factor: float = Field(default=20.0, gt=1)
    stall_floor_s: float = Field(default=2.0, gt=0, le=MAX_DURATION_S)


class PrefillHedge(_Model):
    """Hedge a prefill leg that runs past ``factor`` times its predicted queue wait plus
    prefill (never sooner than ``floor_s``; half the TTFT budget when there is no latency
    model, scheduler v0) on another prefill engine, while the TTFT budget can still be met; the
    first leg to answer wins and the other is cancelled. The slow leg
    counts against its engine's breaker, so a hung engine stops receiving work within a few
    predicted prefill times instead of the prefill timeout."""

    enabled: bool = True
    factor: float = Field(default=4.0, gt=1)
    floor_s: float = Field(default=0.5, gt=0, le=MAX_DURATION_S)


class RoutingPolicy(_Model):
    fallback: Literal["retry", "fail"] = "retry"
    max_prefill_attempts: int = Field(default=2, ge=1, le=MAX_LEG_ATTEMPTS)
    max_decode_attempts: int = Field(default=2, ge=1, le=MAX_LEG_ATTEMPTS)
    admission: Literal["reject", "queue"] = "reject"
    queue_max: int = Field(default=256, ge=0)
    queue_timeout_s: float = Field(default=5.0, ge=0, le=MAX_DURATION_S)
    local_prefill: LocalPrefill = Field(default_factory=LocalPrefill)
    prefix: PrefixRouting = Field(default_factory=PrefixRouting)
    migration: Migration = Field(default_factory=Migration)
    hedge: PrefillHedge = Field(default_factory=PrefillHedge)


class ProfileStoreRef(_Model):
    path: str = Field(min_length=1)
    sha256: str

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        _check_file_path(value)
        return value

    @field_validator("sha256")
    @classmethod
    def _sha256(cls, value: str) -> str:
        _check_sha256(value)
        return value


@dataclass(frozen=True)
class ConsistencyIssue:
    """A rule between fields that the document breaks, with the path it is reported at."""

    loc: Loc
    reason: str


class FleetContract(_Model):
    # "schema" is the document key; the attribute is renamed because BaseModel owns "schema".
    schema_version: Literal["narwhal.fleet/v1"] = Field(alias="schema")
    name: str = Field(min_length=1)
    model: ModelIdentity
    budgets: Budgets
    engine: EngineDefaults
    engines: list[EngineSpec] = Field(min_length=1)
    kv_transfer_pairs: TransferPairs = "all"
    roles: RoleControl = Field(default_factory=RoleControl)
    routing: RoutingPolicy = Field(default_factory=RoutingPolicy)
    profile_store: ProfileStoreRef | None = None

    @model_validator(mode="after")
    def _consistent(self) -> FleetContract:
        issues = consistency_issues(self)
        if issues:
            first = issues[0]
            raise PydanticCustomError(
                CONSISTENCY_ERROR,
                "{summary}",
                {"summary": f"{format_loc(first.loc)}: {first.reason}", "issues": issues},
            )
        return self

    # Lookups are cached: the scheduler asks is_permitted for every candidate pair on every
    # request, and a virtual-time fleet may hold thousands of engines.
    @cached_property
    def _engines_by_id(self) -> dict[str, EngineSpec]:
        return {e.id: e for e in self.engines}

    @cached_property
    def _listed_pairs(self) -> frozenset[tuple[str, str]]:
        if self.kv_transfer_pairs == "all":
            return frozenset()
        return frozenset((p.prefill, p.decode) for p in self.kv_transfer_pairs)

    # Not named engine(): that name is the engine-defaults field.
    def engine_by_id(self, engine_id: str) -> EngineSpec:
        """The engine with this id; KeyError if the fleet has none."""
        return self._engines_by_id[engine_id]

    def kv_block(self, engine_id: str) -> tuple[int, int | None]:
        """One KV block on the engine as a handoff moves it: (tokens, bytes), the bytes None
        where the fleet does not say them (a simulated engine's are its ``sim`` knobs)."""
        sim = self.engine_by_id(engine_id).sim
        if sim is not None:
            return sim.block_size, sim.block_bytes
        caching = self.engine.prefix_caching
        return caching.block_size, caching.block_bytes

    def prefill_capable(self) -> list[EngineSpec]:
        """Engines permitted to prefill, in document order."""
        return [e for e in self.engines if e.can("prefill")]

    def decode_capable(self) -> list[EngineSpec]:
        """Engines permitted to decode, in document order."""
        return [e for e in self.engines if e.can("decode")]

    def permitted_pairs(self) -> list[tuple[str, str]]:
        """Every (prefill id, decode id) the fleet allows, never an engine with itself."""
        if self.kv_transfer_pairs == "all":
            return [
                (p.id, d.id)
                for p in self.prefill_capable()
                for d in self.decode_capable()
                if p.id != d.id
            ]
        return [(p.prefill, p.decode) for p in self.kv_transfer_pairs if p.prefill != p.decode]

    def is_permitted(self, prefill_id: str, decode_id: str) -> bool:
        """Whether KV may move from ``prefill_id`` to ``decode_id`` (role capability included)."""
        if prefill_id == decode_id:
            return False
        p = self._engines_by_id.get(prefill_id)
        d = self._engines_by_id.get(decode_id)
        if p is None or d is None or not p.can("prefill") or not d.can("decode"):
            return False
        return self.kv_transfer_pairs == "all" or (prefill_id, decode_id) in self._listed_pairs


def format_loc(loc: Loc) -> str:
    """("engines", 2, "roles", 0) -> "engines[2].roles[0]"; () -> ""."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _count(n: int) -> str:
    return f"{n} engine" if n == 1 else f"{n} engines"


def _names(engines: Iterable[EngineSpec]) -> str:
    return ", ".join(e.id for e in engines) or "none"


def _kv_event_addresses(fleet: FleetContract, add: Callable[[Loc, str], None]) -> None:
    """Each KV event socket is one engine's and nothing else's: two engines naming one stream
    would each be credited with the other's blocks (the router predicting hits an engine does
    not hold), and an engine's HTTP or NIXL port is no event stream at all. Addresses are
    compared as written (a host by two names is not caught)."""
    taken: dict[tuple[str, int], str] = {}
    for eng in fleet.engines:
        parts = urlsplit(eng.url)
        if parts.hostname and parts.port:
            taken[(parts.hostname, parts.port)] = f"the HTTP address of engine {eng.id!r}"
        taken.setdefault(
            (eng.nixl.host, eng.nixl.port), f"the NIXL side channel of engine {eng.id!r}"
        )
    for i, eng in enumerate(fleet.engines):
        events = eng.kv_events
        if events is None:
            continue
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(events, name)
            if value is None:
                continue
            address = zmq_connect_address(value)
            other = taken.get(address)
            if other is not None:
                add(("engines", i, "kv_events", name), f"{value!r} is also {other}")
            else:
                taken[address] = f"the kv_events.{name} of engine {eng.id!r}"


def consistency_issues(fleet: FleetContract) -> list[ConsistencyIssue]:
    """Every rule between fields that ``fleet`` breaks, in document-section order."""
    issues: list[ConsistencyIssue] = []

    def add(loc: Loc, reason: str) -> None:
        issues.append(ConsistencyIssue(loc, reason))

    # Timeouts against budgets: a first-token deadline at or past the TTFT budget could never
    # rescue a request in time, so the fallback would be dead code.
    e = fleet.engine
    if e.first_token_timeout_s >= fleet.budgets.ttft_s:
        add(
            ("engine", "first_token_timeout_s"),
            f"{e.first_token_timeout_s!r} must be below budgets.ttft_s ({fleet.budgets.ttft_s!r})",
        )
    if e.request_timeout_s <= e.first_token_timeout_s:
        add(
            ("engine", "request_timeout_s"),
            f"{e.request_timeout_s!r} must be above engine.first_token_timeout_s "
            f"({e.first_token_timeout_s!r})",
        )

    # Engine identity: ids, URLs and NIXL side channels each name exactly one engine.
    ids: set[str] = set()
    urls: dict[str, str] = {}
    side_channels: dict[tuple[str, int], str] = {}
    for i, eng in enumerate(fleet.engines):
        if eng.id in ids:
            add(("engines", i, "id"), f"duplicate engine id {eng.id!r}")
        ids.add(eng.id)
        if eng.url in urls:
            add(("engines", i, "url"), f"duplicate URL {eng.url!r} (also engine {urls[eng.url]!r})")
        else:
            urls[eng.url] = eng.id
        if (
            eng.sim is not None
            and e.prefix_caching.enabled
            and eng.sim.block_size != e.prefix_caching.block_size
        ):
            add(
                ("engines", i, "sim", "block_size"),
                f"{eng.sim.block_size} differs from engine.prefix_caching.block_size "
                f"({e.prefix_caching.block_size}): the router's prefix index would match nothing",
            )
        if (
            eng.sim is not None
            and e.prefix_caching.block_bytes is not None
            and eng.sim.block_bytes != e.prefix_caching.block_bytes
        ):
            add(
                ("engines", i, "sim", "block_bytes"),
                f"{eng.sim.block_bytes} differs from engine.prefix_caching.block_bytes "
                f"({e.prefix_caching.block_bytes}): a handoff's bytes would be misreported",
            )
        channel = (eng.nixl.host, eng.nixl.port)
        if channel in side_channels:
            add(
                ("engines", i, "nixl"),
                f"duplicate NIXL side channel {eng.nixl.host}:{eng.nixl.port} "
                f"(also engine {side_channels[channel]!r})",
            )
        else:
            side_channels[channel] = eng.id
        if eng.initial_role not in eng.roles:
            add(
                ("engines", i, "initial_role"),
                f"{eng.initial_role!r} is not among its permitted roles ({', '.join(eng.roles)})",
            )

    # A NIXL side channel on an engine's HTTP port: one of the two cannot bind, and the engine
    # that starts second fails (compared as written, as the KV event addresses below).
    http: dict[tuple[str, int], str] = {}
    for eng in fleet.engines:
        parts = urlsplit(eng.url)
        if parts.hostname and parts.port:
            http[(parts.hostname, parts.port)] = eng.id
    for i, eng in enumerate(fleet.engines):
        owner = http.get((eng.nixl.host, eng.nixl.port))
        if owner is not None:
            add(
                ("engines", i, "nixl"),
                f"{eng.nixl.host}:{eng.nixl.port} is also the HTTP address of engine {owner!r}",
            )

    _kv_event_addresses(fleet, add)

    # Transfer pairs name known engines that can play the side they are on.
    by_id = {eng.id: eng for eng in fleet.engines}
    pair_errors = False
    if fleet.kv_transfer_pairs != "all":
        seen: set[tuple[str, str]] = set()
        for i, pair in enumerate(fleet.kv_transfer_pairs):
            before = len(issues)
            for side in _SIDES:
                engine_id = getattr(pair, side)
                named = by_id.get(engine_id)
                if named is None:
                    add(("kv_transfer_pairs", i, side), f"unknown engine {engine_id!r}")
                elif not named.can(side):
                    add(
                        ("kv_transfer_pairs", i, side),
                        f"engine {engine_id!r} cannot {side} "
                        f"(its permitted roles: {', '.join(named.roles)})",
                    )
            if pair.prefill == pair.decode:
                add(("kv_transfer_pairs", i), f"pair from engine {pair.prefill!r} to itself")
            key = (pair.prefill, pair.decode)
            if key in seen:
                add(("kv_transfer_pairs", i), f"duplicate pair {pair.prefill} -> {pair.decode}")
            seen.add(key)
            pair_errors = pair_errors or len(issues) > before
    if not pair_errors and not fleet.permitted_pairs():
        add(
            ("kv_transfer_pairs",),
            "no permitted pair: KV must be able to move from a prefill-capable engine "
            "to a different decode-capable engine",
        )

    # Role minimums. An engine that may play both roles counts toward either minimum but
    # cannot fill both at once, hence the sum check; the initial assignment must already
    # meet the floors the controller will defend.
    rc = fleet.roles
    prefill_capable = fleet.prefill_capable()
    decode_capable = fleet.decode_capable()
    for role, minimum, loc_key, capable in (
        ("prefill", rc.min_prefill, "min_prefill", prefill_capable),
        ("decode", rc.min_decode, "min_decode", decode_capable),
    ):
        if len(capable) < minimum:
            add(
                ("roles", loc_key),
                f"at least {_count(minimum)} must be {role}-capable, found {len(capable)} "
                f"({_names(capable)})",
            )
    floors_ok = len(prefill_capable) >= rc.min_prefill and len(decode_capable) >= rc.min_decode
    if rc.min_prefill + rc.min_decode > len(fleet.engines):
        floors_ok = False
        add(
            ("roles",),
            f"min_prefill + min_decode = {rc.min_prefill + rc.min_decode} exceeds the number "
            f"of engines ({len(fleet.engines)})",
        )
    # Only worth saying once the floors are reachable at all; otherwise it repeats the above.
    if floors_ok:
        for role, minimum, loc_key in (
            ("prefill", rc.min_prefill, "min_prefill"),
            ("decode", rc.min_decode, "min_decode"),
        ):
            starting = [eng for eng in fleet.engines if eng.initial_role == role]
            if len(starting) < minimum:
                add(
                    ("roles", loc_key),
                    f"at least {_count(minimum)} must start as {role} (initial_role), "
                    f"found {len(starting)} ({_names(starting)})",
                )

    # A local-prefill threshold beyond the model's context would read as "any prompt".
    lp = fleet.routing.local_prefill
    if lp.max_prompt_tokens > fleet.model.max_model_len:
        add(
            ("routing", "local_prefill", "max_prompt_tokens"),
            f"{lp.max_prompt_tokens!r} must not exceed model.max_model_len "
            f"({fleet.model.max_model_len!r})",
        )

    return issues

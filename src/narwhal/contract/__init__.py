"""The fleet contract: which engines serve which model under which budgets, and its hash;
and the check report, which says whether a fleet is qualified to serve.

Pure apart from ``load_fleet`` and ``load_report``, which read their files (through ``loader``).
See ``models`` for the fleet schema, ``hashing`` for the canonical form that names a fleet,
``loader`` for error wording, and ``check_report`` for the narwhal-check report format.
"""

from __future__ import annotations

from narwhal.contract.check_report import (
    GATE_NAMES,
    REPORT_SCHEMA,
    CheckReport,
    EngineIdentity,
    FileRef,
    FleetRef,
    GateName,
    GateReport,
    SkipInfo,
    SkipKind,
    load_report,
    qualification_problem,
)
from narwhal.contract.hashing import canonical_json, sha256_hex
from narwhal.contract.loader import (
    ContractError,
    LoadedFleet,
    load_fleet,
    parse_fleet,
    read_json_document,
    validate_document,
)
from narwhal.contract.models import (
    FLEET_SCHEMA,
    Budgets,
    ConsistencyIssue,
    EngineDefaults,
    EngineSpec,
    FleetContract,
    KVEventsEndpoint,
    LocalPrefill,
    ModelIdentity,
    NixlSideChannel,
    PrefixCaching,
    PrefixRouting,
    ProfileStoreRef,
    Role,
    RoleControl,
    RoutingPolicy,
    SimulatedEngineSettings,
    TransferPair,
    consistency_issues,
)

__all__ = [
    "FLEET_SCHEMA",
    "GATE_NAMES",
    "REPORT_SCHEMA",
    "Budgets",
    "CheckReport",
    "ConsistencyIssue",
    "ContractError",
    "EngineDefaults",
    "EngineIdentity",
    "EngineSpec",
    "FileRef",
    "FleetContract",
    "FleetRef",
    "GateName",
    "GateReport",
    "KVEventsEndpoint",
    "LoadedFleet",
    "LocalPrefill",
    "ModelIdentity",
    "NixlSideChannel",
    "PrefixCaching",
    "PrefixRouting",
    "ProfileStoreRef",
    "Role",
    "RoleControl",
    "RoutingPolicy",
    "SimulatedEngineSettings",
    "SkipInfo",
    "SkipKind",
    "TransferPair",
    "canonical_json",
    "consistency_issues",
    "load_fleet",
    "load_report",
    "parse_fleet",
    "qualification_problem",
    "read_json_document",
    "sha256_hex",
    "validate_document",
]

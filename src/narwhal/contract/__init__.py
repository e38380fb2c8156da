"""The fleet contract: which engines serve which model under which budgets, and its hash.

Pure apart from ``load_fleet``, which reads the file. See ``models`` for the schema,
``hashing`` for the canonical form that names a fleet, and ``loader`` for error wording.
"""

from __future__ import annotations

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
    LocalPrefill,
    ModelIdentity,
    NixlSideChannel,
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
    "Budgets",
    "ConsistencyIssue",
    "ContractError",
    "EngineDefaults",
    "EngineSpec",
    "FleetContract",
    "LoadedFleet",
    "LocalPrefill",
    "ModelIdentity",
    "NixlSideChannel",
    "ProfileStoreRef",
    "Role",
    "RoleControl",
    "RoutingPolicy",
    "SimulatedEngineSettings",
    "TransferPair",
    "canonical_json",
    "consistency_issues",
    "load_fleet",
    "parse_fleet",
    "read_json_document",
    "sha256_hex",
    "validate_document",
]

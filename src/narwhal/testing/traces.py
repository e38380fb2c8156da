"""Where the production traces the benchmarks replay are: not in the repository (their licences
ask for attribution kept with them, and they are tens of megabytes), but in a data directory
laid out as ``azure-llm-2023/`` (the Azure Public Dataset's AzureLLMInferenceTrace_code.csv and
_conv.csv) and ``mooncake-fast25/`` (the Mooncake FAST'25 conversation_trace.jsonl and
synthetic_trace.jsonl). ``$NARWHAL_DATA_DIR`` names it; by default it is ``shared/data`` beside
the checkout."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "trace_dir"]

DATA_DIR_ENV = "NARWHAL_DATA_DIR"


def trace_dir(name: str, checkout: Path) -> Path:
    """The folder of the traces ``name`` (``azure-llm-2023``, ``mooncake-fast25``) for the
    checkout at ``checkout``."""
    root = os.environ.get(DATA_DIR_ENV)
    return (Path(root) if root else checkout.parent / "shared" / "data") / name

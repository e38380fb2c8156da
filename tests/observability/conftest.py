"""The observability tools are scripts in tools/observability/ that import their siblings by
name; the tests import them the same way."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "observability"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

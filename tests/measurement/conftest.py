"""The measurement tools are scripts in tools/measurement/ that import their siblings by name;
the tests import them the same way."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "measurement"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

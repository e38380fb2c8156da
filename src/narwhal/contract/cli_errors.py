"""How a command line's bad argument is told: one line naming the problem, exit 2, as every
other input error of the tools is told (argparse would print its whole usage block first,
which pushes the one line that matters off a small terminal or a CI log's excerpt).

``--help`` still prints the usage in full.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``PROG: argument --flag: why``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")

"""One line for a YAML file that does not parse: where (line and column) and what PyYAML found,
the same from every deployment tool that reads YAML (launch plans, deployment files)."""

from __future__ import annotations

import yaml

__all__ = ["yaml_error_line"]


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """``invalid YAML at line L column C: <problem>`` (without a position when PyYAML gives
    none, e.g. a document nested too deeply)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["unreadable"])[0]
    return f"invalid YAML{where}: {problem}"

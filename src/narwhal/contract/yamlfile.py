"""YAML files people write (launch plans, deployment files, qualification run files), read as
strictly as the fleet's JSON: PyYAML's SafeLoader keeps the last of two equal keys without a
word (a setting silently overridden), takes a list as a key, and recurses without bound on a
deeply nested document. :func:`load_yaml` refuses each with a ``yaml.YAMLError`` that says
where, so that every caller's YAML error path words it."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["StrictYamlLoader", "load_yaml"]


class StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate and non-scalar mapping keys."""


def _construct_mapping(loader: StrictYamlLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        mark = key_node.start_mark
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value (line {mark.line + 1})", mark
            )
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {mark.line + 1})", mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


StrictYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def load_yaml(data: str | bytes, loader: type[StrictYamlLoader] = StrictYamlLoader) -> Any:
    """The document, or ``yaml.YAMLError`` (a document nested past Python's recursion limit
    included, as a YAMLError saying so)."""
    try:
        return yaml.load(data, Loader=loader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None

"""Names on the training side mapped to the generator's: a dict, a callable (None: not delivered), or none."""

from __future__ import annotations

from collections.abc import Callable, Mapping

NameMap = Mapping[str, str] | Callable[[str], str | None] | None


def mapped(name: str, name_map: NameMap) -> str | None:
    """`name` as the generator calls it; None where the map leaves it out."""
    if name_map is None:
        return name
    if callable(name_map):
        return name_map(name)
    return name_map.get(name, name)

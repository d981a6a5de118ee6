"""A part of the fleet prior built from what it declares (docs/design.md, "The flagship
algorithms, one idea per file").

A part is a frozen dataclass whose fields are the settings it reads and the parts it is built
from. :func:`declared` builds one by a single rule, so that a part's declared state is its
fields and nothing else, and the algorithm that holds it writes no list of arguments that
repeats the part's fields: each field is ``given`` (the basis, the parts it is built from),
else the algorithm's setting ``prefix + name`` (``DriftWalk.bins`` is ``drift_bins``), else
the setting ``name``; a field that is none of these is a KeyError naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

Part = TypeVar("Part")


def settings_of(algorithm: Any) -> dict[str, Any]:
    """An algorithm's settings: its dataclass fields by name."""
    return {f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)}


def declared(part: type[Part], settings: dict[str, Any], given: dict[str, Any], prefix="") -> Part:
    """``part`` built from what it declares (module doc)."""
    values = {}
    for field in dataclasses.fields(part):  # type: ignore[arg-type]
        name = field.name
        if name in given:
            values[name] = given[name]
        elif prefix + name in settings:
            values[name] = settings[prefix + name]
        else:
            values[name] = settings[name]
    return part(**values)

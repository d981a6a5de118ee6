"""Validated settings classes (pydantic): typed fields, ranges, one-line errors.

Each group of settings is defined once, in the layer that uses it (the simulator's
FleetSpec, the engine's EngineSettings); the configuration schema extends them.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

SCHEMA = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
# Typed scalars: no coercion ("3" is not a number, true is not 1), no NaN or infinity.
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Bool = Annotated[bool, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]
Name = Annotated[str, Field(strict=True, min_length=1, max_length=200)]
Seed = Annotated[int, Field(strict=True, ge=0, le=2**32 - 1)]
MAX_ROUNDS = 100_000  # 2 cores: ~1 round/s for the default fleet; more is a typo
MAX_CLIENTS = 100_000

_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_KINDS = {
    "int_type": "expected an integer",
    "float_type": "expected a finite number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true/false",
    "string_type": "expected a string",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
    "dict_type": "expected a table",
    "dataclass_type": "expected a table",
    "model_type": "expected an object",  # a run file's JSON part (core/runfiles.py)
}


def message(err: dict[str, Any]) -> str:
    """One pydantic error detail as a short phrase ending in ``got VALUE``."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    got = f", got {value!r}" if not isinstance(value, dict) else ""
    if kind in _KINDS:
        return _KINDS[kind] + got
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind]} {next(iter(ctx.values()))}{got}"
    if kind == "string_too_short":
        return f"must not be empty{got}"
    if kind == "too_short":
        return f"needs at least {ctx.get('min_length')} item(s){got}"
    if kind == "too_long":
        return f"takes at most {ctx.get('max_length')} item(s){got}"
    if kind == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    return f"{err['msg']}{got}"


def problem(err: ValidationError, known: list[str]) -> str:
    """``field: problem, got VALUE`` for the first error (and how many more there are).

    A validator across fields names its field as the start of its message
    (``"train_design: ..."``).
    """
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    msg = message(first)
    if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        msg = f"unknown field; known: {', '.join(known)}"
    elif first["type"] == "value_error" and ":" in msg:
        name, _, rest = msg.partition(":")
        loc, msg = [name], rest.strip()
    name = ".".join(loc[:1] + [f"[{p}]" if p.isdigit() else p for p in loc[1:]])
    more = len(err.errors()) - 1
    tail = f" (and {more} more problem(s))" if more else ""
    return f"{name.replace('.[', '[')}: {msg}{tail}".lstrip(": ")


def checked(cls: type | None = None, *, error: type[ValueError] = ValueError) -> Any:
    """``cls`` as a frozen pydantic dataclass whose constructor fails in one line.

    ``FleetSpec(num_lots=0)`` raises ``ValueError("FleetSpec num_lots: must be >= 1,
    got 0")`` (``@checked(error=E)``: an ``E``, a subclass of ValueError); validating a
    table through ``TypeAdapter(cls)`` (the configuration) keeps pydantic's structured
    errors.
    """
    if cls is None:
        return functools.partial(checked, error=error)
    cls = dataclass(frozen=True, config=SCHEMA)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as err:
            known = [f.name for f in fields(type(self))]
            raise error(f"{type(self).__name__} {problem(err, known)}") from None

    cls.__init__ = __init__
    return cls

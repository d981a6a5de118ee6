"""A fleet file's problems as one-line errors naming the file, the rows and the field
(:class:`FleetDataError`), and the listing of offending rows those messages share.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_LISTED = 5  # offending rows (or sensors) spelled out in a message


class FleetDataError(ValueError):
    """Bad input data.

    ``str()`` names the file, the row(s) and the field. Attributes: ``path``
    (the file as given), ``rows`` (all offending line numbers for CSV — header
    is line 1, first data row line 2 — or 0-based record numbers for Parquet;
    may be empty), ``field`` (the column concerned, or ``None``) and
    ``problem`` (the message without the file and field).
    """

    def __init__(
        self, path: str, problem: str, rows: Sequence[int] = (), field: str | None = None
    ) -> None:
        self.path = str(path)
        self.problem = problem
        self.rows = [int(r) for r in rows]
        self.field = field
        head = self.path if field is None else f"{self.path}, field '{field}'"
        super().__init__(f"{head}: {problem}")

    def __reduce__(self):
        return (type(self), (self.path, self.problem, self.rows, self.field))


class SensorSplitError(FleetDataError):
    """A sensor's rows lie in two row groups of a Parquet file: :func:`load_fleet_chunks`
    cannot read it (its checks per sensor need all the rows); :func:`load_fleet` can."""


def _listing(items: Sequence[tuple[int, str | None]], kind: str) -> str:
    """``line 5 ('abc'), line 9 (empty cell) and 3 more``."""
    shown = [f"{kind} {n}" + (f" ({d})" if d else "") for n, d in items[:MAX_LISTED]]
    text = ", ".join(shown)
    if len(items) > MAX_LISTED:
        text += f" and {len(items) - MAX_LISTED} more"
    return text


def _fmt(v: float) -> str:
    return repr(float(v))


def _raise_first(errors: list[FleetDataError], label: str) -> None:
    """One error for all the bad columns: the first in full, the others named."""
    if not errors:
        return
    first = errors[0]
    if len(errors) > 1:
        others = ", ".join(repr(e.field) for e in errors[1:])
        raise FleetDataError(
            label, f"{first.problem} (also bad values in {others})", first.rows, first.field
        )
    raise first

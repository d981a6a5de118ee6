"""A run's per-round history (``metrics.csv``) held as columns: one block of NumPy arrays per
evaluated round, not one dict per unit and round (issue 36.1).

A row as a dict weighed ~1.69 KB (22 columns), so 100,000 units × 50 evaluated rounds were
~8.5 GB of rows; a block holds each metric as one array in the dtype the engine computed it
in (float32 stays float32: its values are exact in the float64 the table is written in), the
units' indices and names once for every round (the same array objects), and a round's
number once. The rows read from it — :class:`History` is a sequence of dicts — are the ones
:func:`fedcal.engine.schedule.history_row` built (the same keys in the same order, the same
Python values), and :meth:`History.frame` is the DataFrame ``pd.DataFrame(rows)`` makes
(``metrics.csv`` byte-identical, tested).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np
import pandas as pd
import torch

from fedcal.core.tree import Tree

# numeric dtypes a block keeps as they are (others become float64 or Python objects)
_KEPT = (np.float32, np.float64, np.int64, np.int32, np.bool_)

Block = dict[str, np.ndarray]  # a round's columns, in the row's key order; 0-d: one value


def _value(column: np.ndarray, i: int) -> Any:
    """Row ``i``'s Python value (a 0-d column: its one value): what ``tolist()`` gives."""
    v = column[()] if column.ndim == 0 else column[i]
    return v.item() if isinstance(v, np.generic) else v


class History(Sequence[dict]):
    """The evaluated rounds' rows, block by block (a round's units in index order)."""

    def __init__(self, blocks: Sequence[Block] = ()) -> None:
        self._blocks: list[Block] = []
        self._ends: list[int] = []
        for block in blocks:
            self.add(block)

    @property
    def blocks(self) -> list[Block]:
        return list(self._blocks)

    def add(self, block: Mapping[str, np.ndarray]) -> None:
        """Append a round's columns (each (units,) or 0-d, units the same for all)."""
        block = {name: np.asarray(col) for name, col in block.items()}
        sizes = {len(col) for col in block.values() if col.ndim == 1}
        if len(sizes) > 1 or any(col.ndim > 1 for col in block.values()):
            raise ValueError(f"history block: columns of different lengths {sorted(sizes)}")
        rows = sizes.pop() if sizes else 0
        self._blocks.append(block)
        self._ends.append((self._ends[-1] if self._ends else 0) + rows)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> dict: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict]: ...

    def __getitem__(self, i: int | slice) -> dict | list[dict]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"history row {i} of {n}")
        b = int(np.searchsorted(self._ends, j, side="right"))
        start = self._ends[b - 1] if b else 0
        return {name: _value(col, j - start) for name, col in self._blocks[b].items()}

    def __iter__(self) -> Iterator[dict]:
        start = 0
        for block, end in zip(self._blocks, self._ends, strict=True):
            for i in range(end - start):
                yield {name: _value(col, i) for name, col in block.items()}
            start = end

    def frame(self) -> pd.DataFrame:
        """The rows as one DataFrame: ``pd.DataFrame(list(self))``'s columns, dtypes and
        values, built from the arrays (float32 columns as float64, as the rows' floats)."""
        parts = [_block_frame(block, end - start) for block, start, end in self._spans()]
        if not parts:
            return pd.DataFrame()
        if len(parts) == 1:
            return parts[0]
        return pd.concat(parts, ignore_index=True, sort=False)

    def _spans(self) -> Iterator[tuple[Block, int, int]]:
        start = 0
        for block, end in zip(self._blocks, self._ends, strict=True):
            yield block, start, end
            start = end

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping]) -> History:
        """The history of row dicts (a checkpoint written before the columns): consecutive
        rows of one round are a block; each column of Python floats float64, of ints int64,
        of bools bool, else objects (the values as they were)."""
        out = cls()
        start = 0
        for end in [*_round_breaks(rows), len(rows)]:
            if end > start:
                out.add(_columns_of(rows[start:end]))
            start = end
        return out

    def saved(self) -> tuple[Tree, dict]:
        """``(tensors, layout)`` for a checkpoint (:func:`restored` reads them back): numeric
        columns as tensors, the rest (names, statuses) as codes into their distinct values;
        a column shared by several blocks (the same array object) is saved once."""
        tensors: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}
        layout: list[list] = []
        for block in self._blocks:
            entries = []
            for name, col in block.items():
                key = seen.get(id(col))
                if key is None:
                    key = seen[id(col)] = f"c{len(seen)}"
                    _save_column(col, key, tensors, entries, name)
                else:
                    entries.append([name, "same", key])
            layout.append(entries)
        return tensors, {"format": "columns", "blocks": layout}

    @classmethod
    def restored(cls, tensors: Mapping[str, torch.Tensor], layout: Any) -> History:
        """The history :meth:`saved` wrote, or a list of row dicts (an older checkpoint)."""
        if isinstance(layout, list):
            return cls.from_rows(layout)
        if not isinstance(layout, dict) or layout.get("format") != "columns":
            raise ValueError("history: neither rows nor columns")
        columns: dict[str, np.ndarray] = {}
        out = cls()
        for entries in layout["blocks"]:
            block = {}
            for name, kind, key, *rest in entries:
                if kind == "same":
                    block[name] = columns[key]
                    continue
                columns[key] = block[name] = _load_column(kind, key, rest, tensors)
            out.add(block)
        return out


def as_frame(history: Sequence[Mapping]) -> pd.DataFrame:
    """A run's history as a DataFrame: a :class:`History`'s own, or rows' (a list)."""
    return history.frame() if isinstance(history, History) else pd.DataFrame(list(history))


def _block_frame(block: Block, rows: int) -> pd.DataFrame:
    data = {}
    for name, col in block.items():
        if col.ndim == 0:
            col = np.full(rows, col[()], dtype=col.dtype if col.dtype != object else object)
        if col.dtype == np.float32:
            col = col.astype(np.float64)
        if col.dtype == object:  # as pandas infers a column of these Python values
            col = pd.Series(list(col)).array if rows else col
        data[name] = col
    return pd.DataFrame(data, index=pd.RangeIndex(rows))


def _round_breaks(rows: Sequence[Mapping]) -> list[int]:
    return [i for i in range(1, len(rows)) if rows[i].get("round") != rows[i - 1].get("round")]


def _columns_of(rows: Sequence[Mapping]) -> Block:
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    nan = float("nan")
    block = {}
    for name in names:
        values = [row.get(name, nan) for row in rows]
        kinds = {type(v) for v in values}
        if kinds <= {float}:
            block[name] = np.array(values, dtype=np.float64)
        elif kinds <= {int}:
            block[name] = np.array(values, dtype=np.int64)
        elif kinds <= {bool}:
            block[name] = np.array(values, dtype=np.bool_)
        else:
            block[name] = _objects(values)
    return block


def _objects(values: Sequence) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def _save_column(
    col: np.ndarray, key: str, tensors: dict[str, torch.Tensor], entries: list, name: str
) -> None:
    if col.ndim == 0:
        value = col[()]
        entries.append(
            [name, "value", key, value.item() if isinstance(value, np.generic) else value]
        )
    elif col.dtype.type in _KEPT:
        tensors[key] = torch.from_numpy(np.ascontiguousarray(col))
        entries.append([name, "tensor", key])
    else:  # Python objects: codes into the distinct values, in order of appearance
        index: dict[Any, int] = {}
        codes = np.fromiter((index.setdefault(v, len(index)) for v in col), np.int64, len(col))
        tensors[key] = torch.from_numpy(codes)
        entries.append([name, "codes", key, list(index)])


def _load_column(
    kind: str, key: str, rest: list, tensors: Mapping[str, torch.Tensor]
) -> np.ndarray:
    if kind == "value":
        value = rest[0]
        return np.array(value, dtype=object if isinstance(value, str) else None)
    if kind == "tensor":
        return tensors[key].numpy()
    if kind == "codes":
        return _objects(rest[0])[tensors[key].numpy()]
    raise ValueError(f"history: unknown column kind {kind!r}")


def evaluation_block(
    index: np.ndarray,
    clients: np.ndarray,
    test: Mapping[str, torch.Tensor],
    train: Mapping[str, torch.Tensor],
    model_finite: torch.Tensor,
) -> Block:
    """Every unit's evaluation (:func:`fedcal.engine.schedule.result_row`) as columns:
    ``index`` and ``clients`` (the fleet's, shared by every round), ``test_*``/``train_*``
    (each metric in its float dtype), and ``status`` — diverged where the model or a test
    error is not finite (a declined interval's NaN is no error)."""
    from fedcal.engine.schedule import INTERVAL_METRICS
    from fedcal.status import Status

    block: Block = {"client_index": index, "client": clients}
    block.update({f"test_{k}": _floats(v) for k, v in test.items()})
    block.update({f"train_{k}": _floats(v) for k, v in train.items()})
    ok = model_finite.detach().cpu().numpy().astype(bool)
    for k in test:
        if k not in INTERVAL_METRICS:
            ok = ok & np.isfinite(block[f"test_{k}"])
    names = _objects([str(Status.OK), str(Status.DIVERGED)])
    block["status"] = names[(~ok).astype(np.intp)]
    return block


def round_block(
    evaluation: Block,
    round_number: int,
    rejected_rounds: np.ndarray,
    metrics: Mapping[str, torch.Tensor],
    ids: Sequence[int],
) -> Block:
    """A round's history block (:func:`fedcal.engine.schedule.history_row` of every unit):
    its ``evaluation`` columns, the round (1-based), the rounds each unit's reply was
    rejected so far, and the round's client ``metrics`` of the cohort ``ids`` (NaN for a
    unit that sat the round out)."""
    n = len(evaluation["client_index"])
    block = {**evaluation, "round": np.array(round_number, dtype=np.int64)}
    block["rejected_rounds"] = rejected_rounds
    block.update({name: _trained(v, ids, n) for name, v in metrics.items()})
    return block


def block_rows(block: Block) -> list[dict]:
    """One block's rows (e.g. the final table's)."""
    return list(History([block]))


def _floats(v: torch.Tensor) -> np.ndarray:
    """A metric as ``float(v[i])`` reads it: float32/float64 as they are, else float64."""
    v = v.detach().cpu()
    if v.dtype not in (torch.float32, torch.float64):
        v = v.to(torch.float64)
    return v.numpy()


def _trained(v: torch.Tensor, ids: Sequence[int], n: int) -> np.ndarray:
    """The cohort's values of a client metric over all ``n`` units, NaN for the others."""
    v = v.detach().cpu()
    everyone = len(ids) == n
    if v.is_floating_point():
        values = _floats(v)
        if everyone:
            return values
        out = np.full(n, np.nan)
        out[np.asarray(ids, dtype=np.intp)] = values
        return out
    if everyone:  # as tolist() reads them: bools, or Python ints (int64 in a table)
        return v.numpy() if v.dtype == torch.bool else v.to(torch.int64).numpy()
    out = _objects([float("nan")] * n)
    for j, value in zip(ids, v.tolist(), strict=True):
        out[j] = value
    return out

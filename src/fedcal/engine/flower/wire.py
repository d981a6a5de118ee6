"""The wire format: trees, configurations and site messages ↔ Flower records, exactly.

A tree (nested ``dict`` of tensors, see :mod:`fedcal.core.tree`) travels as
one ``ArrayRecord`` whose keys are the flattened paths (``"model/l0.weight"``)
and whose values are NumPy arrays serialized by ``np.save``: dtype, shape and
every bit of every value survive the trip, so float64 runs stay exact. Key
order is kept, because tree functions iterate in key order.

Small structured values (the algorithm's specification, the scaler) travel as JSON
strings inside a ``ConfigRecord``; per-client metrics as ``MetricRecord``.

A site serves many sensors in one message. Its reply holds one *part* per
sensor — the records an honest one-sensor reply would hold (``info``,
``reply``, ``train``, ``eval``) — stacked over the sensors of the same
structure (:func:`join_parts` / :func:`split_parts`: a handful of records per
message, not hundreds). The server splits them again and checks and uses each
sensor's part on its own: one sensor's malformed part costs that sensor its
round, not the site's other sensors theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fedcal.engine.flower.kinds import CONTROL as CONTROL  # re-exported

if TYPE_CHECKING:  # Flower and torch are imported lazily (ClientApp start-up time)
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    from fedcal.core.tree import Tree

SEP = "/"  # the separator of fedcal.core.tree.flatten
PART = ":"  # "<client index>:<record name>": one sensor's records in a site message
GROUP = "*"  # "*<group>:<record name>": the records of a group of sensors, stacked
GROUPS = "groups"  # ConfigRecord: group → its sensors' client indices (in stacking order)


def tree_to_record(tree: Mapping) -> ArrayRecord:
    """A tree (server tree, or a client tree of one client) as an ``ArrayRecord``."""
    from flwr.app import Array, ArrayRecord

    from fedcal.core.tree import flatten

    arrays = {}
    for name, tensor in flatten(tree).items():
        # Expanded client trees are stride-0 views: copy to a C-ordered array
        # (np.array keeps 0-d shapes, np.ascontiguousarray would make them 1-d).
        arrays[name] = Array(np.array(tensor.detach().cpu().numpy(), order="C"))
    return ArrayRecord(arrays)


def to_numpy(array: Any) -> np.ndarray:
    """A Flower ``Array`` as NumPy: what ``array.numpy()`` returns, without its cost.

    ``Array.numpy()`` is ``np.load`` on the ``.npy`` bytes, whose header is parsed
    with ``ast.literal_eval``: ~1.7 ms per array, i.e. seconds per round for a
    server receiving a thousand sensors' parts. When the header says exactly what
    the Array's own ``dtype`` and ``shape`` say (C order, no objects) and the
    payload has the size they imply, the values are read in place (read-only
    view); anything else goes through ``np.load`` — the same result either way.
    """
    data, dtype, shape = array.data, None, None
    with contextlib.suppress(TypeError, ValueError):
        dtype, shape = np.dtype(array.dtype), tuple(int(n) for n in array.shape)
    if (
        dtype is None
        or dtype.hasobject
        or array.stype != "numpy.ndarray"
        or data[:6] != b"\x93NUMPY"
        or data[6] not in (1, 2, 3)
    ):
        return array.numpy()
    width = 2 if data[6] == 1 else 4
    start = 8 + width + int.from_bytes(data[8 : 8 + width], "little")
    header = data[8 + width : start]
    expected = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': {shape!r}, }}"
    count = int(np.prod(shape, dtype=np.int64))
    if header.rstrip() != expected.encode() or len(data) - start != count * dtype.itemsize:
        return array.numpy()
    return np.frombuffer(data, dtype, count, offset=start).reshape(shape)


def record_to_tree(record: ArrayRecord) -> Tree:
    """Inverse of :func:`tree_to_record` (fresh tensors, same dtypes and key order)."""
    import torch

    from fedcal.core.tree import unflatten

    flat = {name: torch.from_numpy(to_numpy(array).copy()) for name, array in record.items()}
    return unflatten(flat)


def client_row(tree: Mapping, index: int = 0) -> Tree:
    """Row ``index`` of a client tree (the one client of a cohort of one)."""
    from fedcal.core.tree import tree_map

    return tree_map(lambda t: t[index], tree)


def metrics_to_record(metrics: Mapping[str, Any]) -> MetricRecord:
    """``{name: float or (1,) tensor}`` → ``MetricRecord`` of Python floats."""
    from flwr.app import MetricRecord

    out: dict[str, float] = {}
    for name, value in metrics.items():
        if hasattr(value, "reshape"):
            value = value.reshape(-1)
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} has {value.numel()} values, expected 1")
            value = value.item()
        out[name] = float(value)
    return MetricRecord(out)


def _signature(part: Mapping) -> tuple | None:
    """What must agree for parts to be stacked into one group (None: not stackable)."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    sig: list = []
    for name, record in part.items():
        if isinstance(record, ArrayRecord):
            arrays = tuple((k, a.stype, a.dtype, tuple(a.shape)) for k, a in record.items())
            if any(a[1] != "numpy.ndarray" for a in arrays):
                return None
            sig.append((name, "arrays", arrays))
        elif isinstance(record, ConfigRecord | MetricRecord):
            kinds = tuple((k, type(v)) for k, v in record.items())
            if any(kind in (list, bytes) for _, kind in kinds):
                return None
            sig.append((name, type(record).__name__, kinds))
        else:
            return None
    return tuple(sig)


def join_parts(parts: Mapping[int, Mapping], common: Mapping[str, Any] | None = None):
    """One site message out of per-sensor parts (keyed by client index) and common records.

    A part is a ``RecordDict`` or a plain dict of records. Parts of the same
    structure (record names, array keys/dtypes/shapes, metric names) travel as
    one *group*: each array stacked over the group's sensors, each config or
    metric value a list. Flower moves every record and array as an object of
    its own (one request each), so a site of hundreds of sensors must not send
    hundreds of records. A part that fits no group travels on its own under
    ``"<client index>:<record name>"``.
    """
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    flat = dict(common or {})
    groups: dict[tuple, list[int]] = {}
    for index, part in parts.items():
        sig = _signature(part)
        if sig is None:
            for name, record in part.items():
                flat[f"{int(index)}{PART}{name}"] = record
        else:
            groups.setdefault(sig, []).append(int(index))
    members = {}
    for g, (sig, indices) in enumerate(groups.items()):
        members[str(g)] = indices
        for name, kind, _ in sig:
            records = [parts[i][name] for i in indices]
            if kind == "arrays":
                keys = list(records[0].keys())
                stacked = {k: Array(np.stack([to_numpy(r[k]) for r in records])) for k in keys}
                flat[f"{GROUP}{g}{PART}{name}"] = ArrayRecord(stacked)
            else:
                cls = ConfigRecord if kind == "ConfigRecord" else MetricRecord
                keys = list(records[0].keys())
                flat[f"{GROUP}{g}{PART}{name}"] = cls({k: [r[k] for r in records] for k in keys})
    if members:
        flat[GROUPS] = ConfigRecord(members)
    return RecordDict(flat)


def _ungroup(content: RecordDict, members: Mapping, bad: list[str]) -> dict[int, dict]:
    """The per-sensor parts of the stacked groups of a site message (see :func:`join_parts`)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

    parts: dict[int, dict] = {}
    for g, indices in members.items():
        if not isinstance(indices, list) or not all(isinstance(i, int) for i in indices):
            bad.append(f"{GROUPS}[{g}]")
            continue
        n = len(indices)
        prefix = f"{GROUP}{g}{PART}"
        for key, record in content.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            try:
                if isinstance(record, ArrayRecord):
                    arrays = {k: to_numpy(a) for k, a in record.items()}
                    if any(a.ndim == 0 or a.shape[0] != n for a in arrays.values()):
                        raise ValueError("arrays not stacked over the group")
                    rows = [
                        ArrayRecord({k: Array(np.array(a[j])) for k, a in arrays.items()})
                        for j in range(n)
                    ]
                elif isinstance(record, ConfigRecord | MetricRecord):
                    if any(not isinstance(v, list) or len(v) != n for v in record.values()):
                        raise ValueError("values not listed over the group")
                    cls = type(record)
                    rows = [cls({k: v[j] for k, v in record.items()}) for j in range(n)]
                else:
                    raise ValueError(f"a {type(record).__name__}")
            except Exception:  # a malformed group must not end the run: the caller decides
                bad.append(key)
                continue
            for i, row in zip(indices, rows, strict=True):
                parts.setdefault(i, {})[name] = row
    return parts


def split_parts(content: RecordDict) -> tuple[dict[int, RecordDict], dict[str, Any], list[str]]:
    """Inverse of :func:`join_parts`: ``(parts by client index, common records, bad keys)``.

    A key that is neither a plain record name, ``"<int>:<name>"`` nor a record
    of a listed group, a group whose records are not stacked over its members,
    or a sensor that appears twice, is returned in ``bad keys`` (the caller
    decides what a malformed message costs).
    """
    from flwr.app import ConfigRecord, RecordDict

    parts: dict[int, dict] = {}
    common: dict[str, Any] = {}
    bad: list[str] = []
    members = content[GROUPS] if GROUPS in content else ConfigRecord()
    if not isinstance(members, ConfigRecord):
        bad.append(GROUPS)
        members = ConfigRecord()
    grouped = _ungroup(content, members, bad)
    listed = {f"{GROUP}{g}{PART}" for g in members}
    seen = [i for ix in members.values() if isinstance(ix, list) for i in ix]
    if len(seen) != len(set(seen)):
        bad.append(GROUPS)
    for key, record in content.items():
        if key == GROUPS:
            continue
        if key.startswith(GROUP):
            if not any(key.startswith(p) for p in listed):
                bad.append(key)
            continue
        if PART not in key:
            common[key] = record
            continue
        head, name = key.split(PART, 1)
        if not head.isdigit() or not name or int(head) in grouped:
            bad.append(key)
            continue
        parts.setdefault(int(head), {})[name] = record
    parts.update(grouped)
    return {i: RecordDict(p) for i, p in parts.items()}, common, bad

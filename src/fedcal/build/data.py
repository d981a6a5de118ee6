"""A run's data from its configuration: the simulator's fleet or a file (whole, or a
Parquet file by row groups as a :class:`FleetOutline`), the fleets of the design and
fleet-seed sweeps, its warnings, the valid ranges of its inputs, and the engine's chunk
size chosen from its size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedcal.config import ConfigError, RunConfig
from fedcal.data.fleet import SPLIT_COLUMN, Fleet
from fedcal.data.ranges import valid_ranges  # torch-free (re-exported: fedcal.build)


def load_data(config: RunConfig) -> Fleet:
    """The fleet named by the configuration: a file, or the embedded simulator."""
    d = config.data
    if d.path == "builtin:digits":
        from fedcal.data.digits import digits_fleet

        return digits_fleet(seed=config.fleet.seed)
    if d.path == "builtin:humidity":
        from fedcal.data.humidity import HumiditySpec, humidity_fleet

        return humidity_fleet(HumiditySpec(num_units=config.fleet.num_sensors), config.fleet.seed)
    if d.path:
        return load_configured(config, d.path)
    from fedcal.data.simulator import simulate_fleet

    return simulate_fleet(config.fleet.spec(), seed=config.fleet.seed)


def fleet_variants(config: RunConfig, fleet: Fleet) -> list[tuple[dict[str, Any], Fleet]]:
    """The fleets of a run: ``fleet`` alone, or one per (fleet seed, design) of the sweeps.

    ``[run] fleet_seeds`` / ``designs`` (or ``--fleet-seeds`` / ``--designs``)
    regenerate the fleet with ``[fleet] seed`` / ``train_design`` set to each
    value; each variant is labelled by the swept fields only (they become
    summary columns ``fleet_seed`` / ``design``).
    """
    if not config.designs and not config.fleet_seeds:
        return [({}, fleet)]
    path = config.data.path
    if config.designs and path:
        raise ConfigError(
            f"[run] designs sweep the simulator's chamber designs; [data] path is {path!r}"
        )
    if config.fleet_seeds and path and not path.startswith("builtin:"):
        raise ConfigError(
            f"[run] fleet_seeds regenerate a built-in fleet; [data] path is the file {path!r}"
        )
    out = []
    for fleet_seed in config.fleet_seeds or (config.fleet.seed,):
        for design in config.designs or (config.fleet.train_design,):
            f = dataclasses.replace(config.fleet, seed=fleet_seed, train_design=design)
            labels: dict[str, Any] = {}
            if config.designs:
                labels["design"] = design
            if config.fleet_seeds:
                labels["fleet_seed"] = fleet_seed
            out.append((labels, load_data(dataclasses.replace(config, fleet=f))))
    return out


def _loader_options(config: RunConfig) -> dict[str, Any]:
    """What ``[data]`` tells the loader (columns, split, guards): the same for a whole file
    (``load_fleet``) and its row groups (``load_fleet_chunks``)."""
    d = config.data
    return {
        "features": d.features,
        "target": d.target,
        "client_column": d.client_column,
        "split_column": d.split_column,
        "test_fraction": d.test_fraction,
        "seed": d.split_seed,
        "physical_bounds": d.loader_bounds(),
        "time_column": d.time_column or None,
        "split_by": d.split_by,
    }


def load_configured(config: RunConfig, source) -> Fleet:
    """A fleet file or DataFrame ``source`` read as ``[data]`` says (columns, split, guards)."""
    from fedcal.data.loader import load_fleet

    return load_fleet(source, **_loader_options(config))


@dataclasses.dataclass(frozen=True)
class FleetOutline:
    """What a run reads of a fleet besides its tensors, gathered row group by row group
    (issue 25.1: ``fedcal run`` on a Parquet file of 100,000 units without its whole
    frame). Each field equals what the run computes from :class:`Fleet`'s frame:
    ``content_digest`` :meth:`Fleet.content_digest`, ``full_scale`` the target's
    max − min, ``valid_ranges`` and ``input_range`` the train rows' spans per sensor and
    over the fleet, ``roles`` :attr:`Fleet.roles` (tested equal, file run both ways)."""

    tensors: Any  # engine FleetTensors, built by prepare_chunks
    features: tuple[str, ...]
    target: str
    client_column: str
    meta: dict
    roles: dict[str, str] | None
    full_scale: float
    valid_ranges: dict[str, Any]
    input_range: dict[str, list[float]]
    digest: str

    @property
    def num_clients(self) -> int:
        return len(self.tensors.client_ids)

    def content_digest(self) -> str:
        return self.digest


class _Gather:
    """The outline's pieces of each row group, summed as the groups go by: the digest's
    bytes per column (:meth:`Fleet.content_digest` hashes column after column, so each
    column's bytes are kept until the end, ~40 bytes a row: in a temporary file beyond
    16 MB a column, not in memory), the target's extremes, the train rows' spans per
    sensor, the roles."""

    SPILL = 16 * 1024**2

    def __init__(self) -> None:
        self.pieces: dict[str, tempfile.SpooledTemporaryFile] = {}
        self.low, self.high = np.inf, -np.inf
        self.valid: dict[str, Any] = {}
        self.roles: dict[str, str] | None = None
        self.meta: dict | None = None
        self.names: tuple = ((), "", "")

    def add(self, part: Fleet) -> None:
        columns = [part.client_column, *part.features, part.target, SPLIT_COLUMN]
        for col in columns:
            values = part.frame[col]
            if col in (*part.features, part.target):
                piece = values.to_numpy(dtype="float64").tobytes()
            else:  # the "\x1f"-joined text of the whole column, a chunk at a time
                sep = "\x1f" if col in self.pieces else ""
                piece = (sep + "\x1f".join(map(str, values.tolist()))).encode(
                    "utf-8", "surrogatepass"
                )
            if col not in self.pieces:  # closed by digest() (or deleted when collected)
                spill = tempfile.SpooledTemporaryFile(max_size=self.SPILL)  # noqa: SIM115
                self.pieces[col] = spill
            self.pieces[col].write(piece)
        target = part.frame[part.target].to_numpy(float)
        self.low, self.high = min(self.low, target.min()), max(self.high, target.max())
        self.valid.update(valid_ranges(part))  # a sensor lies in one row group
        roles = part.roles
        if roles is not None:
            self.roles = {**(self.roles or {}), **roles}
        if self.meta is None:
            self.meta, self.names = part.meta, (part.features, part.target, part.client_column)

    def digest(self, columns: list[str]) -> str:
        h = hashlib.sha256(json.dumps(columns).encode())
        for col in columns:
            if col in self.pieces:
                with self.pieces.pop(col) as f:
                    f.seek(0)
                    while block := f.read(1024**2):
                        h.update(block)
            h.update(b"\x1e")
        return h.hexdigest()


def load_outline(config: RunConfig, path: str) -> FleetOutline:
    """The fleet outline of the Parquet file ``path`` read as ``[data]`` says: its tensors by
    ``prepare_chunks`` of ``load_fleet_chunks`` (the same numbers as ``prepare`` of
    ``load_fleet``, to the bit) and the rest gathered from the same row groups. Raises
    ``SensorSplitError`` for a file whose sensor spans two row groups (read it whole),
    ``FleetDataError`` for bad data and ``ConfigError`` for a scaling the data refuse."""
    from fedcal.data.loader import FleetDataError, load_fleet_chunks
    from fedcal.engine.simulation import prepare_chunks

    d = config.data
    gather = _Gather()
    calls = 0

    def parts():
        nonlocal calls
        calls += 1
        chunks = load_fleet_chunks(path, **_loader_options(config))
        if calls > 1:  # prepare_chunks' second pass: the first one gathers
            return chunks
        return (gather.add(c) or c for c in chunks)

    try:
        tensors = prepare_chunks(parts, d.scaling, config.engine.dtype)
    except FleetDataError:
        raise
    except ValueError as err:  # as validate_methods words prepare's refusal
        raise ConfigError(f"[data] scaling: {err}") from None
    meta = gather.meta or {}
    part_features, part_target, client = gather.names
    columns = [client, *part_features, part_target, SPLIT_COLUMN]
    valid = gather.valid
    input_range = {
        c: [min(v[c][0] for v in valid.values()), max(v[c][1] for v in valid.values())]
        for c in part_features
    }
    return FleetOutline(
        tensors,
        part_features,
        part_target,
        client,
        meta,
        gather.roles,
        float(gather.high - gather.low),
        valid,
        input_range,
        gather.digest(columns),
    )


def _with_warnings(fleet: Fleet) -> tuple[Fleet, str]:
    """The fleet and its loader's warnings (repeated rows, an undeclared time column), one
    line each (issue 34.5)."""
    return fleet, "\n".join(fleet.meta.get("warnings", ()))


def load_run_data(
    config: RunConfig, train_points: Sequence[int] = (0,)
) -> tuple[Fleet | FleetOutline, str]:
    """The fleet of ``fedcal run``/``compare`` and a one-line note (empty if none): a Parquet
    file read by row groups (:func:`load_outline`) when nothing needs its frame (no
    calibration-point budget, no sweep), else :func:`load_data`; a file whose sensor spans
    two row groups is read whole, with a note saying so."""
    from fedcal.data.loader import PARQUET_SUFFIXES, SensorSplitError

    path = config.data.path
    frame_needed = any(train_points) or config.designs or config.fleet_seeds
    if not path or path.startswith("builtin:") or frame_needed:
        return _with_warnings(load_data(config))
    if not path.lower().endswith(PARQUET_SUFFIXES):
        return _with_warnings(load_data(config))
    try:
        return load_outline(config, path), ""
    except SensorSplitError as err:
        return load_data(config), f"{err.problem.split(':')[0]}: read whole (one frame)"


# Rows (train + test, padded) of the clients run at once when ``fedcal run`` chooses the
# chunk size: a chunk's designs of 64 float64 terms then take ~230 MB. At 444 rows a unit
# (the simulator's campaign, 384 + 60) it is 1,000 units a chunk, the fastest of 250-5,000
# measured at 10,000 units (docs/benchmarks.md).
AUTO_CHUNK_ROWS = 450_000


def auto_chunk_size(num_units: int, rows_per_unit: int) -> int:
    """Units a chunk for a fleet of ``num_units`` of ``rows_per_unit`` rows each: 0 (all at
    once) when the whole fleet's rows fit :data:`AUTO_CHUNK_ROWS`, else that many rows' worth
    of units, rounded down to a hundred when at least 100 units fit, else as many as fit (at
    least 1)."""
    rows_per_unit = max(int(rows_per_unit), 1)
    if num_units * rows_per_unit <= AUTO_CHUNK_ROWS:
        return 0
    size = AUTO_CHUNK_ROWS // rows_per_unit
    return max(100, size // 100 * 100) if size >= 100 else max(size, 1)


def with_auto_chunk(config: RunConfig, fleet: Fleet | FleetOutline) -> tuple[RunConfig, str]:
    """``config`` with ``[engine] chunk_size`` chosen by :func:`auto_chunk_size` from the
    fleet's units and rows a unit, and a one-line note saying so (empty: unchanged). Only
    when ``chunk_size`` is 0 (the default: all at once); a chunk size the user chose
    is kept — the CLI calls this only when neither ``--chunk-size`` nor the user's config
    file sets one, so an explicit 0 stays all at once. The value used is the run's:
    config.json records it. Rows a unit are the padded rows the engine holds: the largest
    train count plus the largest test count of any unit."""
    from fedcal.config import override

    if config.engine.chunk_size != 0:
        return config, ""
    n = fleet.num_clients
    if isinstance(fleet, FleetOutline):  # padded rows: what the engine's tensors hold
        rows = int(fleet.tensors.train.x.shape[1]) + int(fleet.tensors.test.x.shape[1])
    else:  # the engine pads every unit to the largest train and the largest test count
        per = fleet.frame.groupby([fleet.client_column, "split"], observed=True).size()
        rows = int(per.groupby(level="split", observed=True).max().sum()) if len(per) else 0
    size = auto_chunk_size(n, rows)
    if size == 0:
        return config, ""
    note = (
        f"chunk size {size} units ({n} units × {rows} rows a unit; "
        "--chunk-size N to choose, --chunk-size 0 for all at once)"
    )
    return override(config, {"engine": {"chunk_size": size}}, "chunk size"), note

"""One data file per site (a lab, a customer, a production line) for the SuperNode serving it.

A site file (``<site>.npz``, NumPy only: no pickle) holds the raw train and
test rows of each of its sensors exactly as
:meth:`fedcal.data.fleet.Fleet.arrays` gives them (float64), concatenated in
site order with per-sensor row counts, plus a JSON header: site id, sensor
ids, their client indices (positions in the fleet, which fix their seeds),
fleet size, feature and target names; and, when the fleet has a ``direction``
column, each row's sweep sign (+1 up, −1 down: :meth:`Fleet.branch_signs`) in
``b_train`` / ``b_test``, which the ClientApp passes on as ``ClientData.branch``
(fedprior's ``branch_orders``); when the fleet has a time column, each row's time
(float64, :meth:`Fleet.row_times`) in ``t_train`` / ``t_test``, which the ClientApp
passes on as ``ClientData.time`` (fedprior_drift's walk). The SuperNode is started with
``--node-config`` naming the file, the site id and the state directory (see
:func:`node_config`); the site id is checked against the header.

Which sensor belongs to which site comes from a mapping (sensor id → site,
:func:`read_site_map` reads it from a CSV file); without one, every sensor is
its own site.

Scaling: every column with a physical range is scaled without any data, so
the barometric default needs nothing from the clients. Other columns use
federated statistics; then each sensor's (n, Σx, Σx²) goes to the server in
the handshake and :func:`scaler_from_moments` adds them in client-index order,
reproducing :func:`fedcal.data.scaling.fit_scaler` bit for bit. Without secure
aggregation the server sees each sensor's sums (hence its mean): only
requested when a column needs them (:func:`needs_moments`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedcal.core.atomic import write_with
from fedcal.core.paths import mapped_name
from fedcal.data.scaling import client_moments
from fedcal.engine.flower.protocol import check_socket_path

if TYPE_CHECKING:
    from fedcal.data.fleet import Fleet

FORMAT = "fedcal-site/1"

Rows = tuple[np.ndarray, np.ndarray]  # (x (n, features), y (n, targets)), raw float64


@dataclass(frozen=True)
class SiteData:
    """One site's sensors: identities and raw rows, as read from its site file."""

    site_id: str
    sensor_ids: tuple[str, ...]
    client_indices: tuple[int, ...]
    num_clients: int
    features: tuple[str, ...]
    target: str
    classification: bool
    train: tuple[Rows, ...]  # per sensor, site order
    test: tuple[Rows, ...]
    num_classes: int = 0  # a classification fleet's (what build_task needs); 0: regression
    # per sensor, each row's sweep sign (+1 up, −1 down); None without a direction column
    train_branch: tuple[np.ndarray, ...] | None = None
    test_branch: tuple[np.ndarray, ...] | None = None
    # per sensor, each row's time (float64); None without a time column
    train_time: tuple[np.ndarray, ...] | None = None
    test_time: tuple[np.ndarray, ...] | None = None

    @cached_property
    def num_train(self) -> tuple[int, ...]:
        return tuple(len(x) for x, _ in self.train)

    def moments(self, k: int) -> dict[str, np.ndarray]:
        """(n, Σx, Σx², Σy, Σy²) of sensor ``k``'s raw train rows: all it shares for scaling."""
        x, y = self.train[k]
        return client_moments(x, y)


def safe_name(name: str) -> str:
    """A site id as a file-name stem (:func:`fedcal.core.paths.mapped_name`)."""
    return mapped_name(name)


def read_site_map(path: str | Path, client_column: str = "sensor_id") -> dict[str, str]:
    """Sensor id → site from a CSV file with columns ``<client_column>`` and ``site``."""
    import pandas as pd

    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    missing = [c for c in (client_column, "site") if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
    out: dict[str, str] = {}
    for row, (sensor, site) in enumerate(zip(frame[client_column], frame["site"], strict=True)):
        line = row + 2  # 1-based, after the header
        if not sensor or not site:
            raise ValueError(f"{path}, row {line}: empty {client_column} or site")
        if out.get(sensor, site) != site:
            raise ValueError(
                f"{path}, row {line}: sensor {sensor!r} in sites {out[sensor]!r} and {site!r}"
            )
        out[sensor] = site
    return out


def prepare_site_files(
    fleet: Fleet, out_dir: str | Path, sites: Mapping[str, str] | None = None
) -> list[tuple[str, tuple[str, ...], Path]]:
    """Write one site file per site of ``fleet`` into ``out_dir``.

    ``sites`` maps each sensor id to its site (None: one site per sensor, named
    after it). Returns ``(site id, its sensor ids, path)`` in order of each
    site's first sensor; files are written atomically.
    """
    ids = [str(c) for c in fleet.client_ids]
    if sites is None:
        sites = {s: s for s in ids}
    unmapped = [s for s in ids if s not in sites]
    if unmapped:
        shown = ", ".join(unmapped[:5]) + (" …" if len(unmapped) > 5 else "")
        raise ValueError(f"no site for sensor(s) {shown}: every sensor needs a site")
    members: dict[str, list[int]] = {}
    for index, sensor in enumerate(ids):
        members.setdefault(str(sites[sensor]), []).append(index)
    names = [safe_name(s) for s in members]
    if len(set(names)) != len(names):
        raise ValueError("site ids collide once made file-name safe; rename the sites")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = fleet.arrays("train"), fleet.arrays("test")
    branch = {split: fleet.branch_signs(split) for split in ("train", "test")}
    times = {split: fleet.row_times(split) for split in ("train", "test")}
    written = []
    for (site, indices), name in zip(members.items(), names, strict=True):
        header = {
            "format": FORMAT,
            "site_id": site,
            "sensor_ids": [ids[i] for i in indices],
            "client_indices": indices,
            "num_clients": len(ids),
            "features": list(fleet.features),
            "target": fleet.target,
            "classification": fleet.meta.get("task") == "classification",
            "num_classes": int(fleet.meta.get("num_classes", 0)),  # 0: regression
        }
        arrays = {"header": np.asarray(json.dumps(header))}
        for split, rows in (("train", train), ("test", test)):
            arrays[f"x_{split}"] = np.concatenate([rows[i][0] for i in indices])
            arrays[f"y_{split}"] = np.concatenate([rows[i][1] for i in indices])
            arrays[f"{split}_counts"] = np.asarray([len(rows[i][0]) for i in indices], np.int64)
            if branch[split] is not None:
                arrays[f"b_{split}"] = np.concatenate([branch[split][i] for i in indices])
            if times[split] is not None:
                arrays[f"t_{split}"] = np.concatenate([times[split][i] for i in indices])
        path = out / f"{name}.npz"
        write_with(path, lambda tmp, arrays=arrays: _savez(tmp, arrays))
        written.append((site, tuple(header["sensor_ids"]), path))
    return written


def _savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "xb") as fh:  # a file object: np.savez would append ".npz" to a name
        np.savez(fh, **arrays)


def _split(x: np.ndarray, y: np.ndarray, counts: np.ndarray) -> tuple[Rows, ...]:
    x.setflags(write=False)  # shared by every message of a warm worker: nobody may write
    y.setflags(write=False)
    cut = np.cumsum(counts)[:-1]
    return tuple(zip(np.split(x, cut), np.split(y, cut), strict=True))


def _split_branch(f, split: str, rows: tuple[Rows, ...], path) -> tuple[np.ndarray, ...] | None:
    """Each sensor's sweep signs of one split, or None when the file carries none."""
    if f"b_{split}" not in f.files:
        return None
    signs = f[f"b_{split}"]
    if signs.shape != (sum(len(x) for x, _ in rows),) or not np.isin(signs, (-1.0, 1.0)).all():
        raise ValueError(f"{path}: b_{split} must be one sign (+1 up, -1 down) per {split} row")
    return tuple(np.split(signs, np.cumsum([len(x) for x, _ in rows])[:-1]))


def _split_time(f, split: str, rows: tuple[Rows, ...], path) -> tuple[np.ndarray, ...] | None:
    """Each sensor's row times of one split (float64), or None when the file carries none."""
    if f"t_{split}" not in f.files:
        return None
    t = np.asarray(f[f"t_{split}"], dtype=np.float64)
    if t.shape != (sum(len(x) for x, _ in rows),) or not np.isfinite(t).all():
        raise ValueError(f"{path}: t_{split} must be one finite time per {split} row")
    return tuple(np.split(t, np.cumsum([len(x) for x, _ in rows])[:-1]))


def load_site_file(path: str | Path) -> SiteData:
    """Read a site file written by :func:`prepare_site_files`."""
    with np.load(Path(path), allow_pickle=False) as f:
        header = json.loads(str(f["header"]))
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: not a fedcal site file (format {header.get('format')!r})")
        train = _split(f["x_train"], f["y_train"], f["train_counts"])
        test = _split(f["x_test"], f["y_test"], f["test_counts"])
        return SiteData(
            site_id=str(header["site_id"]),
            sensor_ids=tuple(map(str, header["sensor_ids"])),
            client_indices=tuple(int(i) for i in header["client_indices"]),
            num_clients=int(header["num_clients"]),
            features=tuple(header["features"]),
            target=header["target"],
            classification=bool(header["classification"]),
            train=train,
            test=test,
            num_classes=int(header.get("num_classes", 0)),
            train_branch=_split_branch(f, "train", train, path),
            test_branch=_split_branch(f, "test", test, path),
            train_time=_split_time(f, "train", train, path),
            test_time=_split_time(f, "test", test, path),
        )


def node_config(
    data_path: str | Path,
    site_id: str,
    state_dir: str | Path,
    allow_methods: str | None = None,
    allow_uploads: str | None = None,
    worker_socket: str | Path | None = None,
) -> str:
    """The ``flower-supernode --node-config`` value for one site.

    Flower parses it as TOML key=value pairs; strings are written as TOML
    literal strings (single quotes: no escapes, so any path without a quote works).
    ``allow_methods`` / ``allow_uploads``: the node's sharing policy
    (:mod:`fedcal.engine.flower.policy`); None leaves the default.
    ``worker_socket``: the Unix socket of the site's warm worker
    (:mod:`fedcal.engine.flower.worker`; start it with the same node config).
    """
    values = {
        "data-path": str(Path(data_path).resolve()),
        "site-id": site_id,
        "state-dir": str(Path(state_dir).resolve()),
    }
    if allow_methods is not None:
        values["allow-methods"] = allow_methods
    if allow_uploads is not None:
        values["allow-uploads"] = allow_uploads
    if worker_socket is not None:
        values["worker-socket"] = str(Path(worker_socket).resolve())
        check_socket_path(values["worker-socket"])
    for key, value in values.items():
        if "'" in value or "\n" in value:
            raise ValueError(f"node config {key}={value!r}: quotes and newlines are not allowed")
    return " ".join(f"{k}='{v}'" for k, v in values.items())


_SITE_CACHE: dict[str, tuple[tuple[int, int, int], SiteData]] = {}


def _cached_site_file(path: str) -> SiteData:
    """:func:`load_site_file`, read again only when the file changed (size, mtime, inode).

    A ClientApp process reads a site file once anyway; a warm site worker
    (:mod:`~fedcal.engine.flower.worker`) keeps the parsed rows between messages.
    """
    st = Path(path).stat()
    key = (st.st_size, st.st_mtime_ns, st.st_ino)
    hit = _SITE_CACHE.get(path)
    if hit is None or hit[0] != key:
        hit = (key, load_site_file(path))
        _SITE_CACHE[path] = hit
    return hit[1]


def load_for_node(node_cfg: Mapping) -> SiteData:
    """The site's data, checked against the site id its node config declares."""
    missing = [k for k in ("data-path", "site-id", "state-dir") if k not in node_cfg]
    if missing:
        raise KeyError(
            f"SuperNode started without {', '.join(missing)} in --node-config; start it with "
            "--node-config \"data-path='...' site-id='...' state-dir='...'\""
        )
    site = _cached_site_file(str(node_cfg["data-path"]))
    if site.site_id != str(node_cfg["site-id"]):
        raise ValueError(
            f"node config says site {node_cfg['site-id']!r}, "
            f"but {node_cfg['data-path']} holds site {site.site_id!r}"
        )
    return site

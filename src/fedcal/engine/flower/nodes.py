"""One data file per sensor, for the SuperNode that holds it, and the scaler's statistics.

A node file (``<sensor>.npz``, NumPy only: no pickle) holds one sensor's raw
train and test rows exactly as :meth:`fedcal.data.fleet.Fleet.arrays` gives
them (float64), plus a JSON header: sensor id, client index (its position in
the fleet, which fixes its seeds), fleet size, feature and target names. The
SuperNode is started with ``--node-config`` naming the file, the sensor id and
the client index (see :func:`node_config`); they are checked against the header.

Scaling: every column with a physical range is scaled without any data, so
the barometric default needs nothing from the clients. Other columns use
federated statistics; then each client sends its (n, Σx, Σx²) in the
handshake and :func:`scaler_from_moments` adds them in client-index order,
reproducing :func:`fedcal.data.scaling.fit_scaler` bit for bit. Without secure
aggregation the server sees each client's sums (hence its mean): only
requested when a column needs them (:func:`needs_moments`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedcal.core.atomic import write_with
from fedcal.data.scaling import client_moments

if TYPE_CHECKING:
    from fedcal.data.fleet import Fleet

FORMAT = "fedcal-node/1"


@dataclass(frozen=True)
class NodeData:
    """One sensor's raw rows and identity, as read from its node file."""

    sensor_id: str
    client_index: int
    num_clients: int
    features: tuple[str, ...]
    target: str
    classification: bool
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_train(self) -> int:
        return len(self.x_train)

    def moments(self) -> dict[str, np.ndarray]:
        """(n, Σx, Σx², Σy, Σy²) of the raw train rows: all this node shares for scaling."""
        return client_moments(self.x_train, self.y_train)


def _safe_name(sensor_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in sensor_id)


def prepare_node_files(fleet: Fleet, out_dir: str | Path) -> list[tuple[str, Path]]:
    """Write one node file per sensor of ``fleet`` into ``out_dir``; return (sensor id, path).

    Files are written atomically. The order of the list is the client index.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = fleet.arrays("train"), fleet.arrays("test")
    ids = [str(c) for c in fleet.client_ids]
    names = [_safe_name(s) for s in ids]
    if len(set(names)) != len(names):
        raise ValueError("sensor ids collide once made file-name safe; rename the sensors")
    written = []
    for index, (sensor, name) in enumerate(zip(ids, names, strict=True)):
        header = {
            "format": FORMAT,
            "sensor_id": sensor,
            "client_index": index,
            "num_clients": len(ids),
            "features": list(fleet.features),
            "target": fleet.target,
            "classification": fleet.meta.get("task") == "classification",
        }
        path = out / f"{name}.npz"
        (x_tr, y_tr), (x_te, y_te) = train[index], test[index]
        arrays = {
            "header": np.asarray(json.dumps(header)),
            "x_train": x_tr,
            "y_train": y_tr,
            "x_test": x_te,
            "y_test": y_te,
        }
        write_with(path, lambda tmp, arrays=arrays: _savez(tmp, arrays))
        written.append((sensor, path))
    return written


def _savez(path: Path, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "xb") as fh:  # a file object: np.savez would append ".npz" to a name
        np.savez(fh, **arrays)


def load_node_file(path: str | Path) -> NodeData:
    """Read a node file written by :func:`prepare_node_files`."""
    with np.load(Path(path), allow_pickle=False) as f:
        header = json.loads(str(f["header"]))
        if header.get("format") != FORMAT:
            raise ValueError(f"{path}: not a fedcal node file (format {header.get('format')!r})")
        return NodeData(
            sensor_id=header["sensor_id"],
            client_index=int(header["client_index"]),
            num_clients=int(header["num_clients"]),
            features=tuple(header["features"]),
            target=header["target"],
            classification=bool(header["classification"]),
            x_train=f["x_train"],
            y_train=f["y_train"],
            x_test=f["x_test"],
            y_test=f["y_test"],
        )


def node_config(
    data_path: str | Path,
    sensor_id: str,
    client_index: int,
    state_dir: str | Path,
    allow_methods: str | None = None,
    allow_uploads: str | None = None,
) -> str:
    """The ``flower-supernode --node-config`` value for one sensor.

    Flower parses it as TOML key=value pairs; strings are written as TOML
    literal strings (single quotes: no escapes, so any path without a quote works).
    ``allow_methods`` / ``allow_uploads``: the node's sharing policy
    (:mod:`fedcal.engine.flower.policy`); None leaves the default.
    """
    values = {
        "data-path": str(Path(data_path).resolve()),
        "sensor-id": sensor_id,
        "state-dir": str(Path(state_dir).resolve()),
    }
    if allow_methods is not None:
        values["allow-methods"] = allow_methods
    if allow_uploads is not None:
        values["allow-uploads"] = allow_uploads
    for key, value in values.items():
        if "'" in value or "\n" in value:
            raise ValueError(f"node config {key}={value!r}: quotes and newlines are not allowed")
    quoted = " ".join(f"{k}='{v}'" for k, v in values.items())
    return f"{quoted} client-index={int(client_index)}"


def load_for_node(node_cfg: Mapping) -> NodeData:
    """The node's data, checked against the identity its node config declares."""
    missing = [k for k in ("data-path", "sensor-id", "client-index") if k not in node_cfg]
    if missing:
        raise KeyError(
            f"SuperNode started without {', '.join(missing)} in --node-config; start it with "
            '--node-config \'data-path="..." sensor-id="..." client-index=N state-dir="..."\''
        )
    node = load_node_file(str(node_cfg["data-path"]))
    if node.sensor_id != str(node_cfg["sensor-id"]) or node.client_index != int(
        node_cfg["client-index"]
    ):
        raise ValueError(
            f"node config says sensor {node_cfg['sensor-id']!r} index {node_cfg['client-index']}, "
            f"but {node_cfg['data-path']} holds sensor {node.sensor_id!r} index {node.client_index}"
        )
    return node

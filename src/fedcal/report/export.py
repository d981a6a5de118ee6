"""Use and ship the calibrated models of a run: predictions for new readings, firmware export.

A run directory keeps, per (method, seed), ``model.safetensors``: every sensor's
personalized parameters, the input/target scaling and the model settings.
:func:`load_models` turns it back into a callable calibration; :func:`to_c_header`
writes a dependency-free C header for MLP models (float32, one weight set per
sensor and a small ``fedcal_calibrate`` routine); :func:`to_json` writes the
same numbers for any other toolchain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedcal.config import ConfigError, from_json
from fedcal.core.algorithm import Algorithm
from fedcal.core.tree import Tree, stack
from fedcal.data.scaling import Scaler


@dataclass(frozen=True)
class CalibratedFleet:
    """The personalized models of one run, ready to calibrate raw readings."""

    algorithm: Algorithm
    params: dict[str, Tree]  # sensor id → parameters (server-tree shapes)
    scaler: Scaler
    features: tuple[str, ...]
    target: str
    model: dict
    sensor_column: str = "sensor_id"  # the run's column of sensor ids ([data] client_column)

    def predict(self, sensor: str, x_raw: np.ndarray) -> np.ndarray:
        """Calibrated target values for raw readings ``x_raw`` (rows, features) of ``sensor``."""
        return self.predict_with_std(sensor, x_raw)[0]

    def predict_with_std(
        self, sensor: str, x_raw: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(calibrated values, predictive σ or None) in the target's unit, rows × 1 each.

        σ is the method's own (``algorithm.predictive_std``, e.g. fedprior's posterior
        and noise); None for a method without one.
        """
        if sensor not in self.params:
            raise KeyError(
                f"sensor {sensor!r} is not in this run; known: {', '.join(sorted(self.params))}"
            )
        params = stack([self.params[sensor]])
        dtype = next(iter(params.values())).dtype
        x = torch.as_tensor(self.scaler.x(np.asarray(x_raw, float)), dtype=dtype).unsqueeze(0)
        with torch.no_grad():
            y = self.algorithm.predict(params, x)[0].double().numpy()
            std = self.algorithm.predictive_std(params, x)
        scale = np.asarray(self.scaler.y_scale, float)
        sd = None if std is None else std[0].double().numpy() * np.abs(scale)
        return self.scaler.y_inverse(y), sd

    def predict_rows(self, frame, sensor_column: str | None = None):
        """(mean, σ or None): one value per row of ``frame`` (its sensor column, features).

        The one prediction path of ``fedcal predict`` and ``fedcal.api.CalibratedUnits.predict``.
        """
        column = sensor_column or self.sensor_column
        mean = np.full(len(frame), np.nan)
        sd: np.ndarray | None = np.full(len(frame), np.nan)
        x_all = frame[list(self.features)].to_numpy(float)
        for sensor, rows in frame.groupby(column, sort=False).indices.items():
            m, s = self.predict_with_std(str(sensor), x_all[rows])
            mean[rows] = m[:, 0]
            if s is None:
                sd = None
            elif sd is not None:
                sd[rows] = s[:, 0]
        return mean, sd


def choose_method(run_dir: str | Path, method: str | None) -> str:
    """``method``, or the run's only method; several and none named: a one-line error.

    The run's methods are those of its ``config.json`` (``[run] methods``).
    """
    if method:
        return method
    path = Path(run_dir) / "config.json"
    try:
        methods = list(json.loads(path.read_text())["run"]["methods"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a readable fedcal run configuration ({e})") from None
    if len(methods) == 1:
        return methods[0]
    raise ValueError(
        f"{run_dir} has {len(methods)} methods; choose one with --method: {', '.join(methods)}"
    )


def load_models(
    run_dir: str | Path, method: str, seed: int = 0, train_points: int = 0
) -> CalibratedFleet:
    """Read ``runs/<method>_tp<N>_seed<S>/model.safetensors`` of a run directory.

    Tensors and JSON only: the model is rebuilt from the run's ``config.json``
    (nothing is unpickled, so a planted file cannot run code). A damaged or
    foreign file is a ``ValueError`` naming it.
    """
    from fedcal.build import build_recorded
    from fedcal.experiment import MODEL_FILE, load_model_file

    run_dir = Path(run_dir)
    folder = run_dir / "runs" / f"{method}_tp{train_points}_seed{seed}"
    path = folder / MODEL_FILE
    if not path.exists():
        if (folder / "model.pt").exists():
            raise ValueError(
                f"{folder / 'model.pt'}: a pickled model of an older fedcal, which is no longer "
                "read (unpickling can run code); rerun the experiment into a new --out"
            )
        raise FileNotFoundError(
            f"no model for method {method!r}, seed {seed} in {run_dir} ({path} missing)"
        )
    config_path = run_dir / "config.json"
    try:
        record = json.loads(config_path.read_text())
        cfg = from_json(record, str(config_path))
    except (OSError, json.JSONDecodeError, ConfigError) as e:
        raise ValueError(f"{config_path}: unreadable or not a fedcal run config ({e})") from None
    task, params, meta = load_model_file(path, cfg)
    recorded = ((record.get("resolved") or {}).get("methods") or {}).get(method)
    algorithm = build_recorded(method, cfg, task, recorded)
    return CalibratedFleet(
        algorithm,
        params,
        Scaler.from_dict(meta["scaler"]),
        cfg.data.features,
        cfg.data.target,
        meta["model"],
        cfg.data.client_column,
    )


def to_json(fleet: CalibratedFleet, valid_range: dict | None = None) -> str:
    """All numbers needed to evaluate every sensor's model, as JSON.

    ``valid_range`` ({sensor: {column: [min, max]}}, the span of each sensor's
    calibration points) is written as ``valid_range``; outside it the model
    extrapolates. Every leaf of the personalized parameter tree is written, so a
    method whose tree holds a posterior (coefficients, covariance) exports it too.
    """
    return json.dumps(
        {
            "features": list(fleet.features),
            "target": fleet.target,
            "model": fleet.model,
            "scaler": fleet.scaler.to_dict(),
            "valid_range": valid_range or {},
            "sensors": {
                sid: {k: v.double().tolist() for k, v in p.items()}
                for sid, p in fleet.params.items()
            },
        },
        indent=1,
    )


def _c_range_lines(sensors: list[str], columns: list[str], valid_range: dict) -> list[str]:
    """Per-sensor min/max of each input and of the output, and an in-range test."""
    missing = [s for s in sensors if s not in valid_range]
    if missing:
        raise ValueError(f"no valid range for sensor(s) {', '.join(missing)}")
    *inputs, target = columns

    def rows(col_index: int) -> str:
        return ", ".join(
            "{" + ", ".join(_c_float(valid_range[s][c][col_index]) for c in inputs) + "}"
            for s in sensors
        )

    def flat(col_index: int) -> str:
        return ", ".join(_c_float(valid_range[s][target][col_index]) for s in sensors)

    return [
        "/* Valid range per sensor: the span of its calibration points (inputs and output);",
        " * outside it the model extrapolates. */",
        f"static const float fedcal_x_min[FEDCAL_NUM_SENSORS][FEDCAL_NUM_INPUTS] = {{{rows(0)}}};",
        f"static const float fedcal_x_max[FEDCAL_NUM_SENSORS][FEDCAL_NUM_INPUTS] = {{{rows(1)}}};",
        f"static const float fedcal_y_min[FEDCAL_NUM_SENSORS] = {{{flat(0)}}};",
        f"static const float fedcal_y_max[FEDCAL_NUM_SENSORS] = {{{flat(1)}}};",
        "/* 1 if raw inputs x lie inside sensor `sensor`'s calibrated range, else 0. */",
        "static inline int fedcal_in_range(int sensor, const float *x) {",
        "    for (int j = 0; j < FEDCAL_NUM_INPUTS; ++j)",
        "        if (x[j] < fedcal_x_min[sensor][j] || x[j] > fedcal_x_max[sensor][j]) return 0;",
        "    return 1;",
        "}",
    ]


def _c_float(v: float) -> str:
    # exponent form always has a '.', so the 'f' suffix makes a valid float literal
    return f"{float(v):.9e}f"


def _c_array(name: str, values: np.ndarray) -> str:
    body = ", ".join(_c_float(v) for v in values.ravel())
    return f"static const float {name}[{values.size}] = {{{body}}};"


def to_c_header(
    fleet: CalibratedFleet,
    guard: str = "FEDCAL_CALIBRATION_H",
    valid_range: dict | None = None,
) -> str:
    """A C99 header evaluating each sensor's MLP; only for the ``mlp`` family.

    With ``valid_range`` (see :func:`to_json`) it also carries each sensor's
    calibrated input and output span and ``fedcal_in_range``.
    """
    if fleet.model.get("family") != "mlp" or not all(
        "l0.weight" in p for p in fleet.params.values()
    ):
        raise ValueError("C export supports the 'mlp' model family; use JSON export for this model")
    activation = fleet.model.get("activation", "tanh")
    act_c = {"tanh": "tanhf(v)", "relu": "(v > 0.0f ? v : 0.0f)", "silu": "v / (1.0f + expf(-v))"}[
        activation
    ]
    sensors = sorted(fleet.params)
    first = fleet.params[sensors[0]]
    layers = sum(1 for k in first if k.endswith(".weight"))
    sizes = [first["l0.weight"].shape[1]] + [first[f"l{k}.weight"].shape[0] for k in range(layers)]
    width = max(sizes)
    s = fleet.scaler
    lines = [
        f"/* fedcal calibration: {len(sensors)} sensors, "
        f"MLP {'-'.join(map(str, sizes))} ({activation}).",
        f" * inputs: {', '.join(fleet.features)}; output: {fleet.target}.",
        " * Generated by fedcal export; do not edit. */",
        f"#ifndef {guard}",
        f"#define {guard}",
        "#include <math.h>",
        "#include <string.h>",
        f"#define FEDCAL_NUM_SENSORS {len(sensors)}",
        f"#define FEDCAL_NUM_INPUTS {sizes[0]}",
        _c_array("fedcal_x_offset", s.x_offset),
        _c_array("fedcal_x_scale", s.x_scale),
        f"static const float fedcal_y_offset = {_c_float(s.y_offset[0])};",
        f"static const float fedcal_y_scale = {_c_float(s.y_scale[0])};",
        f"static const int fedcal_sizes[{len(sizes)}] = {{{', '.join(map(str, sizes))}}};",
        "static const char *const fedcal_sensor_ids[FEDCAL_NUM_SENSORS] = {"
        + ", ".join(json.dumps(sid) for sid in sensors)
        + "};",
    ]
    if valid_range:
        lines += _c_range_lines(sensors, [*fleet.features, fleet.target], valid_range)
    for i, sid in enumerate(sensors):
        p = fleet.params[sid]
        for k in range(layers):
            lines.append(_c_array(f"fedcal_w{k}_s{i}", p[f"l{k}.weight"].double().numpy()))
            lines.append(_c_array(f"fedcal_b{k}_s{i}", p[f"l{k}.bias"].double().numpy()))
    for k in range(layers):
        lines.append(
            f"static const float *const fedcal_w{k}[FEDCAL_NUM_SENSORS] = {{"
            + ", ".join(f"fedcal_w{k}_s{i}" for i in range(len(sensors)))
            + "};"
        )
        lines.append(
            f"static const float *const fedcal_b{k}[FEDCAL_NUM_SENSORS] = {{"
            + ", ".join(f"fedcal_b{k}_s{i}" for i in range(len(sensors)))
            + "};"
        )
    w_list = ", ".join(f"fedcal_w{k}[sensor]" for k in range(layers))
    b_list = ", ".join(f"fedcal_b{k}[sensor]" for k in range(layers))
    lines += [
        "/* Calibrated output of sensor `sensor` (index into fedcal_sensor_ids), raw inputs x. */",
        "static inline float fedcal_calibrate(int sensor, const float *x) {",
        f"    float a[{width}], b[{width}];",
        f"    const float *W[{layers}] = {{{w_list}}};",
        f"    const float *B[{layers}] = {{{b_list}}};",
        "    for (int j = 0; j < FEDCAL_NUM_INPUTS; ++j)",
        "        a[j] = (x[j] - fedcal_x_offset[j]) / fedcal_x_scale[j];",
        f"    for (int k = 0; k < {layers}; ++k) {{",
        "        int n_in = fedcal_sizes[k], n_out = fedcal_sizes[k + 1];",
        "        for (int o = 0; o < n_out; ++o) {",
        "            float v = B[k][o];",
        "            for (int i = 0; i < n_in; ++i) v += W[k][o * n_in + i] * a[i];",
        f"            b[o] = (k < {layers - 1}) ? {act_c} : v;",
        "        }",
        "        memcpy(a, b, sizeof(float) * (size_t)n_out);",
        "    }",
        "    return a[0] * fedcal_y_scale + fedcal_y_offset;",
        "}",
        f"#endif /* {guard} */",
        "",
    ]
    return "\n".join(lines)

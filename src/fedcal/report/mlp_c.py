"""The C header of MLP models (float32 weights, one set per sensor, ``fedcal_calibrate``), and
what every C header shares: the valid range with ``fedcal_in_range[_f64]`` and C literals.
The header of models linear in a basis: :mod:`fedcal.report.linear_c`.
"""

from __future__ import annotations

import json

import numpy as np

from fedcal.report.linear_c import find_unit_lines, float_entry

ACTIVATIONS = {"tanh": "tanhf(v)", "relu": "(v > 0.0f ? v : 0.0f)", "silu": "v / (1.0f + expf(-v))"}


def range_lines(
    sensors: list[str], columns: list[str], valid_range: dict, bounds: list, margin: float
) -> list[str]:
    """Per-sensor min/max of each input and of the output, and ``fedcal_in_range``.

    ``fedcal_in_range`` is :func:`in_range` (``fedcal predict``'s column): every input in
    [lo − m·w, hi + m·w], m = ``margin`` (``export.RANGE_MARGIN``). ``bounds``: per sensor
    those (lo, hi) arrays, :func:`fedcal.report.export.range_bounds`'s float64
    values, written with 17 significant digits (exact), and compared in double with the
    reading (``fedcal_in_range_f64``; ``fedcal_in_range`` widens a float reading, exact), so
    the header's flag equals predict's for every input, at the bounds too; a NaN input is out
    of range, as in predict.
    """
    missing = [s for s in sensors if s not in valid_range]
    if missing:
        raise ValueError(f"no valid range for sensor(s) {', '.join(missing)}")
    *inputs, target = columns

    def rows(col_index: int) -> str:
        return ", ".join(
            "{" + ", ".join(c_float(valid_range[s][c][col_index]) for c in inputs) + "}"
            for s in sensors
        )

    def flat(col_index: int) -> str:
        return ", ".join(c_float(valid_range[s][target][col_index]) for s in sensors)

    def widened(side: int) -> str:
        return ", ".join("{" + ", ".join(c_double(v) for v in b[side]) + "}" for b in bounds)

    return [
        "/* Valid range per sensor: the span of its calibration points (inputs and output);",
        " * outside it the model extrapolates. */",
        f"static const float fedcal_x_min[FEDCAL_NUM_SENSORS][FEDCAL_NUM_INPUTS] = {{{rows(0)}}};",
        f"static const float fedcal_x_max[FEDCAL_NUM_SENSORS][FEDCAL_NUM_INPUTS] = {{{rows(1)}}};",
        f"static const float fedcal_y_min[FEDCAL_NUM_SENSORS] = {{{flat(0)}}};",
        f"static const float fedcal_y_max[FEDCAL_NUM_SENSORS] = {{{flat(1)}}};",
        f"#define FEDCAL_RANGE_MARGIN {margin!r}",
        "/* fedcal predict's in-range bounds per input: the span widened by FEDCAL_RANGE_MARGIN",
        " * of its width w on each side, lo - m*w and hi + m*w (computed by fedcal export). */",
        "static const double fedcal_range_lo[FEDCAL_NUM_SENSORS][FEDCAL_NUM_INPUTS] = "
        f"{{{widened(0)}}};",
        "static const double fedcal_range_hi[FEDCAL_NUM_SENSORS][FEDCAL_NUM_INPUTS] = "
        f"{{{widened(1)}}};",
        "/* 1 if every raw input lies within sensor `sensor`'s in-range bounds (a bound itself",
        " * is inside), else 0 (also for NaN): fedcal predict's in_range column. */",
        "static inline int fedcal_in_range_f64(int sensor, const double *x) {",
        "    for (int j = 0; j < FEDCAL_NUM_INPUTS; ++j) {",
        "        if (!(x[j] >= fedcal_range_lo[sensor][j] && x[j] <= fedcal_range_hi[sensor][j]))",
        "            return 0;",
        "    }",
        "    return 1;",
        "}",
        *float_entry("int", "fedcal_in_range", "fedcal_in_range_f64"),
    ]


def c_float(v: float) -> str:
    # exponent form always has a '.', so the 'f' suffix makes a valid float literal
    return f"{float(v):.9e}f"


def c_double(v: float) -> str:
    # 17 significant digits: the float64 value exactly (non-finite as C's math.h macros)
    if not np.isfinite(v):
        return "NAN" if np.isnan(v) else ("INFINITY" if v > 0 else "-INFINITY")
    return f"{float(v):.17e}"


def c_array(name: str, values: np.ndarray) -> str:
    body = ", ".join(c_float(v) for v in values.ravel())
    return f"static const float {name}[{values.size}] = {{{body}}};"


def _layers(fleet) -> tuple[list[str], int, list[int]]:
    """(sensor ids, number of layers, sizes input → … → output) of the fleet's MLPs."""
    if fleet.model.get("family") != "mlp" or not all(
        "l0.weight" in p for p in fleet.params.values()
    ):
        raise ValueError(
            "C export supports the 'mlp' model family and models linear in a basis (fedprior, "
            "polynomial, fedpoly, leastsq); use JSON or ONNX export for this model"
        )
    sensors = sorted(fleet.params)
    first = fleet.params[sensors[0]]
    layers = sum(1 for k in first if k.endswith(".weight"))
    sizes = [first["l0.weight"].shape[1]] + [first[f"l{k}.weight"].shape[0] for k in range(layers)]
    return sensors, layers, sizes


def _weights(fleet, sensors: list[str], layers: int) -> list[str]:
    """Each sensor's weight and bias arrays, and per layer the table of them by sensor."""
    lines = []
    for i, sid in enumerate(sensors):
        p = fleet.params[sid]
        for k in range(layers):
            lines.append(c_array(f"fedcal_w{k}_s{i}", p[f"l{k}.weight"].double().numpy()))
            lines.append(c_array(f"fedcal_b{k}_s{i}", p[f"l{k}.bias"].double().numpy()))
    for k in range(layers):
        for kind in ("w", "b"):
            lines.append(
                f"static const float *const fedcal_{kind}{k}[FEDCAL_NUM_SENSORS] = {{"
                + ", ".join(f"fedcal_{kind}{k}_s{i}" for i in range(len(sensors)))
                + "};"
            )
    return lines


def _calibrate(layers: int, width: int, act_c: str) -> list[str]:
    """``fedcal_calibrate``: the forward pass of sensor `sensor`'s MLP in float."""
    w_list = ", ".join(f"fedcal_w{k}[sensor]" for k in range(layers))
    b_list = ", ".join(f"fedcal_b{k}[sensor]" for k in range(layers))
    return [
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
    ]


def mlp_header(fleet, guard: str, ranges: list[str]) -> str:
    """The C99 header of an MLP run: scaler, ids (``fedcal_find_unit``), the valid range
    lines (:func:`range_lines`, or none), every sensor's float32 weights and
    ``fedcal_calibrate``."""
    sensors, layers, sizes = _layers(fleet)
    activation = fleet.model.get("activation", "tanh")
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
        c_array("fedcal_x_offset", s.x_offset),
        c_array("fedcal_x_scale", s.x_scale),
        f"static const float fedcal_y_offset = {c_float(s.y_offset[0])};",
        f"static const float fedcal_y_scale = {c_float(s.y_scale[0])};",
        f"static const int fedcal_sizes[{len(sizes)}] = {{{', '.join(map(str, sizes))}}};",
        "static const char *const fedcal_sensor_ids[FEDCAL_NUM_SENSORS] = {"
        + ", ".join(json.dumps(sid) for sid in sensors)
        + "};",
        *ranges,
        *find_unit_lines(),
        *_weights(fleet, sensors, layers),
        *_calibrate(layers, max(sizes), ACTIVATIONS[activation]),
        f"#endif /* {guard} */",
        "",
    ]
    return "\n".join(lines)

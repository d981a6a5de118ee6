"""ONNX export of each sensor's personalized model (``fedcal export --format onnx``).

One ``<sensor>.onnx`` file per sensor: raw inputs in (``x``: rows × features,
float64, in the fleet's feature order), calibrated target out (rows × 1,
float64). The graph is fedcal's own computation, traced: input scaling, the
method's ``predict`` on that sensor's parameters (in the run's dtype), output
scaling, evaluated in float64 (the run's float32 weights convert exactly; the
graph is then the exact evaluation of the model that fedcal's float32 path
approximates to float32 rounding) — so any model family a method predicts with (MLP, Legendre basis,
polynomial surfaces) exports without a per-family writer. We use torch's
TorchScript-based exporter (``dynamo=False``), which needs no extra package;
the dynamo exporter would add onnxscript for graphs this small. The model's
metadata (``metadata_props``) names the sensor, method, inputs, target and
the valid input range (the span of the sensor's calibration points).
A method with a predictive distribution (``algorithm.predictive_std`` returns
a tensor) gets a second output, ``<target>_std``: the predictive standard
deviation in target units, traced the same way — for a unit whose model states
a σ; a unit with none (fedprior's declined interval: σ NaN) gets no σ output,
and its metadata says so (``has_sigma`` "false", ``sigma_note``; "true" otherwise).

Two per-row flags follow the value (and σ), bool of shape (rows,):

- ``in_range`` (when the export is given the sensor's valid range, as ``fedcal export``
  and ``to_onnx`` of the API always are): ``fedcal predict``'s ``in_range`` column, every
  input within the calibrated span widened by 5 % of it on each side
  (:func:`fedcal.report.export.range_bounds`, compared in float64 as there: ≤ at the edge);
- ``beyond_support`` (methods with an extrapolation guard, ``algorithm.beyond_support``:
  fedprior and its variants, polynomial): the rows the guard linearizes, traced from the
  method's own ``beyond_support`` on the run's parameters and on the scaled inputs rounded
  to the run's dtype, exactly as :meth:`CalibratedFleet.predict` evaluates it — so the flag
  equals fedcal's decision bit for bit, also at the box's edge.
"""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import torch

from fedcal.core.tree import stack
from fedcal.report.export import CalibratedFleet, range_bounds

OPSET = 17
NO_SIGMA = "no predictive σ stated for this unit (its interval was declined): no σ output"


class SensorCalibration(torch.nn.Module):
    """One sensor's calibration as a module: raw inputs (rows, F) float64 → target (rows, 1)."""

    def __init__(
        self, fleet: CalibratedFleet, sensor: str, valid_range: dict | None = None
    ) -> None:
        super().__init__()
        if sensor not in fleet.params:
            raise KeyError(f"sensor {sensor!r} is not in this run")
        self.algorithm = fleet.algorithm
        # the run's own parameters and dtype: the guard's flag is evaluated on them as
        # CalibratedFleet.predict does (a float32 span or input moves the box's edge)
        self.run_params = stack([fleet.params[sensor]])
        self.run_dtype = next(iter(self.run_params.values())).dtype
        # a cohort of one, as predict expects; float64 so that the runtime's summation
        # order cannot move the result by float32 rounding (the weights convert exactly)
        self.params = {k: v.double() for k, v in self.run_params.items()}
        self.has_range = bool(valid_range)
        if self.has_range:
            lower, upper = range_bounds(valid_range, fleet.features)
            self.register_buffer("range_lo", torch.as_tensor(lower, dtype=torch.float64))
            self.register_buffer("range_hi", torch.as_tensor(upper, dtype=torch.float64))
        self.has_guard = self.algorithm.beyond_support is not None
        s = fleet.scaler
        self.register_buffer("x_offset", torch.as_tensor(s.x_offset, dtype=torch.float64))
        self.register_buffer("x_scale", torch.as_tensor(s.x_scale, dtype=torch.float64))
        self.register_buffer("y_offset", torch.as_tensor(s.y_offset, dtype=torch.float64))
        self.register_buffer("y_scale", torch.as_tensor(s.y_scale, dtype=torch.float64))

    def method_has_std(self) -> bool:
        """Whether the method gives predictive standard deviations at all."""
        method = getattr(self.algorithm, "predictive_std", None)
        probe = torch.zeros(1, 1, len(self.x_offset), dtype=torch.float64)
        return method is not None and method(self.params, probe) is not None

    def has_std(self) -> bool:
        """Whether this unit's model states a σ (fedprior's declined interval: none)."""
        if not self.method_has_std():
            return False
        probe = torch.zeros(1, 1, len(self.x_offset), dtype=torch.float64)
        return bool(torch.isfinite(self.algorithm.predictive_std(self.params, probe)).all())

    def output_names(self, target: str) -> list[str]:
        """The graph's outputs in order: value, σ (if any), ``in_range``, ``beyond_support``."""
        names = [target] + ([f"{target}_std"] if self.has_std() else [])
        names += ["in_range"] if self.has_range else []
        names += ["beyond_support"] if self.has_guard else []
        if len(set(names)) < len(names):
            raise ValueError(f"target {target!r} clashes with an ONNX output name: {names}")
        return names

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        z = (x - self.x_offset) / self.x_scale  # as CalibratedFleet.predict, in float64
        y = self.algorithm.predict(self.params, z.unsqueeze(0))[0]  # (rows, 1)
        out = [y.to(torch.float64) * self.y_scale + self.y_offset]
        if self.has_std():
            std = self.algorithm.predictive_std(self.params, z.unsqueeze(0))[0]  # (rows, 1)
            out.append(std.to(torch.float64) * self.y_scale.abs())
        if self.has_range:  # fedcal predict's in_range: lo − m·w ≤ x ≤ hi + m·w per input
            inside = (x >= self.range_lo) & (x <= self.range_hi)
            out.append(inside.to(torch.int32).amin(-1) > 0)  # all inputs (rows,)
        if self.has_guard:  # the guard's decision, on predict's inputs (the run's dtype)
            z_run = z.to(self.run_dtype).unsqueeze(0)
            out.append(self.algorithm.beyond_support(self.run_params, z_run)[0])
        return out[0] if len(out) == 1 else tuple(out)


def to_onnx(
    fleet: CalibratedFleet, sensor: str, method: str = "", valid_range: dict | None = None
) -> bytes:
    """The serialized ONNX model of ``sensor``'s calibration."""
    import onnx

    module = SensorCalibration(fleet, sensor, valid_range)
    example = torch.as_tensor(
        np.tile(fleet.scaler.x_offset + fleet.scaler.x_scale * 0.5, (2, 1)), dtype=torch.float64
    )
    outputs = module.output_names(fleet.target)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        # the TorchScript exporter announces its deprecation on every call
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (example,),
            buf,
            dynamo=False,
            input_names=["x"],
            output_names=outputs,
            dynamic_axes={"x": {0: "rows"}, **{name: {0: "rows"} for name in outputs}},
            opset_version=OPSET,
        )
    model = onnx.load_from_string(buf.getvalue())
    meta = {
        "sensor": sensor,
        "method": method,
        "features": json.dumps(list(fleet.features)),
        "target": fleet.target,
        "valid_range": json.dumps(valid_range or {}),
    }
    if module.method_has_std():  # a σ output, or why there is none for this unit
        meta["has_sigma"] = "true" if module.has_std() else "false"
        if not module.has_std():
            meta["sigma_note"] = NO_SIGMA
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    model.doc_string = (
        f"fedcal calibration of sensor {sensor} ({method}): x = raw "
        f"[{', '.join(fleet.features)}] float64 → {', '.join(outputs)}"
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()

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
deviation in target units, traced the same way.
"""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import torch

from fedcal.core.tree import stack
from fedcal.report.export import CalibratedFleet

OPSET = 17


class SensorCalibration(torch.nn.Module):
    """One sensor's calibration as a module: raw inputs (rows, F) float64 → target (rows, 1)."""

    def __init__(self, fleet: CalibratedFleet, sensor: str) -> None:
        super().__init__()
        if sensor not in fleet.params:
            raise KeyError(f"sensor {sensor!r} is not in this run")
        self.algorithm = fleet.algorithm
        # a cohort of one, as predict expects; float64 so that the runtime's summation
        # order cannot move the result by float32 rounding (the weights convert exactly)
        self.params = {k: v.double() for k, v in stack([fleet.params[sensor]]).items()}
        s = fleet.scaler
        self.register_buffer("x_offset", torch.as_tensor(s.x_offset, dtype=torch.float64))
        self.register_buffer("x_scale", torch.as_tensor(s.x_scale, dtype=torch.float64))
        self.register_buffer("y_offset", torch.as_tensor(s.y_offset, dtype=torch.float64))
        self.register_buffer("y_scale", torch.as_tensor(s.y_scale, dtype=torch.float64))

    def has_std(self) -> bool:
        """Whether the method gives a predictive standard deviation for this model."""
        method = getattr(self.algorithm, "predictive_std", None)
        probe = torch.zeros(1, 1, len(self.x_offset), dtype=torch.float64)
        return method is not None and method(self.params, probe) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        z = (x - self.x_offset) / self.x_scale  # as CalibratedFleet.predict, in float64
        y = self.algorithm.predict(self.params, z.unsqueeze(0))[0]  # (rows, 1)
        y = y.to(torch.float64) * self.y_scale + self.y_offset
        if not self.has_std():
            return y
        std = self.algorithm.predictive_std(self.params, z.unsqueeze(0))[0]  # (rows, 1)
        return y, std.to(torch.float64) * self.y_scale.abs()


def to_onnx(
    fleet: CalibratedFleet, sensor: str, method: str = "", valid_range: dict | None = None
) -> bytes:
    """The serialized ONNX model of ``sensor``'s calibration."""
    import onnx

    module = SensorCalibration(fleet, sensor)
    example = torch.as_tensor(
        np.tile(fleet.scaler.x_offset + fleet.scaler.x_scale * 0.5, (2, 1)), dtype=torch.float64
    )
    outputs = [fleet.target] + ([f"{fleet.target}_std"] if module.has_std() else [])
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
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    model.doc_string = (
        f"fedcal calibration of sensor {sensor} ({method}): x = raw "
        f"[{', '.join(fleet.features)}] float64 → {', '.join(outputs)}"
    )
    onnx.checker.check_model(model)
    return model.SerializeToString()

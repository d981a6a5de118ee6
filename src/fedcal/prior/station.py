"""A calibration station's step, torch-free: new units' rows in, each unit's model and checks out.

:func:`calibrate_fleet` is what ``fedcal calibrate`` computes for every unit (the posterior
of :mod:`fedcal.prior.posterior`, the range guard and QA of :mod:`fedcal.prior.qa`), for
the variants the NumPy path covers (:func:`fedcal.prior.posterior.unsupported`); a variant it
does not cover is refused in one line naming it (``fedcal calibrate`` takes the torch path
for it). Numbers equal to the torch path's within rounding (tests/prior/test_posterior.py,
tests/prior/test_qa.py); runs with torch not importable (tests/prior/test_torch_free.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedcal.data.fleet import Fleet
from fedcal.data.scaling import Scaler
from fedcal.prior import posterior, qa
from fedcal.prior.model import PriorModel


@dataclass(frozen=True)
class Station:
    """The units (``ids`` in the fleet's order), their posteriors and their QA columns
    (from a prior's deployment discrepancy model, ``units.reasons``: per unit why its design
    gets no σ, "" if it gets one); ``refused``: the file's units refused by the range guard
    (no model, not in ``ids``: :func:`fedcal.prior.qa.refuse_out_of_range`)."""

    ids: tuple[str, ...]
    units: posterior.Units
    checks: dict[str, np.ndarray]
    scaler: Scaler
    refused: tuple[qa.Refusal, ...] = ()

    @property
    def status(self) -> np.ndarray:
        return self.checks["status"]

    def predict(self, unit: str, readings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(calibrated value, predictive σ) in the target's unit for one unit's raw
        ``readings`` (rows, inputs) in the prior's feature order; σ NaN when its interval
        was declined. Beyond the unit's support box: the guarded extrapolation (module
        :mod:`fedcal.prior.posterior`)."""
        if unit not in self.ids:
            raise KeyError(f"unit {unit!r} was not calibrated here ({len(self.ids)} units)")
        i = self.ids.index(unit)
        one = self.units.rows(i, i + 1)
        x = self.scaler.x(np.asarray(readings, dtype=np.float64))[None]
        y_scale = float(np.asarray(self.scaler.y_scale).ravel()[0])
        y_offset = float(np.asarray(self.scaler.y_offset).ravel()[0])
        mean = posterior.predict(one, x)[0] * y_scale + y_offset
        return mean, posterior.predictive_std(one, x)[0] * abs(y_scale)


def calibrate_fleet(
    prior: PriorModel, fleet: Fleet, source: str = "data", strict: bool = False
) -> Station:
    """Every unit of ``fleet`` against ``prior`` from its calibration (train) rows: the
    columns must be the prior's; a unit whose rows lie outside its calibrated range is
    refused alone, the others calibrated as if the file held only them (``strict``: the
    whole file refused, :func:`qa.refuse_out_of_range`)."""
    qa.check_columns(prior, fleet, source)
    why = posterior.unsupported(prior, timed=fleet.row_times("train") is not None)
    if why:
        raise ValueError(f"{source}: {why} is calibrated by the torch path (fedcal calibrate)")
    fleet, refused = qa.refuse_out_of_range(prior, fleet, source, strict)
    x, y, mask, branch = posterior.padded_rows(prior, fleet)
    units = posterior.calibrate_units(prior, x, y, mask, branch)
    checks = qa.units_qa(prior, units, x, y, mask, branch)
    return Station(tuple(map(str, fleet.client_ids)), units, checks, prior.scaler, refused)

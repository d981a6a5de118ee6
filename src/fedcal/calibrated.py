"""New units calibrated against a stored prior, by the form of their posterior that covers it.

What :class:`fedcal.api.CalibratedUnits` (and so ``fedcal calibrate``) holds as ``result``:

- a :class:`fedcal.prior.station.Station` — the NumPy posterior (:mod:`fedcal.prior.posterior`)
  for every prior it covers (fedprior, _branch, _fixed, _sensor and a prior's deployment
  discrepancy model: :func:`fedcal.prior.posterior.unsupported` returns ""); no torch is
  imported;
- a :class:`fedcal.calibration.Calibration` — FedPrior rebuilt from the prior (torch) for
  the variants it does not cover (drift, the time-respecting choice, noise over the inputs,
  Student-t rows); without torch those are one line, :class:`fedcal.report.served.NeedsTorch`
  (``pip install 'fedcal[neural]'``).

Each function here reads either form, so the API's methods are written once. The two agree
within the solves' rounding (tests/prior/test_torch_free_api.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from fedcal.core import runnames
from fedcal.data.fleet import Fleet
from fedcal.data.scaling import Scaler
from fedcal.prior import calibrate_dir, posterior, qa
from fedcal.prior.model import PriorModel
from fedcal.prior.station import Station, calibrate_fleet
from fedcal.report.fleet import CalibratedFleet

if TYPE_CHECKING:
    from fedcal.calibration import Calibration

    Result = Station | Calibration


def calibrate(
    prior: PriorModel, fleet: Fleet, source: str = "data", strict: bool = False
) -> Result:
    """Every unit of ``fleet`` against ``prior`` (module docstring: NumPy where covered); a
    unit outside the prior's range is refused alone (``strict``: the whole file), both paths
    alike (:func:`fedcal.prior.qa.refuse_out_of_range`): the result holds the others."""
    from fedcal.report.served import NeedsTorch, torch_available

    why = posterior.unsupported(prior, timed=fleet.row_times("train") is not None)
    if not why:
        if torch_available():
            check_settings(prior)
        return calibrate_fleet(prior, fleet, source, strict)
    if not torch_available():
        raise NeedsTorch(f"{source}: {why}")
    import torch

    from fedcal import calibration

    torch.set_num_threads(1)
    return calibration.calibrate(prior, fleet, source, strict)


def calibrated_fleet(fleet: Fleet, result: Result) -> Fleet:
    """``fleet`` without the rows of the units ``result`` refused: the units it holds."""
    if not result.refused:
        return fleet
    gone = {r.unit for r in result.refused}
    frame = fleet.frame[~fleet.frame[fleet.client_column].astype(str).isin(gone)]
    return dataclasses.replace(fleet, frame=frame)


def refused_line(result: Result) -> str:
    """One line: which units the range guard refused and why ("" if none)."""
    return qa.refused_line(result.refused, len(sensor_ids(result)) + len(result.refused))


def check_settings(prior: PriorModel) -> None:
    """The prior's recorded method settings against the configuration's schema, as FedPrior's
    path checks them (a ConfigError naming prior.json and the setting). The schema
    (:mod:`fedcal.config`) imports torch, so only where torch is installed; without it a
    setting the NumPy path does not read is not checked."""
    from fedcal.config import from_dict

    from_dict({"methods": {prior.method: calibrate_dir.fixed_params(prior)}}, "prior.json")


def sensor_ids(result: Result) -> list[str]:
    """The units, in the fleet's order."""
    return list(result.ids if isinstance(result, Station) else result.tensors.client_ids)


def scaler(result: Result) -> Scaler:
    """The map of raw readings to the basis' inputs (the prior's scaler)."""
    return result.scaler if isinstance(result, Station) else result.tensors.scaler


def unit_params(result: Result) -> dict[str, np.ndarray]:
    """The units' model tree as arrays, units first (coef, cov, noise_var, box, ...: the
    leaves model.safetensors holds)."""
    if isinstance(result, Station):
        return calibrate_dir.unit_leaves(result.units)
    return {k: v.numpy() for k, v in result.personal.items() if hasattr(v, "numpy")}


def declined(result: Result) -> np.ndarray | None:
    """Per unit whether its interval is declined (no σ stated); None without an interval."""
    if isinstance(result, Station):
        return result.units.declined
    flag = result.personal.get("declined")
    return None if flag is None else (flag > 0).numpy()


def reasons(result: Result) -> tuple[str, ...]:
    """Per unit, the deployment discrepancy model's reason for no σ ("" if it has one); () for
    a prior without that model."""
    return tuple(result.units.reasons if isinstance(result, Station) else result.reasons)


def declined_note(prior: PriorModel, result: Result) -> str:
    """One line: why some units get no interval ("" if none)."""
    if isinstance(result, Station):
        units = result.units
        return calibrate_dir.declined_note(prior, units.declined, units.reasons)
    from fedcal.calibration import declined_note as torch_note

    return torch_note(prior, result)


def coefficients(prior: PriorModel, fleet: Fleet, result: Result) -> pd.DataFrame:
    """coefficients.csv's table (:func:`fedcal.prior.calibrate_dir.coefficient_table`)."""
    if not isinstance(result, Station):
        from fedcal.calibration import coefficient_table

        return coefficient_table(prior, result)
    counts = np.array([len(x) for x, _ in fleet.arrays("train")], dtype=np.int64)
    u = result.units
    return calibrate_dir.coefficient_table(prior, result.ids, u.coef, u.noise_var, counts)


def write(out: Path, prior: PriorModel, fleet: Fleet, result: Result) -> pd.DataFrame:
    """``fedcal calibrate``'s output folder; returns per_sensor.csv's table."""
    if isinstance(result, Station):
        return calibrate_dir.write(out, prior, fleet, result)
    from fedcal import calibration

    return calibration.write(out, prior, fleet, result)


def served(prior: PriorModel, fleet: Fleet, result: Result) -> CalibratedFleet:
    """The units as the :class:`~fedcal.report.fleet.CalibratedFleet` that ``predict`` and
    the exports read: NumPy-evaluated (:class:`fedcal.report.served.StationFleet`, what
    ``fedcal predict`` loads from the saved folder) for a Station, FedPrior's otherwise."""
    if isinstance(result, Station):
        from fedcal.report.served import StationFleet

        leaves = calibrate_dir.unit_leaves(result.units)
        params = {s: {k: v[i] for k, v in leaves.items()} for i, s in enumerate(result.ids)}
        basis = prior.basis
        return StationFleet(
            None, params, result.scaler, prior.features, prior.target,
            calibrate_dir.template()["model"], fleet.client_column, excluded(result),
            basis.terms, basis.branch_terms,
        )  # fmt: skip
    return _torch_fleet(prior, fleet, result.algorithm, result.personal, result)


def torch_served(prior: PriorModel, fleet: Fleet, result: Result) -> CalibratedFleet:
    """:func:`served` with FedPrior's evaluation (what the ONNX export traces; needs torch)."""
    if not isinstance(result, Station):
        return served(prior, fleet, result)
    import torch

    from fedcal.calibration import prior_algorithm

    leaves = {k: torch.as_tensor(v) for k, v in calibrate_dir.unit_leaves(result.units).items()}
    return _torch_fleet(prior, fleet, prior_algorithm(prior), leaves, result)


def _torch_fleet(
    prior: PriorModel, fleet: Fleet, algorithm: Any, personal: Any, result: Result
) -> CalibratedFleet:
    """FedPrior's :class:`~fedcal.report.fleet.CalibratedFleet` of the units' ``personal``
    tree (units first)."""
    from fedcal.calibration import prior_config
    from fedcal.core.tree import unstack

    return CalibratedFleet(
        algorithm, dict(zip(sensor_ids_of(fleet), unstack(personal), strict=True)),
        scaler(result), prior.features, prior.target,
        dataclasses.asdict(prior_config(prior).model), fleet.client_column, excluded(result),
    )  # fmt: skip


def excluded(result: Result) -> dict[str, str]:
    """The units the range guard refused, as a run's refused sensors are served
    (``CalibratedFleet.excluded``: no model, "refused (reason)")."""
    from fedcal.report.sensors import refused_reason

    return {r.unit: refused_reason(r.reason) for r in result.refused}


def sensor_ids_of(fleet: Fleet) -> list[str]:
    """The fleet's units as strings, in its order."""
    return [str(s) for s in fleet.client_ids]


def load_served(run_dir: Path, method: str) -> CalibratedFleet:
    """A calibrate output's stored models: NumPy where :mod:`fedcal.report.served` covers
    them (whether or not torch is installed), FedPrior's otherwise
    (:func:`fedcal.report.export.load_models`)."""
    from fedcal.report.export import load_models

    return load_models(run_dir, method, drop_diverged=True)


def load_dir(run_dir: Path) -> tuple[PriorModel, Fleet, Result, dict[str, Any]]:
    """A ``fedcal calibrate`` output's (prior, calibrated units' points, result, saved valid
    ranges) (:meth:`fedcal.api.CalibratedUnits.load`): the stored models
    (:func:`load_served`), the points of calibration_points.csv, the units it refused
    (units.csv: status ``refused``, kept as refused)."""
    from fedcal.data.loader import load_fleet
    from fedcal.report.export import choose_method
    from fedcal.report.rundir import read_table, read_valid_ranges

    if not (run_dir / "calibration_points.csv").is_file():
        raise FileNotFoundError(
            f"{run_dir}: not a `fedcal calibrate` output (no calibration_points.csv)"
        )
    method = choose_method(run_dir, None)
    prior = run_prior(run_dir, method)
    column = prior.sensor_column
    points = read_table(run_dir / "calibration_points.csv", dtype={"sensor_id": str})
    frame = points[["sensor_id", *prior.features, prior.target]].rename(
        columns={"sensor_id": column}
    )
    fleet = load_fleet(
        frame.assign(split="train"), features=prior.features, target=prior.target,
        client_column=column, min_train_points=1, min_test_points=0,
    )  # fmt: skip
    models = load_served(run_dir, method)
    ranges = read_valid_ranges(run_dir, method, 0, 0)  # as saved (the points' CSV rounds)
    units = read_table(run_dir / runnames.UNITS, dtype={"sensor_id": str})
    refused = tuple(
        qa.Refusal(r.sensor_id, int(r.points), str(r.status_reason))
        for r in units[units["status"] == qa.STATUS_REFUSED].itertuples()
    )
    return prior, fleet, loaded(prior, fleet, models, refused), ranges


def loaded(
    prior: PriorModel, fleet: Fleet, models: CalibratedFleet, refused: tuple[qa.Refusal, ...] = ()
) -> Result:
    """The result of stored units (``models``, :func:`load_served`) and their calibration
    points ``fleet``: a unit whose calibration failed is NaN, as it was saved; ``refused``:
    the units the range guard refused (no model)."""
    from fedcal.report.served import StationFleet

    if not isinstance(models, StationFleet):
        return dataclasses.replace(_loaded_calibration(prior, fleet, models), refused=refused)
    ids = tuple(sensor_ids_of(fleet))
    first = next(iter(models.params.values()))
    failed = {k: np.full_like(v, np.nan) for k, v in first.items()}
    leaves = {k: np.stack([models.params.get(s, failed)[k] for s in ids]) for k in first}
    gp = {k: v for k, v in leaves.items() if k.startswith("gp_")} or None
    flag = leaves.get("declined")
    units = posterior.Units(
        leaves["coef"], leaves["cov"], leaves["noise_var"], leaves["box"], prior.basis.terms,
        prior.basis.branch_terms, leaves.get("disc_var"), None if flag is None else flag > 0, gp,
    )  # fmt: skip
    x, y, mask, branch = posterior.padded_rows(prior, fleet)
    checks = qa.units_qa(prior, units, x, y, mask, branch)
    return Station(ids, units, checks, models.scaler, refused)


def _loaded_calibration(prior: PriorModel, fleet: Fleet, models: CalibratedFleet) -> Calibration:
    """The :class:`fedcal.calibration.Calibration` of stored units: their saved parameters,
    their calibration points as tensors, and the prior's server state
    (:func:`fedcal.calibration.prior_server`)."""
    import torch

    from fedcal.calibration import Calibration, prior_server
    from fedcal.core.bayes import F64
    from fedcal.core.data import ClientData
    from fedcal.core.tree import stack, tree_map
    from fedcal.engine.simulation import FleetTensors

    scale = models.scaler

    def scaled(split: str) -> ClientData:
        arrays = [(scale.x(x), scale.y(y)) for x, y in fleet.arrays(split)]
        return ClientData.from_arrays(arrays, dtype=F64)

    ids = tuple(sensor_ids_of(fleet))
    tensors = FleetTensors(scaled("train"), scaled("test"), scale, ids)
    failed = tree_map(
        lambda t: torch.full_like(t, float("nan")), next(iter(models.params.values()))
    )
    personal = stack([models.params.get(sid, failed) for sid in ids])
    return Calibration(models.algorithm, tensors, personal, prior_server(prior, scale))


def run_prior(run_dir: Path, method: str) -> PriorModel:
    """The prior.json of a calibrate output's run folder."""
    return PriorModel.load(runnames.run_path(run_dir, method) / runnames.PRIOR)

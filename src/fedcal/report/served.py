"""A fedprior run's served models without torch: what ``predict`` and ``certificate`` read
on a calibration station (issue 37.1).

:func:`load_station` reads a ``fedcal calibrate`` output (or a fedprior run folder) as
:func:`fedcal.report.export.load_models` does — the model file (its checksum, metadata,
finite and well-formed parameters: :func:`fedcal.core.arrayfile.load_arrays`,
:func:`fedcal.core.runfiles.check_model_params`), the run's column names, the units the run
refused (:mod:`fedcal.report.sensors`, both paths') — and evaluates each
unit's posterior with :mod:`fedcal.prior.posterior` (NumPy) behind the torch path's
:class:`~fedcal.report.fleet.CalibratedFleet` (its predictions, intervals and σ checks: one
serving code, two evaluations, :meth:`~fedcal.report.fleet.CalibratedFleet.evaluate`):

    ŷ(x) = y_offset + y_scale · ψ(x)ᵀm,   σ(x) = |y_scale| · √(z(x)ᵀQz(x) + s [+ gap²])

(the guarded basis ψ, (Q, s) of :func:`fedcal.prior.posterior.variance_form`), and the 95 %
half-width 1.96 σ, or with a direction term the sweep mixture's
(:func:`fedcal.prior.posterior.interval_halfwidth`).
Equal to the torch path within rounding (tests/prior/test_torch_free.py). A model this path
does not cover (another method; drift, noise over the inputs, …: parameters
beyond :data:`COVERED`, or :func:`fedcal.prior.posterior.unsupported`) raises
:class:`NeedsTorch`, which the command line turns into its one-line "needs torch" error.
:func:`torch_available` says which path :func:`fedcal.report.export.load_models` takes (the
one loader: it calls :func:`load_station` where torch is not installed).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcal.core import runnames
from fedcal.core.arrayfile import TensorFileError, load_arrays
from fedcal.core.paths import read_json
from fedcal.core.runfiles import check_model_meta, check_model_params
from fedcal.data.scaling import Scaler
from fedcal.prior import posterior
from fedcal.prior.deployment import GP_LEAVES
from fedcal.prior.model import PriorModel
from fedcal.report.fleet import CalibratedFleet
from fedcal.report.sensors import check_method, served_sensors

COVERED = frozenset({"coef", "cov", "noise_var", "box", "disc_var", "declined", *GP_LEAVES})


INSTALL = "needs torch, which is not installed: pip install 'fedcal[neural]'"


class NeedsTorch(ImportError):
    """A model the NumPy path does not evaluate: the torch path (``fedcal[neural]``) does.

    ``why`` names the model (the command line adds its own line on torch); the message is
    ``why`` and what to install, one line (what a Python caller sees)."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"{why}: {INSTALL}", name="torch")


def torch_available() -> bool:
    """Whether ``import torch`` can succeed here (no import is made)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class StationFleet(CalibratedFleet):
    """:class:`~fedcal.report.fleet.CalibratedFleet` evaluated in NumPy (module docstring):
    ``params`` per sensor are NumPy arrays, ``algorithm`` is None; ``terms`` and
    ``branch_terms`` the prior's basis."""

    terms: tuple[tuple[int, ...], ...] = ()
    branch_terms: tuple[tuple[int, ...], ...] = ()

    def units(self, sensors: list[str]) -> posterior.Units:
        """The sensors' posteriors as :class:`fedcal.prior.posterior.Units` (scaled)."""
        p = {k: np.stack([self.params[s][k] for s in sensors]) for k in self.params[sensors[0]]}
        declined = p.get("declined")
        gp = {k: p[k] for k in GP_LEAVES} if "gp_x" in p else None  # prior/deployment.py
        return posterior.Units(
            p["coef"], p["cov"], p["noise_var"], p["box"], self.terms, self.branch_terms,
            p.get("disc_var"), None if declined is None else declined > 0, gp,
        )  # fmt: skip

    def evaluate(self, sensor: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ŷ, σ) at scaled inputs ``z`` (rows, F), scaled, rows × 1 each: the posterior's
        mean and predictive σ (:mod:`fedcal.prior.posterior`)."""
        units, x = self.units([sensor]), z[None]
        y = posterior.predict(units, x)[0].reshape(-1, 1)
        return y, posterior.predictive_std(units, x)[0].reshape(-1, 1)

    def halfwidth(self, sensor: str, z: np.ndarray) -> np.ndarray:
        """The stated 95 % half-width (scaled) at ``z`` (module docstring): (rows,)."""
        return posterior.interval_halfwidth(self.units([sensor]), z[None])[0]

    def sigma_at_centre(self, sensors: list[str]) -> np.ndarray:
        """The sensors' σ (scaled) at the scaled inputs' centre 0: (sensors, 1)."""
        at = np.zeros((len(sensors), 1, len(self.features)))
        return posterior.predictive_std(self.units(sensors), at)


def _per_sensor(path: Path, trees: dict, meta: dict) -> dict[str, dict[str, np.ndarray]]:
    """{sensor: {leaf: array}} of the file's ``params`` tree (flat, covered leaves only)."""
    params = trees.get("params")
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise NeedsTorch(f"{path}: a model with nested parameters")
    extra = sorted(set(params) - COVERED)
    if extra or not {"coef", "cov", "noise_var", "box"} <= set(params):
        raise NeedsTorch(f"{path}: parameters {', '.join(extra) or 'missing'}")
    ids = [str(s) for s in meta["client_ids"]]
    if any(len(v) != len(ids) for v in params.values()):
        raise TensorFileError(path, "parameters do not match its sensor ids")
    return {s: {k: v[i] for k, v in params.items()} for i, s in enumerate(ids)}


def load_station(
    run_dir: Path, folder: Path, method: str, drop_diverged: bool = False
) -> StationFleet:
    """The rest of :func:`fedcal.report.export.load_models` for a fedprior model, without torch
    (module docstring), once ``load_models`` found the run's ``folder`` and its model file:
    the same checks, the same ``excluded`` sensors; :class:`NeedsTorch` for a model it does
    not cover."""
    path = folder / runnames.MODEL
    if not (folder / runnames.PRIOR).is_file():
        raise NeedsTorch(f"{folder}: a run without prior.json (not a fedprior method)")
    prior = PriorModel.load(folder / runnames.PRIOR)
    why = posterior.unsupported(prior)
    if why:
        raise NeedsTorch(f"{folder}: {why}")
    config_path = run_dir / runnames.CONFIG
    data = read_json(config_path).get("data")
    try:
        features = tuple(str(f) for f in data["features"])
        target, column = str(data["target"]), str(data["client_column"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: not a readable fedcal run configuration ({e})") from None
    trees, meta, _ = load_arrays(path)
    check_model_meta(path, meta, len(features))
    check_method(path, meta, method)
    if features != prior.features or target != prior.target:
        raise ValueError(f"{path}: its run's columns do not match its prior.json")
    params = _per_sensor(path, trees, meta)
    width = len(prior.basis.terms) + len(prior.basis.branch_terms)
    if any(p["coef"].shape != (width,) for p in params.values()):
        raise NeedsTorch(f"{path}: coefficients not on prior.json's basis")

    def problem(sensor: str) -> TensorFileError | None:
        if all(np.isfinite(v).all() for v in params[sensor].values()):
            return None
        why = "holds NaN or infinite values (a diverged or tampered model)"
        return TensorFileError(path, f"sensor {sensor!r} {why}")

    excluded = served_sensors(path, params, folder, drop_diverged, problem)
    for sensor, leaves in params.items():  # dtypes, variances, covariances (core/runfiles.py)
        check_model_params(path, sensor, leaves)
    return StationFleet(
        None, params, Scaler.from_dict(meta["scaler"]), features, target, meta["model"], column,
        excluded, prior.basis.terms, prior.basis.branch_terms,
    )  # fmt: skip

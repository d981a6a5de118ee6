"""Firmware export of models linear in a basis: fedprior (± branch), polynomial, fedpoly, leastsq.

Every such method predicts, per unit i and raw input x (F features),

    z = (x − x_offset) / x_scale                       (the run's scaler)
    u = z, or u_j = 2(z_j − lo_ij)/(hi_ij − lo_ij) − 1 (polynomial: its own calibrated span)
    ŷ = y_offset + y_scale · Σ_t c_it ψ_t(u)
    φ_t(u) = Π_j p_{a_tj}(u_j)   (p_n of the method's registered basis family,
                                 fedcal.models.basis.FAMILIES: Legendre P̃_n = √(2n+1)·P_n
                                 by Bonnet's recurrence, or u^n, leastsq's monomials;
                                 the C header takes the family's C form, or refuses)
    ψ_t(u) = φ_t(ū) + Σ_j ∂φ_t/∂u_j(ū)·(u_j − ū_j),  ū = clamp(u, box_lo_i, box_hi_i)

ψ is the extrapolation guard (:func:`fedcal.models.basis.linearized_products`):
ψ = φ inside the unit's support box, its tangent plane at the nearest point of
the box beyond it. fedprior's box is per unit (its ``box`` parameter, scaled
inputs); the polynomial's is |u_j| ≤ 1 + 2·RANGE_MARGIN for every unit; fedpoly
and leastsq have no guard (ψ = φ). For a method with a predictive distribution
(fedprior),

    σ(x) = |y_scale| · √(‖L_iᵀ φ(u)‖² + s_i + g(u)²),   L_i L_iᵀ = Q_i,
    g(u) = Σ_t c_it (φ_t(u) − ψ_t(u))                  (0 inside the box),

with (Q_i, s_i) the unit's predictive covariance of the basis terms and its
additive variance, read from the algorithm's one variance function
(:meth:`fedcal.algorithms.fedprior.FedPrior.variance_form`), never rebuilt here.
A unit whose model states no σ (fedprior's declined interval: s_i is NaN) carries none:
``stated`` marks it, the header's ``fedcal_has_std[sensor]`` is 0 and
``fedcal_calibrate_std`` returns NAN for it by that flag (its constants are written as
0, not NaN), the JSON gives it ``has_sigma: false`` and no factor; when no unit has a σ
the form has none (``FEDCAL_HAS_STD 0``, no σ function).
:func:`linear_form` extracts (terms, coefficients, input map, factor) per method;
:func:`check_form` evaluates that form in NumPy and refuses it unless it equals
the algorithm's own ``predict`` and ``predictive_std`` (so a change of the
model that the form does not carry stops the export, not the firmware);
:func:`fedcal.report.linear_c.c_header` writes the C99 header and :func:`json_block` the JSON.
Precision choices (measured, docs/firmware.md): input scaling, the recurrence
and the sums in double; coefficients stored as double; the factor, the additive
variance and a per-unit support box as float (the polynomial's one box: double).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedcal.models.families import LEGENDRE, basis_family
from fedcal.prior import posterior
from fedcal.report.gp_export import JSON_FORMULA, DeployedSigma, carried, json_unit

# C types of the stages, each overridable with -D at compile time (for the precision study).
STAGES = {
    "FEDCAL_SCALE_T": "double",  # (x − offset)/scale and the polynomial's unit map
    "FEDCAL_BASIS_T": "double",  # the Legendre recurrence / monomial powers and products
    "FEDCAL_SUM_T": "double",  # Σ c_t φ_t and the output scaling
    "FEDCAL_COEF_T": "double",  # stored coefficients
    "FEDCAL_BOX_T": "float",  # stored per-unit support box of the extrapolation guard
    "FEDCAL_STD_T": "float",  # stored factor L, additive variance, and the σ arithmetic
}
TYPE_BYTES = {"double": 8, "float": 4}


@dataclass(frozen=True)
class LinearForm:
    """One run's models as basis terms and per-unit numbers (see the module docstring)."""

    method: str
    basis: str  # a registered basis family (fedcal.models.basis.FAMILIES)
    terms: np.ndarray  # (T, F) int exponents
    coef: np.ndarray  # (S, T) scaled target units
    lo: np.ndarray | None  # (S, F) polynomial's unit map (scaled inputs), else None
    hi: np.ndarray | None
    factor: np.ndarray | None  # (S, T, T) lower-triangular L_i with L_i L_iᵀ = Q_i
    add_var: np.ndarray | None  # (S,) s_i
    sensors: tuple[str, ...]
    # The extrapolation guard's support box (S, F) in the basis's coordinates u (±inf: open),
    # or None (no guard). ``box_per_unit`` False: one box for every unit (the polynomial's).
    box_lo: np.ndarray | None = None
    box_hi: np.ndarray | None = None
    box_per_unit: bool = True
    # (S,) whether unit i states a σ (None: every unit with a factor does)
    stated: np.ndarray | None = None
    # units whose σ is the prior's discrepancy model's (issue 33; report.gp_export), or None
    deployed: DeployedSigma | None = None

    @property
    def has_std(self) -> bool:
        return self.factor is not None

    def states_std(self, unit: int) -> bool:
        """Whether unit ``unit`` has a stated predictive σ (module docstring)."""
        return self.has_std and (self.stated is None or bool(self.stated[unit]))

    @property
    def unstated(self) -> tuple[str, ...]:
        """The units the form gives no σ (their model states none)."""
        if self.stated is None:
            return ()
        return tuple(sid for sid, ok in zip(self.sensors, self.stated, strict=True) if not ok)

    def unit_inputs(self, z: np.ndarray, unit: int) -> np.ndarray:
        """u: scaled inputs z (rows, F) in the basis's coordinates (the polynomial's map)."""
        u = np.asarray(z, float)
        if self.lo is not None:
            lo, hi = self.lo[unit], self.hi[unit]
            span = np.where(hi > lo, hi - lo, 1.0)
            u = 2.0 * (u - lo) / span - 1.0
        return u

    def _basis(self, u: np.ndarray, box: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
        """φ(u), or with ``box`` = (lo, hi) the guarded ψ(u), (rows, T) float64: the family's
        own formula (:meth:`fedcal.models.families.BasisFamily.products` and ``linearized``,
        what the model evaluates): Legendre's on NumPy arrays, another family's through torch."""
        family = basis_family(self.basis)
        terms = [tuple(int(a) for a in t) for t in self.terms]
        u = np.asarray(u, np.float64)
        if family is LEGENDRE:  # array-generic (fedcal.prior.legendre uses it too): no torch
            return (
                family.products(u, terms) if box is None else family.linearized(u, terms, *box)[0]
            )
        import torch

        ut, box = torch.from_numpy(u), [torch.as_tensor(b, dtype=torch.float64) for b in box or ()]
        out = family.products(ut, terms) if not box else family.linearized(ut, terms, *box)[0]
        return out.numpy()

    def features(self, z: np.ndarray, unit: int) -> np.ndarray:
        """φ(u) for scaled inputs z (rows, F) of unit ``unit`` → (rows, T), float64."""
        return self._basis(self.unit_inputs(z, unit), None)

    def guarded(self, z: np.ndarray, unit: int) -> np.ndarray:
        """ψ(u) = φ(ū) + J_φ(ū)(u − ū), ū = clamp(u, box): φ inside the box (rows, T)."""
        u = self.unit_inputs(z, unit)
        if self.box_lo is None:
            return self.features(z, unit)
        row = unit if self.box_per_unit else 0
        return self._basis(u, (self.box_lo[row], self.box_hi[row]))

    def evaluate(self, z: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(ŷ, σ) in scaled target units at scaled inputs z (rows, F)."""
        psi = self.guarded(z, unit)
        mean = psi @ self.coef[unit]
        if not self.has_std:
            return mean, None
        if not self.states_std(unit):  # no σ stated for this unit: NaN, as predictive_std
            return mean, np.full(len(mean), np.nan)
        phi = self.features(z, unit)
        w = phi @ self.factor[unit]  # rows of Lᵀφ
        gap = phi @ self.coef[unit] - mean  # g: the polynomial minus its continuation
        var = (w * w).sum(1) + self.add_var[unit]
        if self.deployed is not None and self.deployed.rows[unit] >= 0:
            var = self.deployed.variance(self.deployed.rows[unit], z, phi)  # (factor is 0)
        return mean, np.sqrt(var + gap * gap)

    def bytes_per_unit(self, with_range: bool = True) -> int:
        """Flash bytes of one unit's constants in the C header (not the sensor id string)."""
        t, f = self.terms.shape
        size = t * TYPE_BYTES[STAGES["FEDCAL_COEF_T"]]
        if self.lo is not None:
            size += 2 * f * TYPE_BYTES[STAGES["FEDCAL_SCALE_T"]]
        if self.box_lo is not None and self.box_per_unit:
            size += 2 * f * TYPE_BYTES[STAGES["FEDCAL_BOX_T"]]
        if self.has_std:
            size += (t * (t + 1) // 2 + 1) * TYPE_BYTES[STAGES["FEDCAL_STD_T"]]
            size += 1  # fedcal_has_std: whether the unit states a σ
        if self.deployed is not None:
            size += 2  # fedcal_gp_row (a deployed unit adds deployed.bytes_per_unit())
        if with_range:
            size += (2 * f + 2) * 4  # x_min, x_max, y_min, y_max (float)
            size += 2 * f * 8  # in_range's widened bounds range_lo, range_hi (double: exact)
        return size


def _factor(q: np.ndarray) -> np.ndarray:
    """Lower-triangular L with L Lᵀ = Q (Cholesky; a PSD Q that is singular gets a 1e-14
    relative jitter on its diagonal — a change of σ² far below the 1 % the export keeps)."""
    q = 0.5 * (q + q.T)
    try:
        return np.linalg.cholesky(q)
    except np.linalg.LinAlgError:
        jitter = 1e-14 * max(float(np.trace(q)), 1e-300)
        return np.linalg.cholesky(q + jitter * np.eye(len(q)))


def linear_form(fleet, method: str = "") -> LinearForm | None:
    """The basis form of a run's models, or None when the method is not linear in a basis.

    ``fleet`` is a :class:`fedcal.report.fleet.CalibratedFleet`; one evaluated in NumPy
    (:class:`fedcal.report.served.StationFleet`, no torch) gives its fedprior form from
    :func:`fedcal.prior.posterior.variance_form`, the same (Q, s).
    """
    if fleet.algorithm is None and hasattr(fleet, "units"):  # report/served.py: NumPy
        sensors = tuple(sorted(fleet.params))
        units = fleet.units(list(sensors))
        p = len(fleet.terms)
        coef = np.zeros_like(units.coef)
        coef[:, :p] = units.coef[:, :p]  # the branch average: h does not enter ŷ
        q, add_var = posterior.variance_form(units)
        gp = {} if units.gp is None else {**units.gp, "noise_var": units.noise_var}
        q, add_var, deployed = carried(gp, q, add_var)  # issue 33: prior/deployment.py
        parts = (LEGENDRE.name, [*fleet.terms, *fleet.branch_terms], coef, q, add_var, deployed)
        return _form(method, sensors, *parts, units.box[:, 0], units.box[:, 1])
    import torch

    from fedcal.algorithms.fedpoly import FedPoly
    from fedcal.algorithms.fedprior import FedPrior
    from fedcal.algorithms.leastsq import LeastSquares
    from fedcal.algorithms.polynomial import RANGE_MARGIN, PolynomialCalibration
    from fedcal.core.tree import stack

    alg = fleet.algorithm
    sensors = tuple(sorted(fleet.params))
    params = {k: v.to(torch.float64) for k, v in stack([fleet.params[s] for s in sensors]).items()}
    lo = hi = q = add_var = box_lo = box_hi = deployed = None
    per_unit = True
    if isinstance(alg, FedPrior):
        basis = LEGENDRE.name
        terms = [*alg.terms, *alg.branch_terms]
        p = len(alg.terms)
        coef = np.zeros((len(sensors), len(terms)))
        coef[:, :p] = params["coef"][:, :p].numpy()  # the branch average: h does not enter ŷ
        q, s = alg.variance_form(params)
        q, add_var, deployed = carried(params, q, s)  # the discrepancy model's σ (issue 33)
        if "box" in params:  # the guard's box (scaled inputs); a model saved before: none
            box_lo, box_hi = params["box"][:, 0].numpy(), params["box"][:, 1].numpy()
    elif isinstance(alg, PolynomialCalibration):
        basis, terms = LEGENDRE.name, [tuple(t) for t in alg.exponents.tolist()]
        coef = params["coef"].numpy()
        lo, hi = params["lo"].numpy(), params["hi"].numpy()
        edge = np.full((1, lo.shape[-1]), 1.0 + 2 * RANGE_MARGIN)  # in u: every unit's box
        box_lo, box_hi, per_unit = -edge, edge, False
    elif isinstance(alg, FedPoly):
        basis, terms = LEGENDRE.name, [*alg.private_terms, *alg.shared_terms]
        coef = torch.cat([params["private"], params["shared"]], -1).numpy()
    elif isinstance(alg, LeastSquares):
        basis, terms = alg.family, [tuple(t) for t in alg.exponents.tolist()]
        coef = params["coef"].numpy()
    else:
        return None
    return _form(
        method or getattr(alg, "name", ""), sensors, basis, terms, coef, q, add_var, deployed,
        box_lo, box_hi, lo, hi, per_unit,
    )  # fmt: skip


def _form(
    method: str, sensors: tuple[str, ...], basis: str, terms: list, coef: np.ndarray,
    q: np.ndarray | None, add_var: np.ndarray | None, deployed: DeployedSigma | None,
    box_lo: np.ndarray | None, box_hi: np.ndarray | None, lo: np.ndarray | None = None,
    hi: np.ndarray | None = None, per_unit: bool = True,
) -> LinearForm:  # fmt: skip
    """The :class:`LinearForm` of a method's numbers: the used terms, the σ factor."""
    factor = stated = None
    # Terms no unit uses (a basis chosen by the fleet's evidence zeroes the others) are dropped.
    used = np.any(coef != 0, 0) | np.isnan(coef).any(0)
    if factor is None and add_var is not None:
        used |= np.any(q != 0, (0, 1))
        if deployed is not None:
            used |= deployed.used_terms
            deployed = deployed.subset(used)
        q = q[:, used][:, :, used]
        stated = np.isfinite(add_var) & np.isfinite(q).all((1, 2))
        if not stated.any():  # no unit states a σ: the form has none (module docstring)
            add_var, stated = None, None
        else:
            factor = np.stack(
                [
                    _factor(qi) if ok and qi.any() else np.zeros_like(qi)
                    for qi, ok in zip(q, stated, strict=True)
                ]
            )
            add_var = np.where(stated, add_var, 0.0)
            stated = None if stated.all() else stated
    return LinearForm(
        method,
        basis,
        np.asarray(terms, dtype=int)[used].reshape(-1, len(terms[0]) if terms else 0),
        coef[:, used],
        lo,
        hi,
        factor,
        add_var,
        sensors,
        box_lo,
        box_hi,
        per_unit,
        stated,
        deployed,
    )


def probe_points(fleet, valid_range: dict | None, sensor: str, rows: int = 64) -> np.ndarray:
    """Raw inputs spread over a unit's calibrated span and 10 % beyond (or the scaler's range)."""
    span = (valid_range or {}).get(sensor)
    if span:
        lo = np.array([span[c][0] for c in fleet.features], float)
        hi = np.array([span[c][1] for c in fleet.features], float)
    else:
        lo, hi = (
            fleet.scaler.x_offset - fleet.scaler.x_scale,
            fleet.scaler.x_offset + fleet.scaler.x_scale,
        )
    u = np.random.default_rng(0).uniform(-0.1, 1.1, (rows, len(lo)))
    return lo + u * (hi - lo)


def check_form(fleet, form: LinearForm, valid_range: dict | None = None) -> None:
    """Refuse a form that does not reproduce the algorithm's own predict / predictive_std.

    Every unit at 64 probe points (its calibrated span and 10 % beyond), all units
    in one batched call of the algorithm: ŷ to 1e-9 of the output scale, σ to 1e-9
    relative (both float64); a unit whose model is NaN (a refused polynomial) must
    be NaN in both.
    """
    s = fleet.scaler
    z = np.stack([s.x(probe_points(fleet, valid_range, sid)) for sid in form.sensors])
    want, want_std = _model_values(fleet, form, z)
    none_stated = want_std is None or not bool(np.isfinite(want_std).any())
    if none_stated != (not form.has_std):
        raise ValueError(f"{form.method}: the form and the model disagree on having a σ")
    tol = 1e-9
    for i, sensor in enumerate(form.sensors):
        mean, std = form.evaluate(z[i], i)
        if not np.allclose(mean, want[i], rtol=0, atol=tol, equal_nan=True):
            gap = float(np.nanmax(np.abs(mean - want[i])) * np.abs(s.y_scale).max())
            raise ValueError(
                f"{form.method}: the exported basis form of sensor {sensor} differs from the "
                f"model's predict by {gap:.3g}: not exported"
            )
        if std is not None and want_std is not None:
            ref = want_std[i]
            if not np.allclose(std, ref, rtol=tol, atol=0, equal_nan=True):
                raise ValueError(
                    f"{form.method}: the exported σ of sensor {sensor} differs from the model's "
                    "predictive_std (a variance term outside variance_form?): not exported"
                )


def _model_values(fleet, form: LinearForm, z: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(ŷ, σ or None) of the model itself at scaled inputs ``z`` (units, rows, F), scaled:
    the algorithm's ``predict``/``predictive_std`` (torch), or for a NumPy-evaluated fleet
    (report/served.py) :func:`fedcal.prior.posterior.predict` / ``predictive_std``."""
    if fleet.algorithm is None and hasattr(fleet, "units"):
        units = fleet.units(list(form.sensors))
        return posterior.predict(units, z), posterior.predictive_std(units, z)
    import torch

    from fedcal.core.tree import stack

    params = {
        k: v.to(torch.float64)
        for k, v in stack([fleet.params[sid] for sid in form.sensors]).items()
    }
    zt = torch.as_tensor(z, dtype=torch.float64)
    with torch.no_grad():
        want = fleet.algorithm.predict(params, zt)[..., 0].double().numpy()
        method = getattr(fleet.algorithm, "predictive_std", None)
        std = method(params, zt) if method is not None else None
    return want, None if std is None else std[..., 0].double().numpy()


def json_block(fleet, form: LinearForm) -> dict:
    """The JSON ``model`` of a linear-in-basis run: everything that rebuilds ŷ and σ."""
    s = fleet.scaler
    out = {
        "family": "linear_basis",
        "method": form.method,
        "basis": form.basis,
        "normalization": basis_family(form.basis).normalization,
        "formula": (
            "z = (x - scaler.x_offset) / scaler.x_scale; "
            + (
                "u = 2 (z - unit.u_lo) / (unit.u_hi - unit.u_lo) - 1; "
                if form.lo is not None
                else "u = z; "
            )
            + "phi_t(u) = prod_j basis_{terms[t][j]}(u_j); "
            + (
                "ub = clamp(u, unit.box_lo, unit.box_hi) (null: no bound); "
                "psi_t = phi_t(ub) + sum_j (u_j - ub_j) * basis'_{terms[t][j]}(ub_j) "
                "* prod_{k != j} basis_{terms[t][k]}(ub_k) "
                "(basis' = d/du: P'_{n+1} = P'_{n-1} + (2n+1) P_n, times sqrt(2n+1)); "
                if form.box_lo is not None
                else "psi_t = phi_t(u); "
            )
            + "y = scaler.y_offset + scaler.y_scale * sum_t unit.coef[t] * psi_t"
            + (
                "; g = sum_t unit.coef[t] * (phi_t(u) - psi_t); sigma = |scaler.y_scale| * "
                "sqrt(|unit.cov_factor^T phi(u)|^2 + unit.var_add + g^2) "
                "(units with has_sigma false state no sigma)"
                if form.has_std
                else ""
            )
            + (JSON_FORMULA if form.deployed is not None else "")
        ),
        "terms": form.terms.tolist(),
        "bytes_per_unit": form.bytes_per_unit(),
        **(
            {"bytes_per_deployed_unit": form.deployed.bytes_per_unit()}
            if form.deployed is not None
            else {}
        ),
        "x_offset": np.asarray(s.x_offset, float).tolist(),
        "x_scale": np.asarray(s.x_scale, float).tolist(),
        "y_offset": float(np.asarray(s.y_offset).ravel()[0]),
        "y_scale": float(np.asarray(s.y_scale).ravel()[0]),
        "units": {},
    }
    for i, sid in enumerate(form.sensors):
        unit: dict = {"coef": form.coef[i].tolist()}
        if form.lo is not None:
            unit["u_lo"], unit["u_hi"] = form.lo[i].tolist(), form.hi[i].tolist()
        if form.box_lo is not None:
            row = i if form.box_per_unit else 0
            unit["box_lo"] = [None if math.isinf(v) else v for v in form.box_lo[row].tolist()]
            unit["box_hi"] = [None if math.isinf(v) else v for v in form.box_hi[row].tolist()]
        if form.has_std:
            unit["has_sigma"] = form.states_std(i)
        if form.deployed is not None and form.deployed.rows[i] >= 0:
            unit["sigma_deployed"] = json_unit(form.deployed, int(form.deployed.rows[i]))
        elif form.states_std(i):
            unit["cov_factor"] = form.factor[i].tolist()
            unit["var_add"] = float(form.add_var[i])
        out["units"][sid] = unit
    return out

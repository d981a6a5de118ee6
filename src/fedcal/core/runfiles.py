"""Schemas of the JSON a run folder holds: checked at load, before any number is used.

``prior.json`` (the fleet prior of ``fedcal calibrate``), ``valid_range.json``
(each sensor's calibrated span) and the metadata of ``model.safetensors`` (its
scaler and sensor ids) are written by fedcal but read back from a folder anyone
may have edited. Each is validated with pydantic (typed, finite numbers, no
coercion) and then for what the types cannot say: lengths that agree, a
covariance that is symmetric positive definite, a positive noise level, spans
with min ≤ max, magnitudes a prior in scaled units can hold (:data:`MAX_MEAN`,
:data:`MAX_VARIANCE`). A problem is a :class:`RunFileError`: one line naming the
file and the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedcal.core.paths import safe_name
from fedcal.core.schema import message

Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # "0.1" is no number
Positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Text = Annotated[str, Field(strict=True, min_length=1, max_length=200)]
MAX_TERMS = 4096  # a basis of more terms than this is no fedcal prior
# Plausible magnitudes in scaled units (target and inputs scaled to O(1)): an honest prior
# holds |μ| ≤ 16, σ² ≤ 0.3 and Σ's eigenvalues ≤ 1.2e5 (the largest seen: the gas
# network's 45 terms of 8 correlated inputs; the simulator's ≤ 1); 1e300 is an edit.
MAX_MEAN = 1e6
MAX_VARIANCE = 1e8  # Σ's eigenvalues, σ², τ², a² (scaled target units squared)
MAX_ROWS = 10**9  # a count of calibration rows


class RunFileError(ValueError):
    """A run-folder file that cannot be used; ``str()`` is ``"<file>: <field>: <problem>"``."""


def _fail(path: str | Path, err: ValidationError) -> RunFileError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    more = len(err.errors()) - 1
    tail = f" (and {more} more problem(s))" if more else ""
    return RunFileError(f"{path}: {loc}: {message(first)}{tail}")


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class ScalerDoc(_Doc):
    x_offset: list[Finite] = Field(min_length=1)
    x_scale: list[Finite] = Field(min_length=1)
    y_offset: list[Finite] = Field(min_length=1, max_length=1)
    y_scale: list[Finite] = Field(min_length=1, max_length=1)
    sources: dict[str, str] = Field(default_factory=dict)


NonNegative = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


Variance = Annotated[float, Field(strict=True, ge=0, le=MAX_VARIANCE, allow_inf_nan=False)]


class IntervalDoc(_Doc):
    """``interval`` of a calibrated-interval prior (fedprior I1–I4): what a new unit reads."""

    discrepancy_var: Annotated[float, Field(strict=True)]  # NaN: none learned (declined)
    probe_rows: Annotated[float, Field(strict=True, ge=0, le=MAX_ROWS)]  # 0: no probe
    declined: Annotated[int, Field(strict=True, ge=0)]
    weak_projector: list[list[Finite]] | None = None
    discrepancy_var_own: Variance | None = None  # null: no τ² covered (declined)


class IdentificationDoc(BaseModel):
    """``identification`` (:meth:`fedcal.algorithms.fedprior.FedPrior.identification`):
    the effective count of units informing each direction, the weak terms, their number."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    informed_units: list[Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]]
    weak_terms: list[Text]
    weak_directions: Annotated[int, Field(strict=True, ge=0, le=MAX_TERMS)]


class ShortDoc(_Doc):
    """``drift.short``: a short co-location's learned weight, walk rate and τ² (fedprior_short)."""

    window: Positive
    temper: Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)]
    q: NonNegative
    tau: NonNegative | None  # null: no interval for the short class
    held: Positive


class DriftDoc(_Doc):
    """``drift`` of a fedprior_drift prior: the walk's variance and time scale."""

    q: NonNegative
    time_scale: NonNegative
    seen: list[list[Finite]]
    short: ShortDoc | None = None


class PriorDoc(_Doc):
    kind: Literal["fedprior"]
    method: Text
    method_params: dict[str, Any]
    # what rebuilds the basis: read when present, so typed here (no coercion)
    selection: dict[str, Any] | None = None
    features: list[Text] = Field(min_length=1)
    target: Text
    terms: list[list[Annotated[int, Field(strict=True, ge=0)]]] = Field(
        min_length=1, max_length=MAX_TERMS
    )
    branch_terms: list[list[Annotated[int, Field(strict=True, ge=0)]]] = Field(
        default_factory=list, max_length=MAX_TERMS
    )
    mu: list[Annotated[float, Field(strict=True, ge=-MAX_MEAN, le=MAX_MEAN, allow_inf_nan=False)]]
    sigma: list[list[Finite]]
    noise_var: Annotated[float, Field(strict=True, gt=0, le=MAX_VARIANCE, allow_inf_nan=False)]
    scaler: ScalerDoc
    input_range: dict[str, list[Finite]]
    interval: IntervalDoc | None = None
    drift: DriftDoc | None = None
    identification: IdentificationDoc | None = None
    noise_prior_points: NonNegative | None = None
    noise_student: Annotated[int, Field(strict=True, ge=0, le=1)] | None = None
    # σ²(x) = σ² exp(γᵀx), x scaled: |γ| ≤ 100 keeps exp finite (an honest fit: |γ| ~ 1)
    noise_gamma: list[Annotated[float, Field(strict=True, ge=-100, le=100)]] | None = None


def _check_scaler(path: str | Path, scaler: ScalerDoc, features: int, where: str) -> None:
    if len(scaler.x_offset) != features or len(scaler.x_scale) != features:
        raise RunFileError(
            f"{path}: {where}.x_offset/x_scale: {len(scaler.x_offset)}/{len(scaler.x_scale)} "
            f"values for {features} feature(s)"
        )
    if any(s == 0 for s in [*scaler.x_scale, *scaler.y_scale]):
        raise RunFileError(f"{path}: {where}: a scale of 0 (division by zero)")


def _check_span(path: str | Path, field: str, span: list[float]) -> None:
    if len(span) != 2 or span[0] > span[1]:
        raise RunFileError(f"{path}: {field}: expected [min, max] with min <= max, got {span!r}")


def _check_sigma(path: str | Path, sigma: np.ndarray) -> None:
    """Σ symmetric positive definite, its eigenvalues ≤ :data:`MAX_VARIANCE` (an entry
    above it implies one: |Σ_jk| ≤ √(Σ_jj Σ_kk) ≤ λ_max; checked first, before eigvalsh
    could overflow)."""
    scale = float(np.abs(sigma).max()) or 1.0
    if scale > MAX_VARIANCE:
        raise RunFileError(
            f"{path}: sigma: an entry of {scale:.3g} (> {MAX_VARIANCE:g} in scaled units): "
            "not a fleet prior's covariance"
        )
    if not np.allclose(sigma, sigma.T, rtol=0.0, atol=1e-9 * scale):
        raise RunFileError(f"{path}: sigma: not symmetric")
    values = np.linalg.eigvalsh(sigma)
    if float(values.min()) <= 0.0:
        raise RunFileError(f"{path}: sigma: not positive definite")
    if float(values.max()) > MAX_VARIANCE:
        raise RunFileError(
            f"{path}: sigma: an eigenvalue of {float(values.max()):.3g} (> {MAX_VARIANCE:g} "
            "in scaled units): not a fleet prior's covariance"
        )


def _check_interval(path: str | Path, interval: IntervalDoc) -> None:
    """τ² NaN (declined) or in [0, :data:`MAX_VARIANCE`]; the probe's rows a count."""
    tau = interval.discrepancy_var
    if not (math.isnan(tau) or 0.0 <= tau <= MAX_VARIANCE):
        raise RunFileError(
            f"{path}: interval.discrepancy_var: a variance must be NaN (declined) or in "
            f"[0, {MAX_VARIANCE:g}], got {tau}"
        )
    if not float(interval.probe_rows).is_integer():
        raise RunFileError(
            f"{path}: interval.probe_rows: expected a whole number of rows, "
            f"got {interval.probe_rows}"
        )


def check_prior(path: str | Path, raw: Any) -> dict[str, Any]:
    """``raw`` (the parsed prior.json) if it is a usable fleet prior, else a RunFileError.

    Σ must be symmetric positive definite: the posterior of a new unit inverts it
    (:meth:`fedcal.algorithms.fedprior.FedPrior.personalize`).
    """
    if not isinstance(raw, dict):
        raise RunFileError(f"{path}: not a fleet prior (expected a JSON object)")
    try:
        doc = PriorDoc.model_validate(raw)
    except ValidationError as err:
        raise _fail(path, err) from None
    try:
        safe_name(doc.method, f"{path}: method")
    except ValueError as err:
        raise RunFileError(str(err)) from None
    p = len(doc.terms) + len(doc.branch_terms)
    if len(doc.mu) != p:
        raise RunFileError(f"{path}: mu: {len(doc.mu)} values for {p} basis term(s)")
    if len(doc.sigma) != p or any(len(row) != p for row in doc.sigma):
        raise RunFileError(f"{path}: sigma: expected a {p}×{p} matrix")
    _check_sigma(path, np.asarray(doc.sigma, float))
    if doc.interval is not None:
        _check_interval(path, doc.interval)
    nf = len(doc.features)
    if any(len(t) != nf for t in [*doc.terms, *doc.branch_terms]):
        raise RunFileError(f"{path}: terms: each term needs one exponent per feature ({nf})")
    if doc.noise_gamma is not None and len(doc.noise_gamma) != nf:
        raise RunFileError(f"{path}: noise_gamma: expected {nf} value(s), one per feature")
    _check_scaler(path, doc.scaler, nf, "scaler")
    unknown = sorted(set(doc.input_range) - set(doc.features))
    if unknown:
        raise RunFileError(f"{path}: input_range: unknown column(s) {', '.join(unknown)}")
    for col, span in doc.input_range.items():
        _check_span(path, f"input_range.{col}", span)
    return raw


def check_valid_ranges(path: str | Path, raw: Any) -> dict[str, dict[str, list[float]]]:
    """``raw`` (the parsed valid_range.json: {sensor: {column: [min, max]}}), checked."""
    if not isinstance(raw, dict):
        raise RunFileError(f"{path}: expected a JSON object {{sensor: {{column: [min, max]}}}}")
    for sensor, columns in raw.items():
        if not isinstance(columns, dict):
            raise RunFileError(f"{path}: {sensor}: expected an object {{column: [min, max]}}")
        for col, span in columns.items():
            field = f"{sensor}.{col}"
            if not (
                isinstance(span, list)
                and all(isinstance(v, int | float) and not isinstance(v, bool) for v in span)
                and np.isfinite(np.asarray(span, float)).all()
            ):
                raise RunFileError(f"{path}: {field}: expected two finite numbers, got {span!r}")
            _check_span(path, field, span)
    return raw


def check_model_meta(path: str | Path, meta: dict[str, Any], features: int) -> None:
    """The metadata of a model file: its scaler and its sensor ids (unique, named safely)."""
    try:
        scaler = ScalerDoc.model_validate(meta.get("scaler"))
    except ValidationError as err:
        raise _fail(path, err) from None
    _check_scaler(path, scaler, features, "scaler")
    ids = meta.get("client_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise RunFileError(f"{path}: client_ids: expected a list of sensor ids")
    if len(set(ids)) != len(ids):
        raise RunFileError(f"{path}: client_ids: a sensor id appears twice")


MODEL_DTYPES = ("torch.float32", "torch.float64")  # what fedcal writes; int64 is no model


def _check_covariance(where: str, name: str, cov: np.ndarray) -> None:
    """``cov`` (…, p, p): symmetric, a variance ≥ 0 on its diagonal, a zero variance only
    on a zero row and column (a term outside the unit's selected basis: fedprior's BIC), and
    the rest positive definite up to rounding (an eigenvalue ≥ −1e-8 of the largest: the
    computed posterior rounds a near-null direction to ±1e-19 of it)."""
    if cov.ndim < 2 or cov.shape[-1] != cov.shape[-2]:
        raise RunFileError(f"{where}: {name}: expected square matrices, got {cov.shape}")
    scale = max(float(np.abs(cov).max(initial=0.0)), np.finfo(float).tiny)
    if not np.allclose(cov, np.swapaxes(cov, -1, -2), rtol=0.0, atol=1e-9 * scale):
        raise RunFileError(f"{where}: {name}: covariance not symmetric")
    for matrix in cov.reshape(-1, *cov.shape[-2:]):
        diag = np.diagonal(matrix)
        if not (diag >= 0).all():
            raise RunFileError(f"{where}: {name}: a negative variance on its diagonal")
        unused = diag == 0
        if np.abs(matrix[unused]).max(initial=0.0) > 0:
            raise RunFileError(f"{where}: {name}: a zero variance with a non-zero covariance")
        used = matrix[np.ix_(~unused, ~unused)]
        if used.size and float(np.linalg.eigvalsh(used).min()) < -1e-8 * scale:
            raise RunFileError(f"{where}: {name}: covariance not positive definite")


# A deployed unit's discrepancy terms (fedcal.algorithms.fedprior_deployed.deploy_shapes):
# leaf → (lowest, highest, lowest allowed, what it is). κ²s²(t/1.96)² > 0; a² ≥ 0 (0: the
# unit does not use D2–D4); β > 0; ℓ in [1e-3, 1e3] scaled inputs (the fitted grid: 0.03–2);
# the design rows' mask 0 or 1 (checked apart).
GP_BOUNDS = {
    "gp_scale": (0.0, math.inf, False, "a σ scale factor κ²s²(t/1.96)²"),
    "gp_amp": (0.0, MAX_VARIANCE, True, "a discrepancy variance a²"),
    "gp_beta": (0.0, 1e3, False, "a basis-variance factor β"),
    "gp_len": (1e-3, 1e3, True, "a length scale ℓ (scaled inputs)"),
}


def _check_gp(where: str, name: str, leaf: str, values: np.ndarray) -> None:
    """A deployed unit's D2–D4 terms in their ranges (:data:`GP_BOUNDS`), its mask 0/1."""
    if leaf == "gp_mask":
        if not np.isin(values, (0.0, 1.0)).all():
            raise RunFileError(f"{where}: {name}: a design-row mask other than 0 or 1")
        return
    lo, hi, closed, what = GP_BOUNDS[leaf]
    low_ok = values >= lo if closed else values > lo
    if not (low_ok & (values <= hi)).all():
        bad = float(values[~(low_ok & (values <= hi))].reshape(-1)[0])
        span = f"{'[' if closed else '('}{lo:g}, {hi:g}{']' if hi < math.inf else ')'}"
        raise RunFileError(
            f"{where}: {name}: {what} of {bad:.3g}, outside {span}: an edited or broken model"
        )


def check_model_params(path: str | Path, sensor: str, leaves: dict[str, Any]) -> None:
    """One sensor's parameters of a model file (flat ``{name: tensor}``), beyond finiteness
    (:func:`fedcal.core.tensorfile.check_finite`): floating point, positive noise
    variances, non-negative other variances, positive-definite covariances (``cov``,
    ``*_cov``) — what prior.json's Σ and σ² are held to (:func:`check_prior`) — and a
    deployed unit's discrepancy terms in range (:func:`_check_gp`)."""
    where = f"{path}: sensor {sensor!r}"
    for name, tensor in leaves.items():  # torch tensors, or NumPy arrays (report/served.py)
        kind = str(tensor.dtype).removeprefix("torch.")
        if f"torch.{kind}" not in MODEL_DTYPES:
            raise RunFileError(f"{where}: {name}: dtype {kind}, expected float32 or float64")
        leaf = name.rsplit("/", 1)[-1]
        detached = tensor.detach() if hasattr(tensor, "detach") else tensor
        values = np.asarray(detached, dtype=np.float64)
        if leaf.endswith("noise_var") and not (values > 0).all():
            raise RunFileError(f"{where}: {name}: a noise variance <= 0")
        if leaf.endswith("_var") and not (values >= 0).all():
            raise RunFileError(f"{where}: {name}: a variance < 0")
        if leaf == "cov" or leaf.endswith("_cov"):
            _check_covariance(where, name, values)
        if leaf in GP_BOUNDS or leaf == "gp_mask":
            _check_gp(where, name, leaf, values)

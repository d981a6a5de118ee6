"""The fitted fleet prior as a value, and its one versioned file (``prior.json``).

A fedprior run ends with a fleet prior over a unit's coefficients c (and, with a
direction term, h on the terms b·ψ):

    (c, h) ~ N(μ, Σ),   y = φ(x)ᵀc + b·ψ(x)ᵀh + ε,   ε ~ N(0, σ²)

(:mod:`fedcal.algorithms.fedprior`, "Model"). :class:`PriorModel` holds what a new
unit is calibrated against — μ, Σ, the noise model, the basis, the scaler, the input
range the fleet was calibrated over — plus what the run learned about its intervals
(:class:`IntervalPart`), the basis it chose (:class:`SelectionRecord`), the drift of
a fedprior_drift prior (:class:`DriftPart`) and where it came from
(:class:`Provenance`). ``calibrate``, ``plan``, the API and the exports take this
value; none reads keys of a dictionary.

The file. :meth:`PriorModel.save` writes ``prior.json`` with ``format_version``
(:data:`FORMAT_VERSION`); :meth:`PriorModel.load` reads it and files without one
(version 1: what fedcal wrote before the version existed, the same layout), and
refuses a newer version with a line saying how to re-train. Loading validates: the
schema, shapes and magnitudes of :func:`fedcal.core.runfiles.check_prior` (finite
numbers, |μ| and Σ's eigenvalues, σ², τ² within plausible bounds in scaled units, Σ
symmetric positive definite, σ² > 0, lengths that agree with the terms, the noise
model's numbers, the identification record's schema), then the parts that check does
not type (the weak-direction projector's shape, pinned direction terms among the
direction terms) and known parts only. A problem is one line naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from fedcal.core.atomic import write_text
from fedcal.core.paths import read_json
from fedcal.core.runfiles import RunFileError, check_prior
from fedcal.data.scaling import Scaler
from fedcal.models.families import FAMILIES, LEGENDRE

FORMAT_VERSION = 2  # 1: no format_version key (fedcal before the value); 2: this module
KIND = "fedprior"
BASIS_FAMILIES = FAMILIES  # the registered basis families (fedcal.models.basis.FAMILIES)
RETRAIN = "re-train the prior with this fedcal (`fedcal run --methods fedprior ...`)"
# Every part a prior.json may hold (v1 and v2); anything else is refused.
# fmt: off
KNOWN = frozenset((
    "format_version", "kind", "created_by", "basis_family", "terms", "term_names", "mu",
    "sigma", "noise_var", "noise", "noise_prior_points", "identification", "noise_gamma",
    "noise_student", "interval", "branch_terms", "branch_term_names", "branch_pinned",
    "selection", "drift", "discrepancy", "method", "method_params", "features", "target",
    "sensor_column", "scaler", "input_range", "num_units", "design_counts",
))
# fmt: on


def created_by() -> str:
    """ "fedcal <version>" of the installed package (provenance of a trained prior)."""
    try:
        return f"fedcal {metadata.version('fedcal')}"
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "fedcal (version unknown)"


def _frozen(a: Any) -> np.ndarray:
    out = np.array(a, dtype=float)
    out.flags.writeable = False
    return out


@dataclass(frozen=True)
class Basis:
    """The prior's basis: φ's terms (one exponent per input) and the direction terms ψ.

    ``pinned``: direction terms out of the model (μ = 0, Σ at its floor, uncoupled:
    :meth:`fedcal.algorithms.fedprior_pins.BranchPins.unidentified`).
    """

    family: str
    terms: tuple[tuple[int, ...], ...]
    term_names: tuple[str, ...] | None
    branch_terms: tuple[tuple[int, ...], ...] = ()
    branch_term_names: tuple[str, ...] = ()
    pinned: tuple[tuple[int, ...], ...] = ()

    @property
    def size(self) -> int:
        return len(self.terms) + len(self.branch_terms)

    def names(self) -> list[str]:
        """Every coefficient's name: φ's terms then b·ψ's."""
        own = list(self.term_names) if self.term_names else [str(list(t)) for t in self.terms]
        return own + list(self.branch_term_names)


@dataclass(frozen=True)
class NoiseModel:
    """σ² (scaled units) and its form: one fleet level or per sensor with ν prior points;
    σ² exp(γᵀx) over the inputs (``gamma``); Student-t rows (``student`` = 1)."""

    variance: float
    kind: str | None = None  # "sensor" | "fleet"
    prior_points: float | None = None
    gamma: tuple[float, ...] | None = None
    student: int | None = None


@dataclass(frozen=True)
class IntervalPart:
    """A calibrated interval's hold-out result (fedprior "Intervals", I1–I4): τ², the probe's
    rows, whether the fleet declined (and why), I3's weak-direction projector, I4's τ²."""

    rule: str
    discrepancy_var: float  # NaN: none learned (declined)
    probe_rows: float  # 0 / NaN: no probe
    declined: int
    reason: str = ""
    residual_dof: float | None = None
    weak_projector: np.ndarray | None = None
    discrepancy_var_own: float | None = None  # None: no τ² covered (declined)
    has_own: bool = False  # the key was written (None is a value of it)


@dataclass(frozen=True)
class SelectionRecord:
    """The basis the fleet chose (``chosen``: parameters that rebuild it) and each
    candidate's score; ``rule`` "bic"/…, or "identification" (direction term dropped)."""

    rule: str
    chosen: dict[str, Any]
    candidates: tuple[dict[str, Any], ...] | None = None
    scores: tuple[float, ...] | None = None
    forward: dict[str, Any] | None = None  # fedprior_choice's forward scores, as written


@dataclass(frozen=True)
class ShortPart:
    """A short co-location's learned weight, walk rate and τ² (fedprior_short, S1–S4)."""

    window: float
    temper: float
    q: float
    tau: float | None
    held: float


@dataclass(frozen=True)
class DriftPart:
    """fedprior_drift: a random walk of the coefficients, variance q·|t − t_i|·Σ/T."""

    q: float
    time_scale: float
    seen: np.ndarray
    model: str = ""
    rate_per_time: float | None = None
    recalibrate_ratio: float | None = None
    fit: str | None = None
    prior: str | None = None
    short: ShortPart | None = None
    note: str | None = None


@dataclass(frozen=True)
class Provenance:
    """Who trained it and on what: the method and its settings, the fleet's size, how
    many units had each number of calibration points, fedcal's version, the file's."""

    method: str
    method_params: dict[str, Any]
    num_units: int | None = None
    design_counts: dict[str, int] | None = None  # {points: units}
    created_by: str | None = None
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True, eq=False)
class PriorModel:
    """The fitted fleet prior (module docstring): what training produces and saves, and
    what ``calibrate``, ``plan``, the API and the exports consume. Two are equal when
    their files are (every number bit for bit)."""

    mean: np.ndarray  # μ, (p,) scaled target units
    covariance: np.ndarray  # Σ, (p, p) symmetric positive definite
    noise: NoiseModel
    basis: Basis
    scaler: Scaler
    input_range: dict[str, tuple[float, float]]
    features: tuple[str, ...]
    target: str
    sensor_column: str
    provenance: Provenance
    interval: IntervalPart | None = None
    selection: SelectionRecord | None = None
    drift: DriftPart | None = None
    identification: dict[str, Any] | None = None
    discrepancy: dict[str, Any] | None = None  # sigma's part (prior/discrepancy.py), carried

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PriorModel):
            return NotImplemented
        return json.dumps(self.to_dict()) == json.dumps(other.to_dict())

    __hash__ = None  # type: ignore[assignment]  # holds arrays and dicts: not hashable

    @property
    def method(self) -> str:
        return self.provenance.method

    @property
    def num_units(self) -> int | None:
        return self.provenance.num_units

    # ---- the file ----------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> PriorModel:
        """The prior in ``path`` (module docstring: versions, validation)."""
        doc = read_json(path, allow_nan=True)  # a declined τ² or a diverged score is NaN
        return cls.from_dict(doc, str(path))

    def save(self, path: str | Path) -> Path:
        """Write ``prior.json`` (the current :data:`FORMAT_VERSION`) atomically."""
        write_text(Path(path), json.dumps(self.to_dict(), indent=1))
        return Path(path)

    @classmethod
    def from_dict(cls, doc: Any, source: str = "prior.json") -> PriorModel:
        """The value of a parsed prior.json, validated (module docstring)."""
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise RunFileError(f"{source}: not a fedprior fleet prior (kind is not 'fedprior')")
        version = doc.get("format_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise RunFileError(f"{source}: format_version: expected an integer >= 1")
        if version > FORMAT_VERSION:
            raise RunFileError(
                f"{source}: format_version {version} is newer than this fedcal reads "
                f"({FORMAT_VERSION}): {RETRAIN}, or upgrade fedcal"
            )
        unknown = sorted(set(doc) - KNOWN)
        if unknown:
            raise RunFileError(f"{source}: {unknown[0]}: not a part of a fleet prior")
        check_prior(source, doc)  # schema, shapes, finite, Σ SPD, σ² > 0 (one place)
        family = doc.get("basis_family", LEGENDRE.name)  # v1: always Legendre
        if family not in BASIS_FAMILIES:
            known = ", ".join(sorted(BASIS_FAMILIES))
            raise RunFileError(f"{source}: basis_family: {family!r} is not one of {known}")
        basis = _basis(doc, source, family)
        return cls(
            mean=_frozen(doc["mu"]),
            covariance=_frozen(doc["sigma"]),
            noise=_noise(doc),
            basis=basis,
            scaler=Scaler.from_dict(doc["scaler"]),
            input_range={c: (float(lo), float(hi)) for c, (lo, hi) in doc["input_range"].items()},
            features=tuple(doc["features"]),
            target=doc["target"],
            sensor_column=doc.get("sensor_column", "sensor_id"),
            provenance=_provenance(doc, source, version),
            interval=_interval(doc.get("interval"), source, basis.size),
            selection=_selection(doc.get("selection"), source),
            drift=_drift(doc.get("drift"), source, basis.size),
            identification=doc.get("identification"),
            discrepancy=_discrepancy(doc.get("discrepancy"), source),
        )

    def to_dict(self) -> dict[str, Any]:
        """The prior.json document (the layout of version 1 plus ``format_version``,
        ``basis_family``, ``created_by``, ``design_counts``); floats round-trip exactly."""
        b, nz, pv = self.basis, self.noise, self.provenance
        out: dict[str, Any] = {"format_version": FORMAT_VERSION, "kind": KIND}
        out["basis_family"] = b.family
        _put(out, "created_by", pv.created_by)
        out["terms"] = [list(t) for t in b.terms]
        _put(out, "term_names", _listed(b.term_names))
        out["mu"] = self.mean.tolist()
        out["sigma"] = self.covariance.tolist()
        out["noise_var"] = nz.variance
        _put(out, "noise", nz.kind)
        _put(out, "noise_prior_points", nz.prior_points)
        _put(out, "identification", self.identification)
        _put(out, "noise_gamma", _listed(nz.gamma))
        _put(out, "noise_student", nz.student)
        _put(out, "interval", self.interval and _interval_dict(self.interval))
        if b.branch_terms:
            out["branch_terms"] = [list(t) for t in b.branch_terms]
            out["branch_term_names"] = list(b.branch_term_names)
        _put(out, "branch_pinned", [list(t) for t in b.pinned] or None)
        _put(out, "selection", self.selection and _selection_dict(self.selection))
        _put(out, "drift", self.drift and _drift_dict(self.drift))
        _put(out, "discrepancy", self.discrepancy)
        out["method"] = pv.method
        out["method_params"] = pv.method_params
        out["features"] = list(self.features)
        out["target"] = self.target
        out["sensor_column"] = self.sensor_column
        out["scaler"] = self.scaler.to_dict()
        out["input_range"] = {c: list(v) for c, v in self.input_range.items()}
        _put(out, "num_units", pv.num_units)
        _put(out, "design_counts", pv.design_counts)
        return out


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    """``out[key] = value`` unless the part is absent (None): the file omits it."""
    if value is not None:
        out[key] = value


def _listed(values: Any) -> list | None:
    return None if values is None else list(values)


# ---- the parts, read and checked -------------------------------------------------------
def _terms(raw: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(a) for a in t) for t in raw or ())


def _basis(doc: dict[str, Any], source: str, family: str) -> Basis:
    branch = _terms(doc.get("branch_terms"))
    pinned = _terms(doc.get("branch_pinned"))
    if any(t not in branch for t in pinned):
        raise RunFileError(f"{source}: branch_pinned: expected terms of branch_terms")
    names = doc.get("term_names")
    branch_names = doc.get("branch_term_names") or [f"b·{list(t)}" for t in branch]
    if names is not None and len(names) != len(doc["terms"]):
        raise RunFileError(f"{source}: term_names: {len(names)} names for {len(doc['terms'])}")
    if len(branch_names) != len(branch):
        raise RunFileError(f"{source}: branch_term_names: expected {len(branch)} names")
    return Basis(
        family,
        _terms(doc["terms"]),
        None if names is None else tuple(map(str, names)),
        branch,
        tuple(map(str, branch_names)),
        pinned,
    )


def _noise(doc: dict[str, Any]) -> NoiseModel:
    """The noise model (its numbers checked by :func:`check_prior`)."""
    gamma = doc.get("noise_gamma")
    gamma = None if gamma is None else tuple(float(g) for g in gamma)
    points = doc.get("noise_prior_points")
    student = doc.get("noise_student")
    return NoiseModel(float(doc["noise_var"]), doc.get("noise"), points, gamma, student)


def _provenance(doc: dict[str, Any], source: str, version: int) -> Provenance:
    counts = doc.get("design_counts")
    if counts is not None and not (
        isinstance(counts, dict)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values())
    ):
        raise RunFileError(f"{source}: design_counts: expected {{points: units}} counts")
    units = doc.get("num_units")
    if units is not None and (isinstance(units, bool) or not isinstance(units, int) or units < 1):
        raise RunFileError(f"{source}: num_units: expected a positive integer")
    return Provenance(
        doc["method"], dict(doc["method_params"]), units, counts, doc.get("created_by"), version
    )


def _interval(raw: Any, source: str, size: int) -> IntervalPart | None:
    if raw is None:
        return None
    where = f"{source}: interval"  # τ², probe_rows, τ²_own checked by check_prior
    weak = raw.get("weak_projector")
    if weak is not None:
        weak = _frozen(weak)
        if weak.shape != (size, size) or not np.isfinite(weak).all():
            raise RunFileError(f"{where}.weak_projector: expected {size}×{size} numbers")
    dof = raw.get("residual_dof")
    return IntervalPart(
        rule=str(raw.get("rule", "calibrated")),
        discrepancy_var=float(raw["discrepancy_var"]),
        probe_rows=float(raw["probe_rows"]),
        declined=int(raw["declined"]),
        reason=str(raw.get("reason", "")),
        residual_dof=None if dof is None else float(dof),
        weak_projector=weak,
        discrepancy_var_own=raw.get("discrepancy_var_own"),
        has_own="discrepancy_var_own" in raw,
    )


def _interval_dict(iv: IntervalPart) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rule": iv.rule,
        "discrepancy_var": iv.discrepancy_var,
        "probe_rows": iv.probe_rows,
    }
    if iv.residual_dof is not None:
        out["residual_dof"] = iv.residual_dof
    out.update(declined=iv.declined, reason=iv.reason)
    if iv.weak_projector is not None:
        out["weak_projector"] = iv.weak_projector.tolist()
    if iv.has_own:
        out["discrepancy_var_own"] = iv.discrepancy_var_own
    return out


def _selection(raw: Any, source: str) -> SelectionRecord | None:
    if raw is None:
        return None
    if not isinstance(raw.get("chosen"), dict) or not isinstance(raw.get("rule"), str):
        raise RunFileError(f"{source}: selection: expected a rule and the chosen parameters")
    candidates = raw.get("candidates")
    scores = raw.get("scores")
    return SelectionRecord(
        raw["rule"],
        dict(raw["chosen"]),
        None if candidates is None else tuple(candidates),
        None if scores is None else tuple(scores),
        dict(raw["forward"]) if isinstance(raw.get("forward"), dict) else None,
    )


def _selection_dict(sel: SelectionRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"rule": sel.rule, "chosen": sel.chosen}
    if sel.candidates is not None:
        out["candidates"] = list(sel.candidates)
    if sel.scores is not None:
        out["scores"] = list(sel.scores)
    if sel.forward is not None:
        out["forward"] = sel.forward
    return out


def _drift(raw: Any, source: str, size: int) -> DriftPart | None:
    if raw is None:
        return None
    seen = _frozen(raw["seen"])
    if seen.shape != (size, size):
        raise RunFileError(f"{source}: drift.seen: expected {size}×{size} numbers")
    short = raw.get("short")
    if short is not None:
        short = ShortPart(
            float(short["window"]),
            float(short["temper"]),
            float(short["q"]),
            None if short["tau"] is None else float(short["tau"]),
            float(short["held"]),
        )
    return DriftPart(
        q=float(raw["q"]),
        time_scale=float(raw["time_scale"]),
        seen=seen,
        model=str(raw.get("model", "")),
        rate_per_time=raw.get("rate_per_time"),
        recalibrate_ratio=raw.get("recalibrate_ratio"),
        fit=raw.get("fit"),
        prior=raw.get("prior"),
        short=short,
        note=raw.get("note"),
    )


def _drift_dict(d: DriftPart) -> dict[str, Any]:
    out: dict[str, Any] = {"model": d.model, "q": d.q, "time_scale": d.time_scale}
    for key in ("rate_per_time", "recalibrate_ratio", "fit", "prior"):
        if getattr(d, key) is not None:
            out[key] = getattr(d, key)
    out["seen"] = d.seen.tolist()
    if d.short is not None:
        s = d.short
        out["short"] = {"window": s.window, "temper": s.temper, "q": s.q}
        out["short"].update(tau=s.tau, held=s.held)
    if d.note is not None:
        out["note"] = d.note
    return out


def _discrepancy(raw: Any, source: str) -> dict[str, Any] | None:
    """sigma's discrepancy part (:mod:`fedcal.prior.discrepancy`), carried as written."""
    if raw is not None and not isinstance(raw, dict):
        raise RunFileError(f"{source}: discrepancy: expected an object")
    if raw is not None:  # validated here (one line naming the field), carried as written
        # imported here: only a prior with this part needs it (its formulas serve NumPy
        # and torch alike: the torch-free path reads it too, issue 37.1)
        from fedcal.prior.discrepancy import Discrepancy

        try:
            Discrepancy.from_dict(raw, str(source))
        except ValueError as err:
            raise RunFileError(str(err)) from None
    return raw

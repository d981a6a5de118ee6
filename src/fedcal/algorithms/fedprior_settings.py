"""The fleet prior's settings, each declared once: its type, range, default and why.

:class:`FedPriorSettings` is a frozen dataclass of fields only (no behaviour): the
hyperparameters of :class:`~fedcal.algorithms.fedprior.FedPrior` and fedprior_drift, read by
FedPrior's E/M steps and passed, each to the part that reads it, when FedPrior builds its
parts (fedprior.py, "the parts"). The shipped presets (``presets.py``, docs/which-prior.md)
set some of them; the defaults here are the dataclass's.

Defaults (ours, measured on mixed fleets of 20 fully calibrated + 20 new
units, 3 fleet seeds, off-grid test points; docs/results/): Legendre orders (4, 3),
the silicon-resonator calibration surface of docs/simulated-fleet.md,
which also spans a quartz unit to the noise floor — (3, 3) gives the same
errors, so the prior does not overfit the larger basis; ``select = "none"``
here, ``"bic"`` in the shipped configuration (it picks (3, 3) on the mixed
fleets, and (2, 2)/(2, 3) on fleets of 12-point units where (4, 3) fails); no shrinkage (0.05
toward the diagonal cost 15 % at 4×3 points: neighbouring Legendre terms of
one unit's narrow frequency span are strongly correlated, and shrinking
toward the diagonal discards what the fleet measured — EM's Σ stays positive
definite without it, through the posterior covariances V_i); a floor of
1e-12 on Σ's eigenvalues (absolute, scaled units); one fleet noise level
(per-sensor levels narrowed the intervals of units with few points:
coverage 0.78 against 0.88); a vague start
(coefficients ±1, noise 0.1 in scaled units) that keeps round 0
well-conditioned; 50 rounds of the engine are enough (EM's slowest rate is
the fraction of units that cannot see a direction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from fedcal.core.algorithm import Algorithm


@dataclass(frozen=True)
class FedPriorSettings(Algorithm):
    """FedPrior's settings (module doc); its recipe fields are :class:`Algorithm`'s."""

    # tensor basis: highest Legendre order per input
    orders: tuple[Annotated[int, Field(ge=0)], ...] = (4, 3)
    # "tensor" (orders), "total" (degree), "auto": tensor if orders fit
    basis: Literal["auto", "tensor", "total"] = "auto"
    degree: Annotated[int, Field(ge=0)] = 2  # total-degree basis: every product of order ≤ degree
    # ν0: Σ ← (1 − λ)Σ̂ + λ diag(Σ̂), λ = ν0/(N + ν0)
    shrinkage_units: Annotated[float, Field(ge=0.0)] = 2.0
    rank: Annotated[int, Field(ge=0)] = 0  # > 0: Σ = W Wᵀ + D with this many factors; 0: full Σ
    floor: Annotated[float, Field(gt=0.0)] = 1e-12  # eigenvalues of Σ ≥ floor (scaled units²)
    # "fleet": one σ²; "sensor": σ_i² shrunk toward the fleet's
    noise: Literal["fleet", "sensor"] = "fleet"
    noise_prior_points: Annotated[float, Field(gt=0.0)] = 4.0  # ν of the per-sensor noise
    # Noise in the inputs (fedprior_noise, N1–N3): "inputs": σ²(x) = σ_i² exp(γᵀx), γ shared
    # by the fleet and in use only while its evidence beats BIC; "constant": one σ_i² over x.
    noise_shape: Literal["constant", "inputs"] = "constant"
    # "student": t-distributed rows by EM weights (N4), outliers neither pull nor inflate σ²
    # "auto": t rows only while the fleet's likelihood under them beats BIC (N6)
    # "trim": Gaussian rows without the gross outliers of the unit's t fit (N7)
    noise_tail: Literal["gaussian", "student", "auto", "trim"] = "gaussian"
    noise_dof: Annotated[float, Field(gt=2.0)] = 4.0  # ν of the Student-t rows
    # prior std of every coefficient, and the noise std, before any data (scaled units)
    init_scale: Annotated[float, Field(gt=0.0)] = 1.0
    init_noise: Annotated[float, Field(gt=0.0)] = 0.1
    # hyperprior N(0, s²) on μ (scaled units; inf: none)
    mean_scale: Annotated[float, Field(ge=0.0)] = 10.0
    # a direction informed by fewer units is weakly identified
    min_informed: Annotated[float, Field(ge=0.0)] = 2.0
    # "bic": the sub-basis of highest fleet evidence (BIC); "none": all
    select: Literal["none", "bic"] = "none"
    # How "bic" scores a candidate: "candidates": each candidate's own EM (every candidate's
    # statistics uploaded); "marginal": EM on the full basis, each candidate scored by its
    # evidence under the full prior's marginal, one score vector per unit (what client-level
    # DP can bound and noise: fedprior_select.marginal_scores)
    select_by: Literal["candidates", "marginal"] = "candidates"
    # select_by = "marginal": each unit's score of a candidate is clipped to ± this (nats):
    # bounded for DP (L2 ≤ select_clip √K), and no unit outweighs the penalty alone
    select_clip: Annotated[float, Field(gt=0.0)] = 10.0
    # client-level DP with select_by = "marginal": the scores' share of each round's budget
    dp_select_share: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.1
    # client-level DP: rows a unit may hold (public; the campaign)
    dp_max_rows: Annotated[float, Field(ge=0.0)] = 384.0
    # client-level DP: the mean and second moment whitened by the broadcast Σ (True) or in
    # the vague start's units (False; dp_statistics)
    dp_whiten: bool = False
    # client-level DP: the second moment's weight in the joint sensitivity (core.privacy
    # noise_std; 1: every statistic the same share of the budget)
    dp_second_weight: Annotated[float, Field(gt=0.0)] = 1.0
    # ψ: Legendre orders per input of b·ψ(x)ᵀh; () = off
    branch_orders: tuple[Annotated[int, Field(ge=0)], ...] = ()
    # With select = "bic" and branch_orders: ψ chosen too, among no term and every orders
    # vector ≤ branch_orders (candidates = φ's sub-bases × these); False: ψ in every candidate.
    branch_select: bool = False
    # "posterior": φᵀVφ + σ², σ² = Σr/Σn (the model's own interval); "calibrated": σ² on residual
    # degrees of freedom, + a discrepancy variance learned by design-matched hold-out, or no
    # interval where the fleet cannot learn one (module doc, "Intervals").
    interval: Literal["posterior", "calibrated"] = "posterior"
    # a unit with at most this many rows may be the hold-out's probe design
    probe_rows: Annotated[int, Field(ge=1)] = 32
    # τ² is the smallest that covers this share of held-out rows
    coverage_target: Annotated[float, Field(ge=0.0, le=1.0)] = 0.95
    # > 0: units with ≥ 2× the probe's rows get a τ² of their own, learned by holding out
    # their own rows in this many folds (fedprior_interval, I4); 0: they get none (I3). Part
    # of the calibrated interval: no effect with interval = "posterior" (as probe_rows)
    own_folds: Annotated[int, Field(ge=0)] = 0
    # Issue 36.1 (fedprior_rounds, R1–R3): > 0: with select = "bic" the choice is frozen once
    # the same candidate is chosen this many rounds in a row (then only its statistics
    # travel); 0: every candidate every round
    select_patience: Annotated[int, Field(ge=0)] = 0
    # > 0: after the first round the candidates' E-steps run on a sample of about this many
    # units (each unit's own draw against the broadcast rate); 0: on every unit
    select_units: Annotated[int, Field(ge=0)] = 0
    # "final": the calibrated interval's hold-out fits and counts (I2, I4) only in the last
    # round (the engine's, or the one after convergence); "every": every round
    holdout: Literal["every", "final"] = "every"
    # > 0: the run ends one round (the hold-out's) after the prior's relative change per round
    # falls below this (the engine's rounds stay the cap); 0: the engine's rounds
    converge_tol: Annotated[float, Field(ge=0.0)] = 0.0
    # "squarem": the server extrapolates the chosen basis's EM (fedprior_accel, A1–A4; each unit
    # adds its log-evidence to the upload); "off": plain EM
    accelerate: Literal["off", "squarem"] = "off"
    # "learn": at the run's end the units with at least fedprior_deploy.REFERENCE_ROWS rows
    # learn the prior's design-dependent error model (prior.json "discrepancy", issue 33);
    # "off": not learned. deploy_rows > 0: a unit calibrated from such a prior carries its
    # design (at most this many rows) for that σ (set by fedcal calibrate, not by a user).
    deploy: Literal["learn", "off"] = "learn"
    deploy_rows: Annotated[int, Field(ge=0)] = 0
    # Issue 21 (core/robust.py): "full" rejects uploads inconsistent with their declared count
    # and down-weights units far from the others' prior in the M-step; "check": the first
    # only; "off": neither (the plain sums; what secure aggregation would leave).
    robust: Literal["off", "check", "full"] = "full"
    # Issue 34 (fedprior_choice): the basis chosen by each unit's forward-chaining validation
    # on its own past, the simple fits as candidates, and the no-harm fall-back. "auto": when
    # the data have a time column (a run resolves it from [data] time_column: "time" with
    # one, "off" without one or under client-level DP, so that every reply of the run has
    # one structure); "time": also without one (row order as time); "off": never.
    choose: Literal["auto", "time", "off"] = "auto"
    # the share of a unit's calibration span each forward fold scores
    choice_holdout: Annotated[float, Field(gt=0.0, lt=0.5)] = 0.25
    # a unit's score of a candidate: log of its MSE over its best, clipped to this (nats)
    choice_clip: Annotated[float, Field(gt=0.0)] = 5.0
    # no harm: the unit ships its best simple fit when the model's validation squared error
    # exceeds that fit's by more than this many standard errors
    choice_z: Annotated[float, Field(ge=0.0)] = 2.0
    # ... and by more than this share of that fit's validation MSE (a harm that matters)
    choice_margin: Annotated[float, Field(ge=0.0)] = 0.1
    # "scale": each unit's σ scaled so that its fit on all but its last quarter would have
    # covered 95 % of that quarter (fedprior_forward.scale_sigma); "off" (default): the
    # model's σ. Measured (docs/field.md): the validation quarter's errors did not predict
    # the future's — Antwerp 0.93 → 0.99, PurpleAir 0.90 → 0.89; only the gas array gained.
    choice_sigma: Literal["scale", "off"] = "off"
    # "forward": σ after a unit's calibration from the fleet's forward folds (κ, growth ρ), or
    # declined where they show it cannot be trusted (fedprior_forward); "off": the model's σ
    choice_interval: Literal["forward", "off"] = "forward"
    # a unit whose validation RMSE or mean σ exceeds this × the fleet's median: "weak"
    implausible: Annotated[float, Field(gt=1.0)] = 5.0
    # the input that reads the target itself ([data] raw_column; -1: none) and its map into
    # the scaled target, y = raw_map[0] + raw_map[1]·x (set by the run from the scaler)
    raw_input: Annotated[int, Field(ge=-1)] = -1
    raw_map: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "orders", tuple(int(o) for o in self.orders))
        object.__setattr__(self, "branch_orders", tuple(int(o) for o in self.branch_orders))
        object.__setattr__(self, "raw_map", tuple(float(v) for v in self.raw_map))

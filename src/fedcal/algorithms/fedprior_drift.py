"""The fleet prior with drift: each unit's coefficients walk between calibration and use (ours).

Field units drift (a gain that ages, a metal-oxide baseline that wanders over months), so
the coefficients a co-location determined are not those of the period they are used in.
Each unit's coefficients follow a random walk in time, anchored at its latest calibration
point t_i (:class:`~fedcal.algorithms.fedprior.FedPrior`'s prior holds there):

    y_ir = φ(x_ir)ᵀ c_i(t_ir) + ε_ir,    ε ~ N(0, σ²),
    c_i(t_i) ~ N(μ, Σ),                  c_i(t) = c_i(t_i) + w_i(t),
    Cov(w_i(t), w_i(t')) = q · min(t_i − t, t_i − t') · Σ_d / T       (t, t' ≤ t_i),
    c_i(t) for t > t_i:   Var c_i(t) = V_i + q · (t − t_i) · Σ_d / T,

with Σ_d = Π Σ Π the fleet prior Σ on the basis in use, Π the projection onto the directions
the fleet's data identify (fedprior's identification rule; along a weakly identified
direction Σ is the vague start, not a spread to drift along): the drift moves a unit along
the directions the fleet's units differ in, T the fleet's time scale (the mean of the units'
calibration spans, from the sums the server adds) and q ≥ 0 one dimensionless drift variance:
over one mean calibration span a unit drifts by q times the fleet's spread. q is learned by the
federation from every unit's time-stamped rows. One round is fedprior's ECME round and:

1. **E-step, client i** (``client_update``): fedprior's (with ``drift_prior = "walk"`` on
   its moments whitened by the broadcast q, :meth:`FedPriorDrift._client_moments`; W1 of
   :mod:`~fedcal.algorithms.fedprior_drift_walk`: the Kalman smoother's answer in closed
   form, Woodbury over time bins, for every q at once), and for each q_k of
   :data:`~fedcal.algorithms.fedprior_drift_walk.DRIFT_GRID` two scores under the broadcast
   prior (W2): its in-sample log-evidence and its held-out future — the last
   ``drift_holdout`` (25 %) of its span predicted as the unit would in use. Round 0 has no
   time scale yet and runs with q = 0.
2. **M-step, server** (``server_update``): fedprior's, then the fleet's T, q and Π
   (:mod:`~fedcal.algorithms.fedprior_drift_fleet`, F1–F4): the q_k of highest fleet score,
   or q = 0 unless that beats q = 0 by ½ ``drift_test`` (1.92) nats. Which score
   (``drift_fit``): ``"future"`` (default) the units' held-out futures — a walk that only
   absorbs the basis's misfit in time (a seasonal error of a too-small basis) does not
   predict the next period and is not chosen for it; ``"evidence"`` the in-sample evidence
   (a likelihood-ratio test, χ²₁ at 5 %: on a generated 8-feature network with short
   co-locations, docs/field.md, with the walk prior, it chose a smaller basis and q = 0.18,
   and failed, 13.15 µg/m³ mean).
3. **Personal model** (``personalize``): the unit's posterior at t_i from its moments
   whitened by the learned q; its prediction φ(x)ᵀm_i (a random walk has no expected
   direction), its predictive variance at time t (:meth:`predictive_std_timed`, W3)

       Var = [fedprior's variance] + (q/T) · max(t − t_i, 0) · φ(x)ᵀ Σ_d φ(x),

   and its ``recalibrate_at`` (per_sensor.csv): when the mean predictive variance over its
   own calibration inputs, v̄(t) = v̄₀ + d̄ (t − t_i), reaches ``recalibrate_ratio``² times
   v̄₀, i.e. its σ has grown by that factor: t_i + (ratio² − 1) v̄₀ / d̄ (empty when q = 0:
   never).

Which prior (``drift_prior``): ``"static"`` (default): μ, Σ, σ² and the basis are fedprior's
fit, bit for bit, whatever q; q acts in use only (each unit's posterior at t_i, whitened by
q, and its σ growing after t_i). q = 0 is fedprior exactly, and q cannot change the model's
form. ``"walk"``: the E-step's moments are whitened by the broadcast q (ECM): the prior, σ²
and the basis are fitted under the walk. The σ² step treats R̄ as fixed at the broadcast σ²
(a fixed-point step). On a planted walk it recovers the drift variance (within 1.6×,
tested); "static" recovers less of it (0.6× on the planted test fleet) as its Σ and σ² also
hold the walk's spread. On the field networks the walk prior chose a smaller basis and
failed.

Hostile sites (issue 21's check for the drift,
:mod:`~fedcal.algorithms.fedprior_drift_checks`): each unit's evidence grid and future
scores are bounded by what its declared rows allow and tied to its E-step's evidence; the
server sums only clipped gains over q = 0; each declared span is capped before T is formed.

Short co-locations (``short_colocation = "holdout"``, :mod:`~fedcal.algorithms.fedprior_short`):
a unit whose calibration span is below twice the fleet's shortest is in the short class; the
long units emulate such a co-location on their own rows, and the fleet learns how much the
class's own rows weigh (w*), how fast its relation ages (q_s) and its τ²_s (steps S1–S4).

Reduction: with q = 0 (planted or learned) and no short class (no unit has twice the
shortest span, or ``short_colocation = "off"``) every moment is fedprior's exactly, and so are
the predictions and intervals. Without a time column (e.g. chamber data) no unit has a
span, q stays 0 and the run is fedprior's; ``prior.json`` says so (``drift.note``).
Simplifications: the noise level in R̄ is the fleet's (also with ``noise = "sensor"``); the
hold-out of calibrated intervals (fedprior's I2) fits its probe rows without drift; the
firmware exports carry the variance at t_i (no drift term); client-level DP is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Literal, NamedTuple

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_declared import declared, settings_of
from fedcal.algorithms.fedprior_drift_fleet import NO_TIME as NO_TIME  # (prior.json's note)
from fedcal.algorithms.fedprior_drift_fleet import DriftFleet
from fedcal.algorithms.fedprior_drift_walk import DRIFT_GRID, DriftWalk
from fedcal.algorithms.fedprior_short import ShortColocation, unit_span, unit_times
from fedcal.core.algorithm import ClientResult, SettingError
from fedcal.core.bayes import F64, Moments
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree


class DriftParts(NamedTuple):
    """FedPriorDrift's parts beyond FedPrior's (module doc)."""

    walk: DriftWalk  # W1–W3 (fedprior_drift_walk)
    short: ShortColocation  # S1–S4 (fedprior_short)
    fleet: DriftFleet  # F1–F4 (fedprior_drift_fleet)


@dataclass(frozen=True)
class FedPriorDrift(FedPrior):
    # B: bins of a unit's calibration span within which the walk is held; 0: as many as the
    # basis affords (BIN_SIZE). Measured on a planted fleet (1 input, 2 terms): 8 bins put
    # the within-bin drift into σ (0.060 for a planted 0.05) and 30 bins 0.055.
    drift_bins: Annotated[int, Field(ge=0)] = 0
    # 2Δ log-evidence a q > 0 must gain over q = 0 (χ²₁, 5 %)
    drift_test: Annotated[float, Field(ge=0.0)] = 3.84
    # recalibrate_at: when the unit's mean σ has grown by this factor
    recalibrate_ratio: Annotated[float, Field(gt=1.0)] = 2.0
    # How q is chosen (module doc, step 2): "future", by each unit's own last rows held
    # out, with the prior, basis and σ² fitted without drift; "evidence", by the fleet's
    # in-sample evidence, the prior fitted under the walk (ECM).
    drift_fit: Literal["future", "evidence"] = "future"
    # "future": the last fraction of each unit's calibration span held out as its future
    drift_holdout: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.25
    # The prior's fit: "walk", its E-step whitened by the broadcast q (ECM: μ, Σ, σ² and the
    # basis fitted under the walk); "static", fedprior's fit (q acts in use only: the
    # personalized posterior at t_i and its σ growing after it).
    drift_prior: Literal["walk", "static"] = "static"
    # Hostile sites: each unit's future score gain over q = 0 is clipped to ± this many nats
    # per row it declares (fedprior_drift_checks.bound_future_scores); measured honest maxima
    # 0.45 (field network) and 1.64 (a planted strong walk) nats per row (docs/field.md).
    drift_score_clip: Annotated[float, Field(gt=0.0)] = 3.0
    # Hostile sites: a declared span counts at most this many times the fleet's median span
    # in the time scale T (fedprior_choice_parts.fleet_time_scale).
    drift_span_cap: Annotated[float, Field(gt=1.0)] = 32.0
    # Short co-locations (fedprior_short, S1–S4): "holdout", the long units emulate the
    # fleet's shortest span and the fleet learns how much a short unit's own rows weigh and
    # its τ²; "off": a short unit's posterior is fedprior_drift's like any other.
    short_colocation: Literal["holdout", "off"] = "holdout"
    # S2's emulated use (fedprior_short): "span", windows over a long unit's whole span, every
    # other row of it predicted (gaps and seasons up to the span away, as a short unit meets
    # in use); "future", windows before its last drift_holdout, which alone is predicted.
    short_emulation: Literal["future", "span", "far"] = "future"
    # Hostile sites: each unit's emulated squared errors' gains over w = 1 (S2) count at most
    # this many times its held-out rows × a typical unit's squared error per row at that w
    # (fedprior_drift_checks.bound_short_sse; honest units at most 6.8x on the field
    # networks, docs/field.md).
    short_sse_clip: Annotated[float, Field(gt=0.0)] = 20.0

    name = "fedprior_drift"
    # A unit's drift evidences grow with its rows, like its residual terms: not screened.
    unscreened_replies = (*FedPrior.unscreened_replies, "drift/")

    # ---- the parts (each declared by what it reads; built once: the fields are frozen) ----
    @cached_property
    def drift(self) -> DriftParts:
        """The walk (W1–W3), the short co-locations (S1–S4) and the fleet's drift (F1–F4),
        each built from the settings and parts it declares (:func:`declared`)."""
        s = settings_of(self)
        known = {"features": self.num_features, "phi_terms": len(self.terms), "q_grid": DRIFT_GRID}
        known.update(basis=self.design_basis, support_box=self.support_box)
        known.update(calibrated=self.calibrated, selection=self.selection)
        walk = declared(DriftWalk, s, known, prefix="drift_")
        short = declared(ShortColocation, s, known, prefix="short_")
        fleet = declared(DriftFleet, s, {**known, "short": short}, prefix="drift_")
        return DriftParts(walk, short, fleet)

    @property
    def short(self) -> ShortColocation:
        """Short co-locations, S1–S4 (fedprior_short), with the drift's grid of q."""
        return self.drift.short

    def check_task(self, task) -> None:
        super().check_task(task)
        if self.noise_model.weighted:  # its whitened moments assume one constant noise per unit
            raise SettingError(
                "noise_shape",
                "fedprior_drift supports noise_shape = 'constant' and noise_tail = 'gaussian' "
                "only (the drift's whitening is not weighted by row yet); use fedprior",
            )
        if self.own_folds and self.short_colocation == "holdout" and self.interval == "calibrated":
            # S2 learns τ²_s on windows without I4's τ²_own; in use they would add up
            raise SettingError(
                "own_folds",
                f"{self.own_folds} with short_colocation = 'holdout': the short step's τ² is "
                "learned without the own-row τ²; use own_folds = 0 or short_colocation = 'off'",
            )

    # ---- step 1, the E-step (module doc) ----------------------------------------------
    def _client_moments(self, down: Tree, data: ClientData) -> Moments:
        """fedprior's E-step moments: whitened by the broadcast drift q (static at q = 0);
        ``drift_prior = "static"``: the static ones."""
        if self.drift_prior == "static":
            return self._moments(data)
        return self._walk_moments(down, data)

    def _personal_moments(self, down: Tree, data: ClientData) -> Moments:
        """A unit's posterior at t_i: its moments whitened by the broadcast q (W1),
        a short co-location's tempered by the fleet's w* (fedprior_short, S4)."""
        return self.short.personal_moments(down, data, self._walk_moments(down, data))

    def _walk_moments(self, down: Tree, data: ClientData) -> Moments:
        """The moments whitened by the broadcast drift q (static at q = 0, without a known
        drift or a time column)."""
        whitened = self.drift.walk.whitened(down, data)
        return self._moments(data) if whitened is None else whitened

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        """fedprior's E-step, and the drift's uploads: the evidence and future score per
        q of the grid (W2), the short step's emulation (S2), the unit's span."""
        t = unit_times(data)
        result = super().client_update(down, state, data)
        c = data.num_clients
        _, span = unit_span(t, data.mask.to(F64))
        loglik = torch.zeros(c, len(DRIFT_GRID), dtype=F64)
        future = torch.zeros(c, len(DRIFT_GRID), dtype=F64)
        short = self.short.holdout(down, state, data)  # zeros (shape): no Σ_d yet
        if float(down["drift"]["scale"].reshape(-1)[0]) > 0:  # the fleet's time scale is known
            noise = down["noise_var"].to(F64).reshape(-1)
            post, half_logdet = self.drift.walk.grid_posterior(
                down, noise, self.drift.walk.parts(down, data)
            )
            loglik = post.loglik.reshape(c, -1) + half_logdet
            if self.drift_fit == "future":
                future = self.drift.walk.future_scores(down, state, data)
            short = self.short.holdout(down, state, data, self.drift.walk.drift_cov(down))  # S2
        drift = {"loglik": loglik, "future": future, "span": span, "short": short}
        reply = {**result.reply, "drift": drift}
        return ClientResult(reply, result.state, result.metrics)

    # ---- step 2, the M-step -------------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        return {**super().server_init(params), "drift": self.drift.fleet.init()}

    def broadcast(self, server: Tree) -> Tree:
        return {**super().broadcast(server), "drift": self.drift.fleet.broadcast(server["drift"])}

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        """fedprior's M-step, then the fleet's T, q, Π and the short step (F1–F4), each
        unit's scores weighted like its M-step statistics."""
        stats = {k: v for k, v in replies.items() if k != "drift"}
        new = super().server_update(server, stats, weights)
        robust = self.outlier_weights(server, stats)
        unit_w = None if robust is None else robust.weights
        new["drift"] = self.drift.fleet.update(server["drift"], replies, unit_w, new)
        return new

    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """fedprior's checks (:mod:`fedcal.core.robust`), then each unit's drift uploads
        against its row count and the broadcast (:meth:`DriftFleet.problems`)."""
        whys = super().inconsistent_replies(server, replies, weights, accepted)
        if whys is None:
            return None
        for i, why in self.drift.fleet.problems(server, replies, accepted).items():
            whys.setdefault(i, why)
        return whys

    def _gram_counts_rows(self, server: Tree) -> bool:
        # With q > 0 and drift_fit = "evidence" the E-step's Gram is whitened, G̃ = ΦᵀR̄⁻¹Φ: its
        # constant term 1ᵀR̄⁻¹1 is below n (still PSD, and the GLS identities still hold, so
        # those are checked). "future" uploads the static moments.
        return self.drift_prior == "static" or not float(server["drift"]["q"]) > 0

    def dp_statistics(self, down: Tree):
        raise ValueError("fedprior_drift: client-level DP is not covered (use fedprior)")

    # ---- step 3, the personal model and its use ---------------------------------------
    def personal_shapes(self) -> dict[str, tuple[int, ...]]:
        p = self.num_features
        return {**super().personal_shapes(), "t_ref": (), "drift_rate": (), "drift_cov": (p, p)}

    def _personal(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        out = super()._personal(down, state, data)
        if "drift" not in down:  # a prior without drift (e.g. read back from prior.json)
            return out
        t_ref, _ = unit_span(unit_times(data), data.mask.to(F64))
        q, scale = down["drift"]["q"].to(F64), down["drift"]["scale"].to(F64)
        rate = torch.where(scale > 0, q / scale.clamp_min(1e-300), 0.0).reshape(-1)
        cov = self.drift.walk.drift_cov(down)
        out.update(t_ref=t_ref, drift_rate=rate.expand_as(t_ref), drift_cov=cov)
        return self.short.use(down, data, out)  # S4: the short class's rate and τ²_s

    def predictive_std_timed(self, params: Tree, data: ClientData) -> Tensor:
        """:meth:`predictive_std` at each row's time: + the walk since t_i (W3)."""
        std = self.predictive_std(params, data.x)
        if data.time is None or "drift_rate" not in params:
            return self.time_choice.forward.std(params, data, std)  # fedprior_forward's, after t_i
        var = std.to(F64)[..., 0] ** 2 + self.drift.walk.var(params, data.x, data.time)
        return self.time_choice.forward.std(params, data, var.sqrt().unsqueeze(-1).to(std.dtype))

    def unit_columns(self, params: Tree, train: ClientData) -> dict[str, np.ndarray]:
        """Per unit (clients,): ``recalibrate_at`` — when its mean predictive σ over its own
        calibration inputs reaches ``recalibrate_ratio`` times its value at t_i (module doc);
        NaN when no drift was learned (never) or no interval is stated."""
        extra = super().unit_columns(params, train)  # fedprior's (fallback)
        if "drift_rate" not in params:
            return extra
        m = train.mask.to(F64)
        n = m.sum(1).clamp_min(1.0)
        v0 = ((self.predictive_std(params, train.x).to(F64)[..., 0] ** 2) * m).sum(1) / n
        at_ref = params["t_ref"].to(F64).unsqueeze(1).expand_as(m)
        one = self.drift.walk.var(params, train.x, at_ref + 1.0)  # growth per unit of time
        growth = (one * m).sum(1) / n
        dt = (self.recalibrate_ratio**2 - 1.0) * v0 / growth
        when = torch.where(growth > 0, params["t_ref"].to(F64) + dt, math.nan)
        return {**extra, "recalibrate_at": when.numpy()}

    def export_state(self, server: Tree) -> dict:
        """fedprior's prior.json, with the drift's (:meth:`DriftFleet.export`)."""
        return {**super().export_state(server), "drift": self.drift.fleet.export(server)}

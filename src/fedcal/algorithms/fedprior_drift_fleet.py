"""The fleet's drift: q, the time scale T and the directions that drift, chosen by the server
from every unit's scores (:class:`~fedcal.algorithms.fedprior_drift.FedPriorDrift`'s steps
F1–F4; ours).

F1. **Time scale.** Round 0 has no time scale yet and runs with q = 0; the server forms T,
    the mean of the units' declared calibration spans, each capped at ``drift_span_cap`` ×
    the median (:func:`~fedcal.algorithms.fedprior_choice_parts.fleet_time_scale`), and keeps
    it once known.
F2. **Choosing q.** Each round every unit uploads, for each q_k of
    :data:`~fedcal.algorithms.fedprior_drift_walk.DRIFT_GRID`, two scores under the
    broadcast prior (W2 of :mod:`~fedcal.algorithms.fedprior_drift_walk`); the server adds
    each unit's gain over q = 0, clipped (:func:`~.fedprior_drift_checks.bound_future_scores`)
    and weighted like its M-step statistics, over units in canonical order, and keeps the q_k
    of highest fleet score, or q = 0 unless that beats q = 0 by ½ ``drift_test`` (1.92)
    nats. Which score: ``drift_fit = "future"`` the held-out future, ``"evidence"`` the
    in-sample log-evidence (a likelihood-ratio test, χ²₁ at 5 %).
F3. **The directions that drift** (Π, ``seen``): the projection onto the directions of the
    basis in use that at least ``min_informed`` units' data determine (fedprior's
    identification rule); Σ_d = Π Σ Π.
F4. **The short step's sums** (fedprior_short S1, S3): each unit's counts clipped to the rows
    it declares, its scores and squared errors as clipped gains over q_s = 0 and w = 1.

The uploads' checks: :func:`~fedcal.algorithms.fedprior_drift_checks.drift_problems`
(:meth:`DriftFleet.problems`); what the run's ``prior.json`` says: :meth:`DriftFleet.export`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedcal.algorithms.fedprior_choice_parts import fleet_time_scale
from fedcal.algorithms.fedprior_drift_checks import (
    bound_future_scores,
    bound_short_sse,
    drift_problems,
    short_uploads,
)
from fedcal.algorithms.fedprior_drift_walk import DRIFT_GRID
from fedcal.algorithms.fedprior_select import EvidenceSelection
from fedcal.algorithms.fedprior_short import SHORT_WINDOWS, ShortColocation
from fedcal.core.bayes import F64
from fedcal.core.tree import Tree, flatten

NO_TIME = "no time column: q = 0, fedprior's model (give the data --time-column for drift)"


@dataclass(frozen=True)
class DriftFleet:
    """Steps F1–F4 (module doc); a part of
    :class:`~fedcal.algorithms.fedprior_drift.FedPriorDrift` (its ``fleet``), declared by the
    settings it reads (``drift_fit``, ``drift_prior``, ``drift_test``, ``drift_score_clip``,
    ``drift_span_cap``, ``short_sse_clip``, ``recalibrate_ratio``, ``min_informed``,
    ``noise``), the design's size, the selection (the basis in use) and the short step."""

    fit: str  # drift_fit: "future" or "evidence" (F2)
    prior: str  # drift_prior: "static" (the E-step at q = 0) or "walk"
    test: float  # drift_test: 2Δ log-evidence a q > 0 must gain over q = 0
    score_clip: float  # drift_score_clip: nats per row of a unit's gain over q = 0
    span_cap: float  # drift_span_cap: a declared span counts at most this × the median
    short_sse_clip: float  # fedprior_short S3: a unit's squared errors' gains, clipped
    recalibrate_ratio: float  # exported with the drift
    min_informed: int  # units whose data determine a direction that drifts (F3)
    noise: str  # "fleet" or "sensor": the evidence identity needs the fleet's σ²
    features: int  # the design's columns, [φ, b·ψ]
    selection: EvidenceSelection
    short: ShortColocation

    def init(self) -> Tree:
        """The server's drift state before round 0: q = 0, no time scale, every direction."""
        zero = torch.tensor(0.0, dtype=F64)
        return {
            "q": zero.clone(),
            "scale": zero.clone(),
            "seen": torch.eye(self.features, dtype=F64),
            "loglik": torch.zeros_like(DRIFT_GRID),
            "future": torch.zeros_like(DRIFT_GRID),
            "short": self.short.init(),
        }

    def broadcast(self, drift: Tree) -> Tree:
        """What the units read: q, T, Π and the short step's (fedprior_short)."""
        return {**{k: drift[k] for k in ("q", "scale", "seen")}, **self.short.broadcast(drift)}

    def update(self, old: Tree, replies: Tree, weights: Tensor | None, prior: Tree) -> Tree:
        """F1–F4 from the units' ``replies`` (``weights``: the M-step's outlier weights, None
        when off), after the M-step gave the new ``prior`` (its support: F3)."""
        drift = replies["drift"]
        # The canonical order of fedprior's sums: the rounding cannot depend on arrival order.
        order = torch.from_numpy(np.lexsort(replies["mean"].numpy().T[::-1]).copy())
        loglik, future, score = self._scores(drift, replies["n"], order, weights)
        q = torch.tensor(0.0, dtype=F64)
        if float(old["scale"]) > 0:  # the grid was evaluated this round
            k = int(torch.argmax(score))  # ties: the smaller q
            if float(score[k] - score[0]) > 0.5 * self.test:
                q = DRIFT_GRID[k].clone()
        scale = fleet_time_scale(drift["span"], order, self.span_cap)
        if float(old["scale"]) > 0:
            scale = old["scale"].clone()  # the time scale is fixed once known
        new = {"q": q, "scale": scale.to(F64), "seen": self.seen(prior), "loglik": loglik}
        new["future"] = future
        sums, held = self._short_sums(drift["short"], replies["n"], order)
        unit_w = torch.ones_like(held) if weights is None else weights.to(F64)
        new["short"] = self.short.update(old["short"], drift["span"], sums, unit_w[order])
        return new

    def _scores(
        self, drift: Tree, n: Tensor, order: Tensor, weights: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """F2: the fleet's summed evidence and future gains per q, and the score that
        chooses (``drift_fit``)."""
        loglik = drift["loglik"]
        # each unit's clipped gains over q = 0: the fleet's score is their sum (0 at q = 0)
        future = bound_future_scores(drift["future"], n, self.score_clip)
        reweigh = weights is not None and bool((weights != 1).any())
        if reweigh:  # q's evidence weighted like the M-step's
            loglik = loglik * weights.unsqueeze(1)
            future = future * weights.unsqueeze(1)
        # the evidence mode decides on clipped gains too (raw sums are checked from above
        # only: one unit lowering ℓ_i(q > 0) without limit would hold q at 0)
        evidence = bound_future_scores(drift["loglik"], n, self.score_clip)
        if reweigh:
            evidence = evidence * weights.unsqueeze(1)
        loglik, future = loglik[order].sum(0), future[order].sum(0)
        score = future if self.fit == "future" else evidence[order].sum(0)
        return loglik, future, score

    def _short_sums(self, sh: Tree, n: Tensor, order: Tensor) -> tuple[Tree, Tensor]:
        """F4 (fedprior_short S1, S3): each unit's counts clipped to the rows it declares, its
        scores and squared errors as clipped gains over q_s = 0 and w = 1 (their base
        dropped), in canonical order; and each unit's held-out rows."""
        rows = SHORT_WINDOWS * n.to(F64)  # a row is held out by each window before it
        held = torch.minimum(sh["held"].clamp_min(0.0), rows)
        w_n, q_n = sh["score"].shape[1:]
        score = bound_future_scores(
            sh["score"].reshape(-1, q_n), rows.repeat_interleave(w_n, 0), self.score_clip
        ).reshape(-1, w_n, q_n)
        sums = {
            "sse": bound_short_sse(sh["sse"], held, self.short_sse_clip)[order],
            "score": score[order],
            "inside": torch.minimum(sh["inside"].clamp_min(0.0), held.unsqueeze(1))[order],
            "held": held[order],
        }
        return sums, held

    def seen(self, server: Tree) -> Tensor:
        """F3: the projection onto the directions of the basis in use that at least
        ``min_informed`` units' data determine (fedprior's identification rule)."""
        _, idx = self.selection.chosen_features(server)
        support = server["support"][idx][:, idx]
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        keep = vecs[:, vals >= self.min_informed]
        seen = torch.zeros(self.features, self.features, dtype=F64)
        seen[idx.unsqueeze(1), idx.unsqueeze(0)] = keep @ keep.T
        return seen

    def problems(self, server: Tree, replies: Tree, accepted: Tensor) -> dict[int, str]:
        """{client: why} for the accepted units whose drift uploads cannot be what their
        declared rows give (:func:`~fedcal.algorithms.fedprior_drift_checks.drift_problems`,
        against the broadcast)."""
        idx = accepted.nonzero()[:, 0]
        if not len(idx):
            return {}
        sub = {k: v.index_select(0, idx) for k, v in flatten(replies).items()}
        main = None
        if self.noise == "fleet":  # the grid's σ² is the E-step's (per-unit σ_i²: no identity)
            main = {k: sub[k] for k in ("mean", "second", "rss", "gram", "n")}
        found = drift_problems(
            sub["drift/loglik"],
            sub["drift/future"],
            sub["drift/span"],
            sub["n"],
            server,
            main,
            future_bound=self.noise == "fleet",
            e_step_q=0.0 if self.prior == "static" else float(server["drift"]["q"]),
            short=short_uploads(sub),
        )
        return {int(idx[j]): why for j, why in found.items()}

    def export(self, server: Tree) -> dict:
        """prior.json's ``drift``: the model, q, T, the fit, Π on the exported basis, the
        short step's (S1–S3: what a short new unit gets) and, without a time, why q = 0."""
        _, idx = self.selection.chosen_features(server)
        q, scale = float(server["drift"]["q"]), float(server["drift"]["scale"])
        out = {
            "model": "random walk of the coefficients, variance q·|t − t_i|·Σ/T",
            "q": q,
            "time_scale": scale,
            "rate_per_time": q / scale if scale > 0 else 0.0,
            "recalibrate_ratio": self.recalibrate_ratio,
            "fit": self.fit,
            "prior": self.prior,
            "seen": server["drift"]["seen"][idx][:, idx].tolist(),  # Π on the exported basis
        }
        short = server["drift"]["short"]
        if float(short["held"]) > 0:
            tau = float(short["tau"])
            out["short"] = {
                "window": float(short["window"]),
                "temper": float(short["temper"]),
                "q": float(short["q"]),
                "tau": None if math.isnan(tau) else tau,
                "held": float(short["held"]),
            }
        if scale <= 0:
            out["note"] = NO_TIME
        return out

"""fedprior's defence against a hostile site or unit (issue 21; :mod:`fedcal.core.robust`).

Two hooks of the algorithm contract (:class:`fedcal.core.algorithm.Algorithm`), both
needing each client's own upload (so neither runs under secure aggregation):

* :meth:`RobustUploads.inconsistent_replies` — an upload whose statistics contradict its
  declared row count or the broadcast prior (positive semi-definite Gram with the row count
  as its constant term, RSS ≥ 0, the GLS and posterior identities, every candidate basis's
  statistics, the interval's residual terms) is rejected by the aggregation's
  ``consistency`` stage, with its reason;
* :meth:`RobustUploads.outlier_weights` — each unit's leave-one-out distance to the others'
  moments in the chosen basis; units beyond the cut-off enter the M-step's sums with the
  weight min(1, (cut-off/distance)²) (:func:`weighted`), and are reported.

:class:`RobustUploads` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``robust_uploads``), declared by what it reads: ``robust``, the number of candidate bases
whose statistics each unit uploads (``select = "bic"`` with ``select_by = "candidates"``; 0
otherwise), the clips of the unscreened selection and choice scores, and the linear terms of
the basis (fedprior_choice's bound); the hooks of the contract are FedPrior's and call it.
``robust = "off"`` gives the plain sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_choice_checks import choice_problems
from fedcal.core.honesty import capped_residuals, fitted_rms, support_problems
from fedcal.core.robust import (
    OutlierWeights,
    inconsistencies,
    loo_distances,
    outlier_weights,
    prior_frame,
)
from fedcal.core.tree import Tree, flatten, per_client

#: The statistics the size screen judged before issue 34.3 (and still does with robust = "off").
SIZED = ("mean", "second", "gls_gram", "gls_rhs", "rss", "n", "support", "branch_support")


@dataclass(frozen=True)
class RobustUploads:
    """The consistency check and the M-step weights of fedprior's uploads (module doc)."""

    robust: str  # "off", "check" or "full"
    candidates: int  # candidate bases each unit uploads statistics of (0: none)
    select_clip: float  # |each marginal selection score| ≤ this (select_by = "marginal")
    choice_clip: float  # fedprior_choice's score clip
    linear_terms: tuple[int, ...] | None  # the constant and first-order terms (choice)

    def screen_view(
        self, replies: dict[str, Tensor], rows: Tensor, broadcast: Tree | None = None
    ) -> dict[str, Tensor]:
        """What the server's size screen judges (issue 34.3): with the consistency check on,
        only the RMS of the unit's own posterior fit √(mᵀGm/n), in the units of y
        (:func:`fedcal.core.honesty.fitted_rms`). The other statistics are whitened by the
        prior and checked for consistency (W, H in [0, I], m = μ + LLᵀ·rhs, n declared,
        support in [0, 1]), the residual sum is bounded in the fleet noise
        (:func:`fedcal.core.honesty.capped_residuals`): none of them is a size that an
        honest unit with more or fewer rows, or more noise, would exceed. ``robust = "off"``:
        every fitted statistic is sized as before (as a sum: raw or per row). ``broadcast``:
        the hook's (``Algorithm.screen_view``), not read."""
        if self.robust == "off":
            return {f"sum/{k}": replies[k] for k in SIZED if k in replies}
        return {"fit_rms": fitted_rms(replies["mean"], replies["gram"], rows)}

    def frames(self, server: Tree, constant_first: bool = True) -> dict | None:
        """What one round's checks read of ``server``: the broadcast priors the uploads are
        checked against (the chosen basis's, and every candidate's with ``select = "bic"``),
        formed once a round (:func:`~fedcal.core.robust.prior_frame`), and
        ``constant_first``: whether the Gram's constant term is the row count (the design's
        ΦᵀΦ; fedprior_drift's whitened Gram is not); None when off."""
        if self.robust == "off":
            return None
        frames = {"main": prior_frame(server["mu"], server["sigma"])}
        frames["constant_first"] = constant_first
        if self.candidates and "cand" in server:  # (not once the choice is frozen: R1)
            cand = server["cand"]
            frames["cand"] = [
                prior_frame(cand["mu"][k], cand["sigma"][k]) for k in range(self.candidates)
            ]
        return frames

    def inconsistent(
        self, frames: dict | None, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """Clients whose upload contradicts its declared row count or the broadcast prior
        (:func:`fedcal.core.robust.inconsistencies`, every candidate's statistics too) under
        the priors ``frames`` (:meth:`frames`): the aggregation rejects them with this
        reason; None when off. Needs each client's own upload."""
        if frames is None:
            return None
        idx = accepted.nonzero()[:, 0]
        if not len(idx):
            return {}
        sub = flatten(replies)
        if len(idx) < len(accepted):  # (every client, most rounds: no copy of the replies)
            sub = {k: v.index_select(0, idx) for k, v in sub.items()}
        keys = ("mean", "second", "gls_gram", "gls_rhs", "rss")
        main = {k: sub[k] for k in (*keys, "n", "gram")}
        top = frames["main"]
        whys = inconsistencies(
            main,
            top.mu,
            top.sigma,
            weights.index_select(0, idx),
            constant_first=frames["constant_first"],
            frame=top,
        )
        if self.candidates and "cand/mean" in sub:  # (not once the choice is frozen: R1)
            # (R1 of fedprior_rounds: the units outside the candidates' sample upload none)
            rows = torch.arange(len(whys))
            if "cand/unit" in sub:
                rows = torch.nonzero(sub["cand/unit"][:, 0] > 0)[:, 0]
            for k, frame in enumerate(frames["cand"] if rows.numel() else ()):
                cand = {key: sub[f"cand/{key}"][rows, k] for key in keys}
                found = inconsistencies(cand, frame.mu, frame.sigma, frame=frame)
                for j, why in zip(rows.tolist(), found, strict=True):
                    if why is not None and whys[j] is None:
                        whys[j] = f"candidate {k}: {why}"
        for key in ("support", "branch_support"):  # shares of information in [0, 1]
            for j, why in support_problems(sub[key]).items() if key in sub else ():
                if whys[j] is None:
                    whys[j] = why if key == "support" else f"branch {why}"
        self._score_problems(sub, whys)
        return {int(idx[j]): why for j, why in enumerate(whys) if why is not None}

    def _score_problems(self, sub: dict[str, Tensor], whys: list) -> None:
        """The unscreened residual terms and scores of :meth:`inconsistent` (bounded here,
        the first reason of a client kept): the interval's residual terms, the marginal
        selection scores, fedprior_choice's forward scores."""
        if "interval/dof" in sub:  # residual degrees of freedom ≤ rows, squared residuals ≥ 0
            dof, fit, n = sub["interval/dof"], sub["interval/fit"], sub["n"]
            wrong = ~((fit >= 0) & (dof <= n * (1 + 1e-9)))
            for j in wrong.nonzero()[:, 0].tolist():
                if whys[j] is None:
                    d, f = float(dof[j]), float(fit[j])
                    whys[j] = f"residual terms impossible (dof {d:.3g}, fit {f:.3g})"
        if "select" in sub:  # select_by = "marginal": each score within ±select_clip, the
            # full basis's 0 (unscreened, so bounded here: else one unit picks the basis)
            score = sub["select"]
            wrong = (score.abs() > self.select_clip * (1 + 1e-9)).any(-1) | (score[:, -1] != 0)
            for j in wrong.nonzero()[:, 0].tolist():
                if whys[j] is None:
                    whys[j] = f"selection scores beyond ±{self.select_clip:g} or full basis ≠ 0"
        if "choice/score" in sub:  # fedprior_choice's unscreened uploads, bounded and tied
            lin = torch.tensor(self.linear_terms)
            for j, why in choice_problems(sub, self.choice_clip, lin).items():
                whys[j] = whys[j] or why

    def outlier_weights(self, server: Tree, replies: Tree) -> OutlierWeights | None:
        """Each client's M-step weight from its leave-one-out distance to the others' prior
        (:func:`fedcal.core.robust.loo_distances`, in the chosen basis's coordinates: the
        sub-basis model's own); None when off or when the clients are at most the basis's
        terms + 2 (too few to judge each against the others). Needs each client's own upload."""
        if self.robust != "full":
            return None
        # the chosen basis's coordinates only: the others hold the prior itself (no data);
        # every coordinate (the largest basis, round 0): the replies as they are, not copied
        mean, second = replies["mean"], replies["second"]
        if "mask" in server and not bool(server["mask"].all()):
            used = torch.nonzero(server["mask"])[:, 0]
            mean, second = mean[:, used], second[:, used.unsqueeze(-1), used]  # one gather
        c, p = mean.shape
        if c - 1 <= p + 1:  # the others' moments cannot name a law for δ: not judged
            return None
        return outlier_weights(loo_distances(mean, second), p, c - 1)


def weighted(replies: Tree, w: Tensor) -> Tree:
    """Each client's statistics times its M-step weight w_i (core/robust.py); the interval's
    probe design (inputs, rows) is not a statistic and is kept."""
    out: dict = {}
    for key, v in replies.items():
        if key == "interval":
            out[key] = {
                k: u * per_client(w.to(u.dtype), u)
                if k in ("dof", "fit", "held", "inside", "held_own", "inside_own")
                else u
                for k, u in v.items()
            }
        elif isinstance(v, dict):
            out[key] = {k: u * per_client(w.to(u.dtype), u) for k, u in v.items()}
        else:
            out[key] = v * per_client(w.to(v.dtype), v)
    return out


def capped_noise(replies: Tree) -> Tree:
    """The residual sums the fleet noise is learned from, each unit's capped at
    :data:`~fedcal.core.honesty.RESIDUAL_CAP` × the fleet's median per row (the expected RSS
    per row; with the calibrated interval also its fit per residual degree of freedom):
    replies unchanged where no unit exceeds it (issue 34.3)."""
    out = dict(replies)
    rss, over = capped_residuals(replies["rss"], replies["n"])
    if bool(over.any()):
        out["rss"] = rss
    if "interval" in replies and "fit" in replies["interval"]:
        part = replies["interval"]
        fit, over = capped_residuals(part["fit"], part["dof"])
        if bool(over.any()):
            out["interval"] = {**part, "fit": fit}
    return out

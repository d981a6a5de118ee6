"""What a user keeps of a fleet prior: identification, each unit's status, the exported prior.

:class:`PriorStatus` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``prior_status``), declared by the basis in use (the
:class:`~fedcal.algorithms.fedprior_select.EvidenceSelection` part: terms, candidates,
masks), ``min_informed`` and the noise and interval settings the exported prior records:

* :meth:`~PriorStatus.identification`: how many units' points determine each direction of
  the basis in use, and the weakly identified terms (the module doc of
  :mod:`fedcal.algorithms.fedprior`, "Identification");
* :meth:`~PriorStatus.client_status`: a unit is "weak" when its predictions lean on those
  directions (docs/statuses.md);
* :meth:`~PriorStatus.export_state`: the fleet prior as JSON-able data, what ``fedcal
  calibrate`` reads back (:func:`fedcal.calibration.load_prior`); the run adds its context
  (features, scaler, input range: :func:`fedcal.experiment.export_state`) and writes it as
  ``prior.json``. The hook of the algorithm contract (:meth:`fedcal.core.algorithm.Algorithm.
  export_state`), so it lives with the algorithm: the report layer, above it, only reads it.

The calibrated interval's one-line note is passed in (``note``: fedprior_interval's
``interval_note``). fedprior_choice's ``client_status`` and ``export_state`` (the contract's
hooks of FedPrior) call this part and add the time-respecting choice's flags and record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_select import EvidenceSelection, term_name
from fedcal.core.bayes import F64
from fedcal.core.identify import UNLEARNED_SHARE, unlearned_directions, unlearned_share
from fedcal.core.tree import Tree
from fedcal.models.basis import legendre_products

# a unit is "weak" when weak directions carry more of its σ² (client_status; core/identify.py)
WEAK_SHARE = UNLEARNED_SHARE


@dataclass(frozen=True)
class PriorStatus:
    """Identification, client status and the exported prior (module doc)."""

    selection: EvidenceSelection  # the candidates and the basis in use
    min_informed: float  # a direction informed by fewer units is weakly identified
    noise: str  # "fleet" or "sensor" (recorded for fedcal calibrate)
    noise_prior_points: float
    noise_shape: str  # "constant" or "inputs" (γ recorded)
    interval: str  # "posterior" or "calibrated" (its record)

    def identification(self, server: Tree) -> dict[str, Any]:
        """How many units' data informed each direction of the basis, and which are weak.

        ``support`` is Σ_i of each unit's :func:`~fedcal.core.bayes.data_support`
        (last round): its eigenvalues are effective counts of units whose own
        points determine a direction. A direction informed by fewer than
        ``min_informed`` units is weakly identified: the prior there is not
        learned but the vague ``init_scale``; it is named by the basis terms that
        load on it (at least half the largest loading). With ``select = "bic"``:
        the chosen basis's terms only.
        """
        names, idx = self.selection.chosen_features(server)
        support = server["support"][idx][:, idx]
        if not torch.any(support != 0):
            return {"informed_units": [], "weak_terms": [], "weak_directions": 0}
        vals, vecs = torch.linalg.eigh(0.5 * (support + support.T))
        weak, directions = [], 0
        for k in range(len(vals)):
            if vals[k] < self.min_informed:
                directions += 1
                loading = vecs[:, k].abs()
                big = torch.nonzero(loading >= 0.5 * loading.max())[:, 0].tolist()
                weak += [names[j] for j in big]
        return {
            "informed_units": [round(float(v), 3) for v in vals],
            "weak_terms": sorted(set(weak)),
            "weak_directions": directions,
        }

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """A unit is "weak" when its predictions at ``x`` lean on weakly identified directions.

        With W the orthonormal weak directions of the chosen basis (eigenvectors of the
        summed ``support`` below ``min_informed``, as :meth:`identification`), the share
        of the unit's predictive variance that its coefficients along W explain
        (:func:`fedcal.core.identify.unlearned_share`),

            s_i = Σ_rows (φᵀV_iW)(WᵀV_iW)⁻¹(WᵀV_iφ) / Σ_rows (φᵀV_iφ + σ_i²),

        is the part of its prediction's uncertainty that the fleet's data did not learn
        (the vague ``init_scale`` prior). The unit is weak when s_i > ``WEAK_SHARE``
        (one half): its number is mostly the starting prior's, not a calibration. A
        unit whose own points determine W has a small V_i along W and is not weak.
        """
        n = x.shape[0]
        _, idx = self.selection.chosen_features(server)
        support = server["support"][idx][:, idx]
        none = torch.zeros(n, dtype=torch.bool)
        # a diverged fleet's support (not finite): no flag, its status is the divergence rule's
        if not torch.any(support != 0) or not bool(torch.isfinite(support).all()):
            return {"weak": none}
        weak_in_chosen = unlearned_directions(support, self.min_informed)
        if not weak_in_chosen.shape[1]:
            return {"weak": none}
        p = len(self.selection.terms)
        full = torch.zeros(server["support"].shape[0], weak_in_chosen.shape[1], dtype=F64)
        full[idx] = weak_in_chosen
        w = full[:p]  # φ's coordinates (a direction term's share is not in predict)
        phi = legendre_products(x.to(F64), self.selection.terms)  # (clients, rows, p)
        cov = personal["cov"].to(F64)[..., :p, :p]
        share = unlearned_share(phi, cov, personal["noise_var"].reshape(n), w, mask)
        return {"weak": share > WEAK_SHARE}

    def export_state(self, server: Tree, note: str = "") -> dict[str, Any]:
        """The fleet prior as JSON-able data: what ``fedcal calibrate`` needs; ``note``: why
        no interval is stated for (some) units (the calibrated interval's record).

        With ``select = "bic"`` it is the chosen basis's prior (its own terms), and
        ``selection`` records the choice (parameters that rebuild that basis) and
        every candidate's score.
        """
        terms, _ = self.selection.chosen(server)
        _, idx = self.selection.chosen_features(server)  # μ and Σ over (c, h) jointly
        psi, pinned = self.selection.chosen_branch(server), []
        if psi and "pinned" in server and bool((server["pinned"] > 0).any()):
            # Part of ψ is out of the model (fedprior_pins): ψ is stored whole
            # (μ_J = 0, Σ_JJ = floor, uncoupled) with J named, so the rebuilt basis is the
            # chosen candidate's and a calibrated unit pins the same terms.
            base = (
                self.selection.masks[int(server["choice"])]
                if "choice" in server
                else self.selection.masks[-1]
            )
            idx, p = torch.nonzero(base)[:, 0], len(self.selection.terms)
            psi = tuple(self.selection.branch_terms[j - p] for j in idx.tolist() if j >= p)
            out = [j for j in idx.tolist() if j >= p and float(server["pinned"][j]) > 0]
            pinned = [list(self.selection.branch_terms[j - p]) for j in out]
        state = {
            "kind": "fedprior",
            "terms": [list(t) for t in terms],
            "term_names": [term_name(t) for t in terms],
            "mu": server["mu"][idx].tolist(),
            "sigma": server["sigma"][idx][:, idx].tolist(),
            "noise_var": float(server["noise_var"]),
            "noise": self.noise,
            "noise_prior_points": self.noise_prior_points,
            "identification": self.identification(server),
        }
        if self.noise_shape == "inputs":  # σ²(x) = σ² exp(γᵀx), x scaled (fedprior_noise)
            state["noise_gamma"] = server["noise_gamma"].tolist()
        if "noise_student" in server:  # noise_tail = "auto": the fleet's choice (N6)
            state["noise_student"] = int(server["noise_student"])
        if self.interval == "calibrated":
            state["interval"] = {
                "rule": "calibrated",
                "discrepancy_var": float(server["disc_var"]),
                "probe_rows": float(server["probe_n"]),
                "residual_dof": float(server["dof"]),
                "declined": int(server["declined"]),
                "reason": note,
            }
            if "weak_proj" in server:  # I3: weakly identified directions (each unit's test)
                weak = server["weak_proj"][idx][:, idx]
                state["interval"]["weak_projector"] = weak.tolist()
            if "disc_own" in server:  # I4's τ² of units with ≥ 2× the probe's rows (NaN: none)
                own = float(server["disc_own"])
                state["interval"]["discrepancy_var_own"] = None if math.isnan(own) else own
        if psi:
            state["branch_terms"] = [list(t) for t in psi]
            state["branch_term_names"] = [f"b·{term_name(t)}" for t in psi]
        if pinned:  # ψ terms out of the model (read back by fedcal.calibration.prior_server)
            state["branch_pinned"] = pinned
        if self.selection.select != "none":
            state["selection"] = {
                "rule": self.selection.select,
                "chosen": self.selection.candidates[int(server["choice"])],
                "candidates": list(self.selection.candidates),
                "scores": [round(float(v), 3) for v in server["scores"]],
            }
        if self.selection.branch_orders and not psi:  # the direction term is out (unidentified): a
            # prior without it, rebuilt as such (``fedcal calibrate`` applies ``chosen``)
            selection = state.setdefault("selection", {"rule": "identification", "chosen": {}})
            selection["chosen"] = {**selection["chosen"], "branch_orders": []}
        return state

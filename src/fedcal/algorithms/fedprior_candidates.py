"""Every candidate basis's EM (``select = "bic"``, ``select_by = "candidates"``).

While the fleet chooses its basis (:mod:`~fedcal.algorithms.fedprior_select`), every candidate
k runs its own EM in the same federation, next to the EM of the basis in use:

C1. **Server state.** Each candidate's prior (μ_k, Σ_k, σ_k²) under ``cand``, all starting
    from the vague start; the chosen candidate is the largest (the basis asked for) until
    the first BIC choice, so round 0 screens as without selection.
C2. **E-step, client i** (closed form): for every candidate at once, the posterior under
    (μ_k, Σ_k, σ_k²) of the unit's moments restricted to the candidate's terms (the other
    rows and columns of G and b zeroed: exactly the sub-basis model, the unused coordinates
    see no data and keep their prior), and its terms of the M-step sums, its log-evidence
    log p(y_i | θ_k) and, with ``noise = "sensor"``, its own σ_ik² (the MAP of
    :func:`~fedcal.algorithms.fedprior_noise.sensor_noise`). With the candidates' sample
    (R1 of :mod:`~fedcal.algorithms.fedprior_rounds`, ``cand_rate`` broadcast) only the units
    whose own draw falls below the rate compute them; the others upload zeros and ``unit`` 0.
C3. **M-step, server**: each candidate's M-step on its own summed statistics, in its own
    masked design metric (with the sample: the sample's sums, its n and its count N_s), or
    the fleet's restart from the vague start when the direction term's unidentified
    coordinates changed (:meth:`~fedcal.algorithms.fedprior_pins.BranchPins.restart`).
C4. **The choice**: the candidate of highest BIC of the fleet's summed evidence (Schwarz
    1978), Σ_i log p(y_i | θ_k) − ½ d_k log N, at the broadcast θ_k (each candidate's EM
    converges to its maximum); d_k counts the ψ coordinates out of the model as no
    parameters, and a candidate that differs from an earlier one only in those is that one,
    not a rival (ties: the smaller, listed first). Once R1 freezes the choice, the chosen
    candidate's EM goes on alone in its own design metric (:meth:`CandidateEMs.frozen_metric`).

:class:`CandidateEMs` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``candidate_ems``), declared by the selection it runs (``selection``), the rounds' schedule
(``schedule``: R1's sample), ``noise``, ``noise_prior_points``, ``interval`` (whether the
residual terms of I1 travel) and the direction term's pins (``pins``). The model's own
E-step terms and M-step are FedPrior's, passed to :meth:`CandidateEMs.e_step` and
:meth:`CandidateEMs.m_steps` (as :meth:`BranchPins.pinned_update` is given the M-step), so the
candidates run the same equations as the basis in use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_noise import sensor_noise
from fedcal.algorithms.fedprior_pins import BranchPins
from fedcal.algorithms.fedprior_rounds import RoundSchedule
from fedcal.algorithms.fedprior_select import EvidenceSelection
from fedcal.core.bayes import F64, Moments, Posterior, posterior, repeated_factor
from fedcal.core.tree import Tree, gather

# FedPrior's E-step terms of one posterior (post, gram, noise, n or None) and its M-step
# (old μ, sums, count, metric, old σ², pinned) -> (μ, Σ, σ²)
UnitTerms = Callable[[Posterior, Tensor, Tensor, Tensor | None], Tree]
PriorUpdate = Callable[..., tuple[Tensor, Tensor, Tensor]]
PRIOR_KEYS = ("mu", "sigma", "noise_var")


@dataclass(frozen=True)
class CandidateEMs:
    """C1–C4 of the module doc: every candidate's EM and the fleet's BIC choice."""

    selection: EvidenceSelection
    schedule: RoundSchedule
    noise: str  # "fleet" or "sensor"
    noise_prior_points: float  # ν of the candidates' σ_ik² (as the model's)
    interval: str  # "calibrated": the residual terms of I1 travel too
    pins: BranchPins

    @property
    def on(self) -> bool:
        """Whether every candidate runs its own EM (:attr:`EvidenceSelection.each_candidate`)."""
        return self.selection.each_candidate

    def running(self, down: Tree) -> bool:
        """Whether this round's broadcast carries the candidates (R1: not once frozen)."""
        return self.on and "cand" in down

    # ---- C1 ----
    def init(self, start: Tree) -> Tree:
        """The chosen candidate before the first choice (the largest) and, when every candidate
        runs its EM, their priors from ``start``'s; {} without selection."""
        masks = self.selection.masks
        if self.selection.select == "none":
            return {"mask": masks[-1].clone()} if self.selection.branch_orders else {}
        k = masks.shape[0]
        chosen = {"mask": masks[-1].clone(), "choice": torch.tensor(k - 1)}
        chosen["scores"] = torch.zeros(k, dtype=F64)
        if not self.on:  # select_by = "marginal": one EM, on the full basis
            return chosen
        keys = (*PRIOR_KEYS, "support")
        return {
            **chosen,
            "cand": {key: start[key].expand(k, *start[key].shape).clone() for key in keys},
        }

    def broadcast(self, server: Tree) -> Tree:
        """The candidates' priors and R1's rate, while they run (not once the choice is frozen)."""
        if not (self.on and "cand" in server):
            return {}
        down = {"cand": {k: server["cand"][k] for k in PRIOR_KEYS}}
        if "cand_rate" in server:  # R1: the share of units whose draw runs the candidates
            down["cand_rate"] = server["cand_rate"]
        return down

    def client_init(self, down: Tree) -> Tree:
        """Each unit's σ_ik² per candidate (the broadcast's to start)."""
        return {"cand_noise_var": down["cand"]["noise_var"].clone()} if self.on else {}

    # ---- C2 ----
    def uploads(
        self, down: Tree, state: Tree, full: Moments, terms: UnitTerms
    ) -> tuple[Tree | None, Tree]:
        """(the reply's ``cand``, or None once frozen; the unit's new candidate state)."""
        if self.running(down):
            cand, own = self.e_step(down, state, full, terms)
            return cand, {
                "cand_noise_var": own if self.noise == "sensor" else state["cand_noise_var"]
            }
        if "cand_noise_var" in state:  # R1: frozen, the candidates' σ_i² kept as they were
            return None, {"cand_noise_var": state["cand_noise_var"]}
        return None, {}

    def e_step(
        self, down: Tree, state: Tree, full: Moments, terms: UnitTerms
    ) -> tuple[Tree, Tensor]:
        """Every candidate's E-step at once (C2): (clients, candidates, ...) statistics and
        the units' σ_ik² (clients, candidates); ``terms``: the model's E-step terms."""
        sampled = self.schedule.sampled(down, full.rhs)
        if sampled is not None and not bool(sampled.all()):  # R1: the sampled units', zeros else
            return self._sampled(down, state, full, sampled, terms)
        stats, c, p, k = self.selection.candidate_moments(down, full)
        cand = down["cand"]
        noise = state["cand_noise_var"] if self.noise == "sensor" else cand["noise_var"]
        noise = noise.reshape(-1)
        sigma, factor = cand["sigma"], None
        if c and sigma.stride(0) == 0:  # the broadcast's k priors: each factored once, not c×
            sigma, factor = None, repeated_factor(sigma[0], c)
        else:
            sigma = sigma.reshape(-1, p, p)
        post = posterior(stats, cand["mu"].reshape(-1, p), sigma, noise, factor)
        out = terms(post, stats.gram, noise, stats.n if self.interval == "calibrated" else None)
        fleet = cand["noise_var"].reshape(-1)
        own = sensor_noise(post.rss, stats.n, fleet, self.noise_prior_points)
        out = {key: v.reshape(c, k, *v.shape[1:]) for key, v in out.items()}
        if "cand_rate" in down:  # R1: which units' terms the candidates' sums hold
            out["unit"], out["n"] = torch.ones(c, k, dtype=F64), full.n.unsqueeze(1).expand(c, k)
        return out, own.reshape(c, k)

    def _sampled(
        self, down: Tree, state: Tree, full: Moments, sampled: Tensor, terms: UnitTerms
    ) -> tuple[Tree, Tensor]:
        """:meth:`e_step` of the ``sampled`` units (R1 of fedprior_rounds), zeros for the
        others (their upload holds no candidate terms: ``unit`` 0)."""
        idx = torch.nonzero(sampled)[:, 0]
        run = idx if idx.numel() else torch.zeros(1, dtype=torch.long)  # (shapes: one unit)
        sub_down = gather({k: v for k, v in down.items() if k != "cand"}, run)
        sub_down["cand"] = {k: _rows(v, run) for k, v in down["cand"].items()}
        sub_down["cand_rate"] = torch.ones_like(sub_down["cand_rate"])  # every one of them
        sub_full = Moments(*(v.index_select(0, run) for v in full))
        part, own_part = self.e_step(sub_down, gather(state, run), sub_full, terms)
        c = full.n.shape[0]
        out = {key: v.new_zeros(c, *v.shape[1:]) for key, v in part.items()}
        own = state["cand_noise_var"].clone()
        if idx.numel():
            for key, v in part.items():
                out[key][idx] = v
            own[idx] = own_part
        return out, own

    # ---- C3 ----
    def m_steps(
        self,
        server: Tree,
        cand: Tree,
        total: Tree,
        count: Tensor,
        metric: Tensor,
        pinned: Tensor,
        update: PriorUpdate,
    ) -> dict[str, Tensor]:
        """Every candidate's M-step (``update``: the model's) on its own summed statistics
        ``cand``, stacked over the candidates; the fleet's restart, if any, for all of them."""
        new: dict[str, list[Tensor]] = {key: [] for key in PRIOR_KEYS}
        restart = self.pins.restart(server, pinned, total["gram"])
        units = count
        if "unit" in cand:  # R1: the sampled units' sums (their n, their count)
            units = cand["unit"][0].clamp_min(1.0)
        for k, m in enumerate(self.selection.masks):
            part = {**{key: v[k] for key, v in cand.items()}}
            part["n"] = part["n"] if "unit" in cand else total["n"]
            out = restart or update(
                server["cand"]["mu"][k],
                part,
                units,
                metric * m.unsqueeze(0) * m.unsqueeze(1),
                server["cand"]["noise_var"][k],
                pinned,
            )
            for key, v in zip(PRIOR_KEYS, out, strict=True):
                new[key].append(v)
        return {**{key: torch.stack(v) for key, v in new.items()}, "support": cand["support"]}

    # ---- C4 ----
    def choice(self, cand: Tree, count: Tensor, pinned: Tensor) -> tuple[Tensor, int, Tensor]:
        """(BIC scores, the BIC choice, which candidates repeat an earlier one): C4 from the
        summed candidate statistics ``cand`` of ``count`` units."""
        eff = self.selection.masks * (~pinned).to(F64)  # the ψ coordinates J out: no parameters
        free = self.selection.prior_parameters(eff)
        units = cand["unit"][0].clamp_min(1.0) if "unit" in cand else count  # R1: the sample's
        scores = cand["loglik"] - 0.5 * free * math.log(float(units))
        same = (eff.unsqueeze(0) == eff.unsqueeze(1)).all(-1).tril(-1).any(-1)
        return scores, int(torch.argmax(torch.where(same, -math.inf, scores))), same

    def frozen_metric(self, server: Tree, metric: Tensor) -> Tensor:
        """The chosen candidate's masked design metric, once R1 froze the choice."""
        m = self.selection.masks[int(server["choice"])]
        return metric * m.unsqueeze(0) * m.unsqueeze(1)

    def frozen(self, server: Tree) -> Tree:
        """The choice as frozen (R1): its index, scores and mask."""
        out = {k: server[k] for k in ("choice", "scores")}
        out["mask"] = self.selection.masks[int(server["choice"])]
        return out


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` of a client tensor; a broadcast (stride 0 along the clients: every row
    the same) stays one, so that :meth:`CandidateEMs.e_step` factors its priors once."""
    if t.dim() and t.stride(0) == 0:
        return t[:1].expand(len(index), *t.shape[1:])
    return t.index_select(0, index)

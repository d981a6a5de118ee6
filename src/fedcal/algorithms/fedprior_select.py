"""The fleet prior's basis chosen by the fleet's evidence (``select = "bic"``).

Complexity from the fleet's evidence (``select = "bic"``). The orders are an
upper bound; every sub-basis (each input's order 0..its bound; for a
total-degree basis every degree 0..``degree``) is a candidate, and all
candidates' EM runs in the same federation: a client's E-step is repeated per
candidate on its moments restricted to that candidate's terms (exactly the
sub-basis model; the other coefficients see no data), and it uploads each
candidate's statistics and log-evidence log p(y_i | μ_k, Σ_k, σ_k²). The
server updates every candidate and keeps the one of highest BIC (Schwarz 1978)
of the fleet's summed evidence,

    BIC_k = Σ_i log p(y_i | θ_k) − ½ d_k log N,   d_k = p_k + p_k(p_k + 1)/2 + 1

(μ, full Σ, σ²; N units), as the model every unit uses and exports. A fleet
whose units all have few points cannot learn a large prior and gets a smaller
basis; a fleet with calibrated units keeps a rich one. The server's screening
judges a client by the chosen candidate's statistics only
(``unscreened_replies``): a misfitting candidate has large statistics for
honest units, and judging by them rejected honest units (measured: a mixed
3×2 fleet fell to 7.9 hPa). A client rejected by that test is left out of
every candidate's sums.

:class:`EvidenceSelection` is a part of :class:`~fedcal.algorithms.fedprior.FedPrior` (its
``selection``): the candidates and their masks over the full design, each candidate's moments
(client side: FedPrior runs every candidate's E-step on them in one batch), each candidate's
number of prior parameters for the BIC (server side, which runs every candidate's M-step in
``FedPrior.server_update``), the marginal scores and choice (``select_by = "marginal"``), and
the basis in use read back from the server's ``mask``. Its declared state: the selection's
settings (``select``, ``select_by``, ``select_clip``, ``dp_select_share``), the basis's
(``tensor``: orders or total degree, ``orders``, ``degree``, ``branch_orders``,
``branch_select``, ``rank``), the number of inputs and the full basis's ``terms`` and
``branch_terms``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from fedcal.core.bayes import F64, Moments, posterior
from fedcal.core.privacy import Statistic
from fedcal.core.tree import Tree
from fedcal.models.basis import legendre_exponents, orders_by_size


@dataclass(frozen=True)
class EvidenceSelection:
    """The candidates of ``select = "bic"``, their moments, the BIC and the basis in use."""

    select: str  # "none" or "bic"
    select_by: str  # "candidates" (each its own EM) or "marginal" (one EM, scores)
    select_clip: float  # |a unit's marginal score| ≤ this (nats)
    dp_select_share: float  # the scores' share of a DP round's budget
    rank: int  # Σ's factors (0: full), for the parameter count
    inputs: int
    tensor: bool  # the basis is the tensor product of ``orders`` (else total ``degree``)
    orders: tuple[int, ...]
    degree: int
    terms: tuple[tuple[int, ...], ...]  # φ's, the full basis
    branch_orders: tuple[int, ...]
    branch_terms: tuple[tuple[int, ...], ...]  # ψ's, the full direction term
    branch_select: bool

    @cached_property
    def candidates(self) -> tuple[dict[str, Any], ...]:
        """The bases ``select = "bic"`` chooses from, as parameter overrides, smallest first.

        Tensor basis: every orders vector ≤ ``orders`` (each input 0..its order);
        total-degree basis: every degree 0..``degree``. Each is a sub-basis of
        :attr:`terms`. ``select = "none"``: the basis itself only.
        """
        if self.select == "none":
            return ({},)
        if self.tensor:
            out = [{"orders": list(o)} for o in orders_by_size(self.orders)]
        else:
            out = [{"degree": d} for d in range(self.degree + 1)]
        if not (self.branch_select and self.branch_orders):
            return tuple(out)
        # ψ options: none, then every orders vector ≤ branch_orders, smallest first; the
        # product with φ's candidates is ordered by total size (ties: φ's order, then ψ's).
        psi = [[], *(list(o) for o in orders_by_size(self.branch_orders))]
        size = [len(self.candidate_terms(c)) for c in out]
        both = [
            (size[i] + (math.prod(a + 1 for a in b) if b else 0), i, j)
            for i in range(len(out))
            for j, b in enumerate(psi)
        ]
        return tuple({**out[i], "branch_orders": psi[j]} for _, i, j in sorted(both))

    def candidate_branch_terms(self, candidate: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        """ψ's terms of one candidate (all of :attr:`branch_terms` unless ψ is selected)."""
        if "branch_orders" not in candidate:
            return self.branch_terms
        if not candidate["branch_orders"]:
            return ()
        return legendre_exponents(self.inputs, orders=candidate["branch_orders"])

    def candidate_terms(self, candidate: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
        """The terms of one candidate, in its own basis order (constant first)."""
        if "orders" not in candidate and "degree" not in candidate:
            return self.terms
        if "orders" in candidate:
            return legendre_exponents(self.inputs, orders=candidate["orders"])
        return legendre_exponents(self.inputs, degree=candidate["degree"])

    @cached_property
    def masks(self) -> Tensor:
        """(candidates, features): 1 where a candidate's basis holds a term of :attr:`terms`.

        The direction term's ψ columns are in every candidate, unless ψ is selected
        (``branch_select``): then those of the candidate's ψ.
        """
        q = len(self.branch_terms)
        out = torch.ones(len(self.candidates), len(self.terms) + q, dtype=F64)
        for k, cand in enumerate(self.candidates):
            keep = set(self.candidate_terms(cand))
            out[k, : len(self.terms)] = torch.tensor(
                [float(t in keep) for t in self.terms], dtype=F64
            )
            keep_psi = set(self.candidate_branch_terms(cand))
            out[k, len(self.terms) :] = torch.tensor(
                [float(t in keep_psi) for t in self.branch_terms], dtype=F64
            )
        return out

    def candidate_moments(self, down: Tree, full: Moments) -> tuple[Moments, int, int, int]:
        """The moments ``full`` (clients, ...) masked to each candidate's terms, flattened to
        (clients × candidates, ...) rows, and (clients, p, candidates); ψ coordinates out of
        the model (``pinned``, fedprior_pins.BranchPins) are out of every candidate."""
        masks = self.masks
        if "pinned" in down:
            masks = masks * (1.0 - down["pinned"].to(F64).reshape(-1, masks.shape[1])[:1])
        c, p = full.rhs.shape
        k = masks.shape[0]
        mm = masks.unsqueeze(0).expand(c, k, p)
        stats = Moments(
            (full.gram.unsqueeze(1) * mm.unsqueeze(-1) * mm.unsqueeze(-2)).reshape(c * k, p, p),
            (full.rhs.unsqueeze(1) * mm).reshape(c * k, p),
            full.yy.unsqueeze(1).expand(c, k).reshape(-1),
            full.n.unsqueeze(1).expand(c, k).reshape(-1),
        )
        return stats, c, p, k

    @property
    def each_candidate(self) -> bool:
        """Whether every candidate runs its own EM (``select = "bic"``, ``select_by =
        "candidates"``); with ``select_by = "marginal"`` one EM runs on the full basis."""
        return self.select != "none" and self.select_by == "candidates"

    def marginal_scores(self, down: Tree, noise: Tensor, full: Moments) -> Tensor:
        """Each unit's score of every candidate (clients, candidates) for ``select_by =
        "marginal"``: its log-evidence under the candidate's marginal of the broadcast full
        prior, relative to the full basis and clipped to ± b = ``select_clip``,

            s_ik = clip(log N(y_i; Φ_ik μ_k, Φ_ik Σ_kk Φ_ikᵀ + σ² I) − log p(y_i | μ, Σ, σ²), ±b)

        (μ_k, Σ_kk: μ and Σ restricted to candidate k's terms; the full basis scores 0).
        Computed as the candidates' E-step is (``FedPrior._candidates_e_step``), on the
        moments masked to the candidate's terms (the other coefficients see no data and do
        not move y). ``noise``: the unit's σ² (the fleet's or its own).
        """
        stats, c, p, k = self.candidate_moments(down, full)
        mu = down["mu"].to(F64).expand(c, p).unsqueeze(1).expand(c, k, p).reshape(-1, p)
        sigma = down["sigma"].to(F64).expand(c, p, p).unsqueeze(1).expand(c, k, p, p)
        noise = noise.to(F64).expand(c).unsqueeze(1).expand(c, k)
        post = posterior(stats, mu, sigma.reshape(-1, p, p), noise.reshape(-1))
        loglik = post.loglik.reshape(c, k)
        # The last candidate is the full basis. Clipped per candidate, not by the vector's
        # norm: a norm clip shrinks a unit's mild preferences by its largest one.
        return (loglik - loglik[:, -1:]).clamp(-self.select_clip, self.select_clip)

    def marginal_choice(
        self, total: Tensor, count: Tensor, pinned: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The candidate of highest BIC from the summed (under DP: clipped and noised)
        scores: Σ_i s_ik − ½ d_k log N (Schwarz 1978; the constant Σ_i log p(y_i | θ) of
        the full basis drops out of the argmax). Post-processing of a released sum.
        ``pinned``: the ψ coordinates out of the model, no parameters (as the candidates'
        EM counts them, ``FedPrior.server_update``)."""
        masks = self.masks
        eff = masks if pinned is None else masks * (~pinned).to(F64)
        scores = total.to(F64) - 0.5 * self.prior_parameters(eff) * math.log(float(count))
        # ties: the smaller candidate (listed first); one that differs from an earlier one
        # only in pinned ψ terms is that one, not a rival
        same = (eff.unsqueeze(0) == eff.unsqueeze(1)).all(-1).tril(-1).any(-1)
        choice = int(torch.argmax(torch.where(same, -math.inf, scores)))
        return {"mask": masks[choice], "choice": torch.tensor(choice), "scores": scores}

    def dp_select_statistic(self, others: dict[str, Statistic]) -> Statistic:
        """Client-level DP of the candidates' scores: one Gaussian mechanism with the sums.

        Each unit's score vector s_i (:meth:`marginal_scores`, each entry within ± b,
        b = ``select_clip``) is clipped to L2 norm B = b √K (K candidates; a no-op for
        an honest unit): its sensitivity. It joins the reply of the
        other statistics with weight w, w² = f/(1 − f) Σ_l w_l² (f = ``dp_select_share``),
        so in :func:`fedcal.core.privacy.noise_std` the normalized reply's sensitivity is
        √(Σ_l w_l² + w²) and its sum gets N(0, (σ √(Σ w²) B / w)²) per candidate. That is
        the composition of a mechanism on the scores with multiplier σ/√f and one on the
        other sums with σ/√(1 − f) (Gaussian RDP α/2σ² adds: f/σ² + (1 − f)/σ² = 1/σ²),
        so the run's accountant (σ per round) covers the selection unchanged, its ε the
        ε printed; the choice (:meth:`marginal_choice`) is post-processing.
        """
        rest = sum(s.weight**2 for s in others.values())
        share = self.dp_select_share
        bound = self.select_clip * math.sqrt(len(self.candidates))
        return Statistic(bound, "vector", weight=math.sqrt(share / (1 - share) * rest))

    def prior_parameters(self, masks: Tensor) -> Tensor:
        """Free parameters d_k of each candidate's prior: μ (p), Σ (full or rank r + D), σ²."""
        p = masks.sum(1)
        if self.rank:
            r = torch.minimum(p, torch.tensor(float(self.rank), dtype=F64))
            cov = p * r - r * (r - 1) / 2 + p
        else:
            cov = p * (p + 1) / 2
        return p + cov + 1

    def chosen_features(self, server: Tree) -> tuple[list[str], Tensor]:
        """Names and indices (in the design) of the features in use: φ's chosen terms, then ψ's.

        Read from the server's ``mask`` (the chosen candidate's, :attr:`masks`); a
        sub-basis keeps the full basis's term order, so its own order is ascending index.
        """
        mask = server["mask"] if "mask" in server else self.masks[-1]
        idx = torch.nonzero(mask)[:, 0]
        p = len(self.terms)
        names = [
            term_name(self.terms[j]) if j < p else f"b·{term_name(self.branch_terms[j - p])}"
            for j in idx.tolist()
        ]
        return names, idx

    def chosen(self, server: Tree) -> tuple[tuple[tuple[int, ...], ...], Tensor]:
        """The basis in use: its terms (own order) and their indices in :attr:`terms`."""
        _, idx = self.chosen_features(server)
        idx = idx[idx < len(self.terms)]
        return tuple(self.terms[j] for j in idx.tolist()), idx

    def chosen_branch(self, server: Tree) -> tuple[tuple[int, ...], ...]:
        """ψ's terms in use (all of :attr:`branch_terms` unless ψ is selected)."""
        _, idx = self.chosen_features(server)
        p = len(self.terms)
        return tuple(self.branch_terms[j - p] for j in idx.tolist() if j >= p)


def _masked(stats: Moments, mask: Tensor) -> Moments:
    """The moments of the sub-basis ``mask`` (…, p): other rows/columns of G and b zeroed."""
    m = mask.to(F64)
    return Moments(stats.gram * m.unsqueeze(-1) * m.unsqueeze(-2), stats.rhs * m, stats.yy, stats.n)


def term_name(exponents: tuple[int, ...]) -> str:
    """A readable name of a basis term: (2, 1) → 'P2(x0)·P1(x1)', (0, 0) → '1'."""
    parts = [f"P{a}(x{j})" for j, a in enumerate(exponents) if a]
    return "·".join(parts) or "1"

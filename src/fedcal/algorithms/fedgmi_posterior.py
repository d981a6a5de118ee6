"""FedGMI's Bayesian head: a closed-form head posterior under a fleet prior (ours).

Ours (issue 10): FedGMI with ``interpolation="posterior"``, the Bayesian head (config
variants ``fedgmi_posterior``, ``fedgmi_posterior_frozen``). The head
is linear in the body's features: y = Φ_i c_i + ε, Φ_i = [h_ω(x), 1]
(n_i × (d+1)), ε ~ N(0, σ²), under a fleet prior c_i ~ N(μ_h, Σ_h). Per
round, client i (FedRep-style):

1. features h_{ω^t}(x) of its rows under the received body ω^t;
2. the head posterior N(m_i, V_i) (:func:`fedcal.core.bayes.posterior`),

       m_i = (G_i/σ² + Σ_h⁻¹)⁻¹ (G_i ĉ_i/σ² + Σ_h⁻¹ μ_h),   G_i = Φ_iᵀΦ_i, ĉ_i = G_i⁻¹Φ_iᵀy_i:

   a precision-weighted interpolation between the fleet head μ_h and the
   sensor's own least-squares head ĉ_i — per direction of head space, the
   principled form of alg. 3.3's per-parameter α (Σ_h → ∞ gives ĉ_i, Σ_h → 0
   gives μ_h); the personal head is m_i;
3. the body alone is trained for E epochs with the head fixed at m_i; the
   client uploads the body and the head statistics of the server's M-step —
   computed with the features of step 1, under the broadcast ω^t: that is the
   one body every client shares, so all clients' heads live in the same
   coordinates (after local body training each client's features differ);
4. server: ω^{t+1} = mean of the bodies; (μ_h, Σ_h, σ²) by one EM step,
   μ_h = (1/N) Σ_i m_i, Σ_h = (1/N) Σ_i (m_i m_iᵀ + V_i) − μ_h μ_hᵀ, Σ_h
   regularized as fedprior's (:func:`fedcal.core.bayes.regularize`: shrinkage
   toward its diagonal in the fleet's feature metric, optional factors,
   eigenvalue floor); σ² = Σ_i E‖y_i − Φ_i c_i‖² / Σ_i n_i. Not fedprior's
   ECME (GLS) mean: its Φᵀ C⁻¹ Φ = (G − G L A⁻¹ Lᵀ G / σ²) / σ² cancels
   catastrophically when the features are nearly collinear (tanh features: the
   smallest eigenvalue of G is ~1e-13 of the largest) and σ² ≪ Σ_h — measured
   on the default fleet in round 0: 0.5 % error and negative eigenvalues, μ_h
   thrown to norm 1e6, the Cholesky factorization failing in round 2. EM uses
   only m_i and V_i, which the whitened posterior computes stably.

The personal model is (ω^{t+1}, m_i) with m_i recomputed under ω^{t+1} and
the latest prior (``evaluate="global_body"``, as ``fedgmi_posterior`` sets
it), which carries V_i and σ² for a predictive σ; or the client's last
locally trained (ω_i, m_i) (``evaluate="local"``). ``local_epochs = 0``
never trains the body (``fedgmi_posterior_frozen``): the heads alone, on the
initial body's random features. ``finetune_*``,
``magnitude``, ``normalize``, ``interpolate`` and ``upload`` are the gradient
rule's and unused here.

Screening (issue 20 item 3): n_i, G_i and the support are functions of the unit's inputs
and grow with its rows (a reference unit with 384 points had 57 × the median size of
6-point units, and all 20 were rejected in every round); the size screen judges, leaf by
leaf, the body update, the head's expected whitened distance from the broadcast prior
(from m_i, S_i) and the residual sum r_i, raw or per row (a 6-point unit's r_i / n_i is
mostly its posterior-variance term: per row alone, the 20 new units of the mixed fleet were
18–24 × the median in round 1) (:meth:`FedGMIPosterior.screen_view`,
:func:`fedcal.core.stages.view_sizes`); n_i and G_i are checked for consistency (n_i = the
declared rows, G_i PSD with G_dd = n_i for the constant feature,
:meth:`FedGMIPosterior.inconsistent_replies`). A unit whose targets are ×1000 moves m_i by
×1000 and is still rejected by size.

Weak units (issue 20). The head is linear in its parameters, so the rule of fedprior
applies (:mod:`fedcal.core.identify`): each unit uploads its head data support
I − (I + s²G_i/σ²)⁻¹ (s = ``prior_init_scale``) and the server sums the accepted units'
(the units its prior was learned from, last round: ``head_support``); head directions
fewer than ``MIN_INFORMED`` (2) units determine are unlearned (EM leaves Σ_h there at what
it started from); a unit is ``weak`` when they carry more than half of its predictive
variance at its evaluation inputs: the part knowing Wᵀc would remove,
Σ_rows (φᵀV_iW)(WᵀV_iW)⁻¹(WᵀV_iφ) / Σ_rows (φᵀV_iφ + σ²) > ½ (:func:`unlearned_share`).
The body's own weights are not judged (docs/statuses.md: neural methods).

One class, :class:`FedGMIPosterior` (registered as ``fedgmi_bayes``): a :class:`FedGMI`
whose head rule is the posterior. It shares FedGMI's fields (the variants above are tables
of ``fedgmi``: ``FedGMI(..., interpolation="posterior")`` builds this class), its client
state and its reading of the head as coefficients (:func:`~fedcal.algorithms.fedgmi.head_design`,
:func:`~fedcal.algorithms.fedgmi.head_vector`, :func:`~fedcal.algorithms.fedgmi.head_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from fedcal.algorithms.fedgmi import (
    HEAD_RULES,
    FedGMI,
    head_design,
    head_names,
    head_tree,
    head_vector,
)
from fedcal.core.algorithm import ClientResult
from fedcal.core.bayes import (
    F64,
    Moments,
    Posterior,
    data_support,
    moments,
    posterior,
    predictive_var,
    regularize,
    safe_cholesky,
)
from fedcal.core.data import ClientData
from fedcal.core.identify import UNLEARNED_SHARE, unlearned_directions, unlearned_share
from fedcal.core.robust import count_problems, gram_problems
from fedcal.core.task import Task
from fedcal.core.tree import Tree, weighted_mean
from fedcal.status import Status

MIN_INFORMED = 2.0  # a head direction fewer units' points determine is unlearned (fedprior's)


def finite_posterior(stats: Moments, mu: Tensor, sigma: Tensor, noise_var: Tensor) -> Posterior:
    """:func:`fedcal.core.bayes.posterior` for a cohort (``mu`` (c, p), ``sigma`` (c, p, p),
    ``noise_var`` (c,)), NaN for a client whose inputs are not finite.

    A body that diverged gives non-finite features, and a Cholesky factorization of
    them would stop the whole cohort; the divergence is reported as NaN instead.
    """
    c, p = stats.rhs.shape
    mu, sigma, noise_var = mu.to(F64), sigma.to(F64), noise_var.to(F64)
    ok = (
        stats.gram.isfinite().all(-1).all(-1)
        & stats.rhs.isfinite().all(-1)
        & stats.yy.isfinite()
        & mu.isfinite().all(-1)
        & sigma.isfinite().all(-1).all(-1)
        & noise_var.isfinite()
        & (noise_var > 0)
    )
    ok2, ok3 = ok.reshape(c, 1), ok.reshape(c, 1, 1)
    eye = torch.eye(p, dtype=F64)
    safe = Moments(
        torch.where(ok3, stats.gram, 0.0),
        torch.where(ok2, stats.rhs, 0.0),
        torch.where(ok, stats.yy, 0.0),
        stats.n,
    )
    post = posterior(
        safe,
        torch.where(ok2, mu, 0.0),
        torch.where(ok3, sigma, eye),
        torch.where(ok, noise_var, 1.0),
    )
    return Posterior(
        *(torch.where(ok.reshape(c, *[1] * (t.dim() - 1)), t, torch.nan) for t in post)
    )


@dataclass(frozen=True)
class FedGMIPosterior(FedGMI):
    """FedGMI with the head posterior as its head rule (module doc)."""

    @property
    def uses_local_epochs(self) -> bool:  # the posterior head is closed form
        return False

    interpolation: Literal["posterior"] = "posterior"

    name = "fedgmi_bayes"
    # The body, m_i (the unit's head) and the M-step's sums: m_i m_iᵀ + V_i, RSS, n, Gram.
    uploads = ("model", "statistics")

    def check_task(self, task: Task) -> None:
        super().check_task(task)
        head_names(task)  # a head to read as linear coefficients

    def server_init(self, params: Tree) -> Tree:
        w_name, b_name = head_names(self.task)
        if params[w_name].dim() != 2 or params[w_name].shape[0] != 1 or params[b_name].numel() != 1:
            raise ValueError(
                "interpolation='posterior' needs a head with one output; "
                f"{w_name} has shape {tuple(params[w_name].shape)}"
            )
        mu = head_vector(self.task, {k: v.unsqueeze(0) for k, v in params.items()})[0]
        return {
            "model": params,
            "head_mu": mu,
            "head_sigma": self.prior_init_scale**2 * torch.eye(mu.shape[0], dtype=F64),
            "noise_var": torch.tensor(self.prior_init_noise**2, dtype=F64),
            # Σ_i of the accepted units' head data support (client_status; not broadcast)
            "head_support": torch.zeros(mu.shape[0], mu.shape[0], dtype=F64),
        }

    def broadcast(self, server: Tree) -> Tree:
        return {k: v for k, v in server.items() if k != "head_support"}

    def head_posterior(self, down: Tree, data: ClientData) -> tuple[Moments, Posterior]:
        """Steps 1–2 of the posterior rule: the head's moments and posterior under ω of ``down``."""
        design = head_design(self.task, down["model"], data.x)
        stats = moments(design, data.y[..., 0], data.mask)
        return stats, finite_posterior(
            stats, down["head_mu"], down["head_sigma"], down["noise_var"]
        )

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        """Steps 1–3 of the posterior rule: head m_i, body trained under it, M-step terms."""
        stats, post = self.head_posterior(down, data)
        start = self.task.join(down["model"], head_tree(self.task, post.mean, data.x.dtype))
        if self.local_epochs and self.task.body:
            trained, loss = self.local_train(start, data, wrt=self.task.body)
        else:  # no body, or it stays where it started: report the head's fit instead
            trained, loss = start, (post.rss / stats.n.clamp_min(1.0)).to(data.x.dtype)
        reply = {
            "model": self.task.split(trained)[0],
            "mean": post.mean,
            "second": post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov,
            "rss": post.rss,
            "n": stats.n,
            "gram": stats.gram,
            # how far the unit's own points determine each head direction (client_status)
            "support": data_support(
                stats.gram, down["noise_var"].expand(stats.n.shape[0]), self.prior_init_scale
            ),
        }
        return ClientResult(reply, {"model": trained}, {"train_loss": loss, "loglik": post.loglik})

    # Input-only statistics: judged by consistency, not size (module doc, Screening).
    unscreened_replies = ("n", "gram", "support")

    def screen_view(
        self, replies: dict[str, Tensor], rows: Tensor, broadcast: Tree
    ) -> dict[str, Tensor]:
        """What the size screen judges (module doc): the body, the head's expected distance
        from the broadcast prior, δ_i = √tr(Σ_h⁻¹ E[(c_i − μ_h)(c_i − μ_h)ᵀ]) (from m_i, S_i;
        in prior units, whatever the unit's rows), and the residual sum as a sum over rows."""
        view = {k: v for k, v in replies.items() if k.startswith("model/")}
        mu = broadcast["head_mu"].to(F64)
        chol, _ = safe_cholesky(broadcast["head_sigma"].to(F64))
        m, second = replies["mean"].to(F64), replies["second"].to(F64)
        outer = torch.einsum("ci,j->cij", m, mu)
        spread = second - outer - outer.transpose(-2, -1) + torch.outer(mu, mu)
        inv = torch.cholesky_inverse(chol)
        view["head_distance"] = (inv * spread).sum((-2, -1)).clamp_min(0.0).sqrt()
        view["sum/rss"] = replies["rss"]  # raw or per row: its E-step variance term
        return view

    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str]:
        """n_i = declared rows, G_i PSD with G_dd = n_i (Φ's constant is its last column),
        r_i ≥ 0."""
        idx = accepted.nonzero()[:, 0]
        n = replies["n"].index_select(0, idx)
        gram = replies["gram"].index_select(0, idx).flip(-1, -2)  # the constant first
        whys = gram_problems(gram, n, constant_first=True)
        for j, why in count_problems(n, weights.index_select(0, idx)).items():
            whys.setdefault(j, why)
        rss = replies["rss"].index_select(0, idx)
        for j in (~(rss >= 0)).nonzero()[:, 0].tolist():
            whys.setdefault(j, f"residual sum {float(rss[j]):.3g} < 0")
        return {int(idx[j]): why for j, why in sorted(whys.items())}

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        """Step 4: body = mean of the bodies; (μ_h, Σ_h, σ²) by EM, Σ_h regularized."""
        body = weighted_mean(replies["model"], self.weights(weights))
        # Every unit counts once in the prior; sums in a canonical order (arrival-order free).
        order = torch.from_numpy(np.lexsort(replies["mean"].numpy().T[::-1]).copy())
        stats = {k: v[order].sum(0) for k, v in replies.items() if k != "model"}
        count = float(replies["mean"].shape[0])
        # EM's M-step, μ_h = mean of m_i (not fedprior's GLS mean: see the module doc).
        mu = stats["mean"] / count
        sigma_hat = stats["second"] / count - torch.outer(mu, mu)
        metric = stats["gram"] / stats["n"].clamp_min(1.0)  # the fleet's mean ΦᵀΦ per point
        # A diverged client makes the sums non-finite: the prior is then NaN (and so is
        # every head next round, reported as divergence) instead of a failed factorization.
        finite = sigma_hat.isfinite().all() & metric.isfinite().all()
        eye = torch.eye(mu.shape[0], dtype=F64)
        sigma = regularize(
            torch.where(finite, sigma_hat, eye),
            self.prior_shrinkage,
            self.prior_floor,
            self.prior_rank or None,
            torch.where(finite, metric, eye),
        )
        sigma = torch.where(finite, sigma, torch.nan)
        dtype = server["model"][head_names(self.task)[0]].dtype
        head = {k: v[0] for k, v in head_tree(self.task, mu.unsqueeze(0), dtype).items()}
        return {
            "model": {**server["model"], **body, **head},
            "head_mu": mu,
            "head_sigma": sigma,
            "noise_var": stats["rss"] / stats["n"].clamp_min(1.0),
            "head_support": stats["support"],
        }

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        if self.evaluate == "local":
            return state["model"]
        # (ω^{t+1}, m_i) with m_i under ω^{t+1}'s features and the latest prior.
        _, post = self.head_posterior(down, data)
        noise = down["noise_var"].expand(post.mean.shape[0])
        head = head_tree(self.task, post.mean, data.x.dtype)
        return {**down["model"], **head, "head_cov": post.cov, "noise_var": noise}

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """``weak``: unlearned head directions carry more than half of the unit's predictive
        variance at ``x`` (module doc, "Weak units"); none for ``evaluate="local"``."""
        support = server.get("head_support")  # Σ_i over the units the prior was learned from
        if "head_cov" not in personal or support is None or not bool(support.isfinite().all()):
            return {}  # evaluate="local", or a diverged fleet (its own status)
        weak = unlearned_directions(support.to(F64), MIN_INFORMED)
        if not weak.shape[1]:
            return {Status.WEAK: torch.zeros(x.shape[0], dtype=torch.bool)}
        dtype = personal[head_names(self.task)[0]].dtype  # the body's (x may come as float64)
        design = head_design(self.task, personal, x.to(dtype))
        share = unlearned_share(design, personal["head_cov"], personal["noise_var"], weak, mask)
        return {Status.WEAK: share > UNLEARNED_SHARE}

    def predictive_std(self, params: Tree, x: Tensor) -> Tensor | None:
        """√(Φ(x) V_i Φ(x)ᵀ + σ²) per row (clients, rows, 1) when the model carries V_i."""
        if "head_cov" not in params:
            return None
        design = head_design(self.task, params, x)
        var = predictive_var(design, params["head_cov"], params["noise_var"])
        return var.sqrt().unsqueeze(-1).to(x.dtype)


HEAD_RULES["posterior"] = FedGMIPosterior

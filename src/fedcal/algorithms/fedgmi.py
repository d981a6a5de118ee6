"""FedGMI — gradient-magnitude interpolation of the regressor head (seed 000).

The model is split into a shared feature extractor ω and a private regressor
φ (the last ``task.head_layers`` layers). Per round, client i (algorithm 3.1):

1. hybrid model θ_i^t = (ω^t, φ_i^{t-1}) from the global ω^t and its own head;
2. regressor fine-tune (alg. 3.2 line 4): φ_i^t ← φ_i^{t-1} − η ∇_φ L(D_i; ω^t, φ_i^{t-1}),
   ``finetune_steps`` full-batch steps of size ``finetune_lr``;
3. gradient magnitudes (alg. 3.2 lines 6–12), element-wise over the head:
   g_g = |∇_{φ^t} L(D_i; ω^t, φ^t)|, g_i = |∇_{φ_i^t} L(D_i; ω^t, φ_i^t)|;
4. per-parameter interpolation (alg. 3.3): L_g = ‖g_g‖₂, L_i = ‖g_i‖₂,
   ĝ = g/L, α_j = 1 − ĝ_{i,j}/(ĝ_{i,j} + ĝ_{g,j} + ε),
   φ̂_{i,j} = α_j φ_{i,j}^t + (1 − α_j) φ_{g,j}^t;
5. local training of the whole model θ̂_i = (ω^t, φ̂_i) for E epochs (alg. 3.1 line 11);
6. upload θ̂_i (or only ω, ablation ``upload="body"``); keep the trained
   model — its head is φ_i^t of the next round.

Server (alg. 3.1 line 14): θ^{t+1} = mean of the uploads (or sample-weighted).
The personalized model of client i is its last locally trained θ̂_i
(alg. 3.1 line 16 returns θ̂_1…θ̂_N); ``evaluate="global_body"`` evaluates
(ω^{t+1}, φ_i) instead.

Ablations: ``magnitude="tensor"`` (one α per head tensor, norms of whole
tensors instead of elements), ``interpolate=False`` (start from φ_i: FedPer-
like), ``finetune_steps=0`` (no step 2).

Variant (ours): ``normalize="joint"``. Alg. 3.3 divides each gradient by its
own norm, so ĝ_g and ĝ_i are unit vectors: only the *direction* of each
gradient is compared, never their sizes. A head that has converged on its
sensor (tiny g_i) is then still mixed with the global head as if it had not —
on the simulated fleet α averages ≈0.3 for converged heads, and every round
drags them toward the fleet mean. Dividing both by one norm keeps the
magnitude comparison the seed's text describes ("if the global gradient is
large, keep the local value"): α_j = 1 − g_{i,j}/(g_{i,j} + g_{g,j} + ε·L).

Variant (ours, issue 10): ``interpolation="posterior"``, the Bayesian head
(config variants ``fedgmi_posterior``, ``fedgmi_posterior_frozen``). The head
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.bayes import (
    F64,
    Moments,
    Posterior,
    moments,
    posterior,
    predictive_var,
    regularize,
)
from fedcal.core.data import ClientData, full_batch
from fedcal.core.local import train
from fedcal.core.optim import make_optimizer
from fedcal.core.task import Task
from fedcal.core.tree import Tree, per_client, sq_norm, tree_map, weighted_mean


def interpolation_weights(
    g_global: Tree,
    g_local: Tree,
    eps: float = 1e-8,
    per_tensor: bool = False,
    joint: bool = False,
) -> Tree:
    """α of alg. 3.3 from gradient magnitudes (client trees of |∇|).

    Norms L_g, L_i run over the whole head of each client; a zero norm is
    guarded (ĝ = 0). With ``per_tensor`` each tensor's magnitude is its L2 norm
    and α is one value per tensor, broadcast to its shape. With ``joint`` both
    magnitudes are divided by one norm, sqrt(L_g² + L_i²), instead of each by
    its own (ours, not the seed's: see ``FedGMI.normalize``).
    """
    if per_tensor:
        g_global = {k: v.reshape(v.shape[0], -1).norm(dim=1) for k, v in g_global.items()}
        g_local = {k: v.reshape(v.shape[0], -1).norm(dim=1) for k, v in g_local.items()}
    norm_g = sq_norm(g_global).sqrt()
    norm_i = sq_norm(g_local).sqrt()
    if joint:
        norm_g = norm_i = (norm_g.pow(2) + norm_i.pow(2)).sqrt()
    tiny = torch.finfo(norm_g.dtype).tiny

    def alpha(gg: Tensor, gi: Tensor) -> Tensor:
        hat_g = gg / per_client(norm_g.clamp_min(tiny), gg)
        hat_i = gi / per_client(norm_i.clamp_min(tiny), gi)
        return 1.0 - hat_i / (hat_i + hat_g + eps)

    return tree_map(alpha, g_global, g_local)


def interpolate(phi_local: Tree, phi_global: Tree, alpha: Tree) -> Tree:
    """φ̂ = α·φ_i + (1 − α)·φ_g, leaf-wise (alpha broadcast per tensor if needed)."""

    def mix(pl: Tensor, pg: Tensor, a: Tensor) -> Tensor:
        a = per_client(a, pl) if a.dim() == 1 else a
        return a * pl + (1.0 - a) * pg

    return tree_map(mix, phi_local, phi_global, alpha)


def head_names(task: Task) -> tuple[str, str]:
    """(weight, bias) of a head that is one linear layer; anything else is refused."""
    head = task.head
    weight = [n for n in head if n.endswith("weight")]
    bias = [n for n in head if n.endswith("bias")]
    if len(head) != 2 or len(weight) != 1 or len(bias) != 1:
        raise ValueError(
            f"interpolation='posterior' needs a head of one linear layer (weight, bias); "
            f"this task's head is {list(head)} (set [model] head_layers = 1)"
        )
    return weight[0], bias[0]


def head_design(task: Task, params: Tree, x: Tensor) -> Tensor:
    """Φ = [h_ω(x), 1] (clients, rows, d + 1): the body's features and a constant.

    The head is linear, y = W h + b: evaluating the model with W = I (d × d) and
    b = 0 returns h itself, whatever the body is.
    """
    w_name, b_name = head_names(task)
    c, d = x.shape[0], params[w_name].shape[-1]
    identity = {
        w_name: torch.eye(d, dtype=x.dtype).expand(c, d, d),
        b_name: torch.zeros(c, d, dtype=x.dtype),
    }
    feats = task.predict({**params, **identity}, x)  # (clients, rows, d)
    return torch.cat([feats, torch.ones_like(feats[..., :1])], -1)


def head_vector(task: Task, head: Tree) -> Tensor:
    """A client tree's head as coefficients c = [w, b] (clients, d + 1), float64."""
    w_name, b_name = head_names(task)
    w, b = head[w_name], head[b_name]
    return torch.cat([w.reshape(w.shape[0], -1), b.reshape(b.shape[0], -1)], -1).to(F64)


def head_tree(task: Task, coef: Tensor, dtype: torch.dtype) -> Tree:
    """Inverse of :func:`head_vector`: (clients, d + 1) → {weight (c, 1, d), bias (c, 1)}."""
    w_name, b_name = head_names(task)
    return {
        w_name: coef[:, :-1].unsqueeze(1).to(dtype),
        b_name: coef[:, -1:].to(dtype),
    }


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
class FedGMI(Algorithm):
    @property
    def uses_local_epochs(self) -> bool:  # the posterior head is closed form
        return not self.bayesian

    finetune_steps: Annotated[int, Field(ge=0)] = 1
    finetune_lr: Annotated[float, Field(ge=0.0)] = 0.05
    eps: Annotated[float, Field(ge=0.0)] = 1e-8
    magnitude: Literal["element", "tensor"] = "element"  # seed | ablation
    interpolate: bool = True
    upload: Literal["full", "body"] = "full"  # seed | ablation
    evaluate: Literal["local", "global_body"] = "local"  # seed: θ̂_i | (ω^{t+1}, φ_i)
    normalize: Literal["separate", "joint"] = "separate"  # seed: L_g, L_i | ours: one norm
    interpolation: Literal["gradient", "posterior"] = "gradient"  # seed alg. 3.3 | ours
    # The head prior of interpolation="posterior" (see the module doc):
    # λ: Σ_h ← (1 − λ)Σ̂ + λ diag(Σ̂), in the feature metric
    prior_shrinkage: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05
    prior_rank: Annotated[int, Field(ge=0)] = 0  # > 0: Σ_h = W Wᵀ + D, this many factors; 0: full
    prior_floor: Annotated[float, Field(gt=0.0)] = 1e-9  # eigenvalues of Σ_h ≥ floor · their mean
    # prior std of every head coefficient, and the noise std, before any data (scaled units)
    prior_init_scale: Annotated[float, Field(gt=0.0)] = 1.0
    prior_init_noise: Annotated[float, Field(gt=0.0)] = 1e-2

    name = "fedgmi"

    def check_task(self, task: Task) -> None:
        if self.interpolation == "posterior":
            head_names(task)

    @property
    def bayesian(self) -> bool:
        return self.interpolation == "posterior"

    def server_init(self, params: Tree) -> Tree:
        if not self.bayesian:
            return super().server_init(params)
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
        }

    def client_init(self, down: Tree) -> Tree:
        # Round 0: φ_i^{-1} = φ^0.
        return {"model": down["model"]}

    def start_head(self, down: Tree, state: Tree, data: ClientData) -> tuple[Tree, Tree]:
        """Steps 1–4: the interpolated head φ̂_i and the weights α used."""
        head = self.task.head
        omega, phi_g = self.task.split(down["model"])
        phi_i = self.task.split(state["model"])[1]
        # Steps 2–3 differentiate only the head, always under the body ω^t: when the task
        # can, its features are computed once for the three passes (same numbers).
        features = self.task.head_input(down["model"], data.x)
        if features is not None:
            return self.start_head_from(features, down["model"], phi_i, data)
        # Step 2: fine-tune the hybrid head (ω^t, φ_i^{t-1}).
        if self.finetune_steps:
            hybrid = self.full_batch_steps(
                self.task.join(omega, phi_i), data, self.finetune_steps, self.finetune_lr, head
            )
            phi_i = self.task.split(hybrid)[1]
        if not self.interpolate:
            return phi_i, tree_map(torch.ones_like, phi_i)
        # Step 3: element-wise gradient magnitudes on the whole local set (the task's
        # gradient: a model's hand-written backward pass when it has one).
        x, y, w = data.x, data.y, data.mask
        _, grad_g = self.task.value_and_grad(down["model"], x, y, w, head)
        _, grad_i = self.task.value_and_grad(self.task.join(omega, phi_i), x, y, w, head)
        return self.interpolate_head(phi_i, phi_g, grad_g, grad_i)

    def interpolate_head(
        self, phi_i: Tree, phi_g: Tree, grad_g: Tree, grad_i: Tree
    ) -> tuple[Tree, Tree]:
        """Step 4: per-parameter interpolation by the gradients' magnitudes (alg. 3.3)."""
        alpha = interpolation_weights(
            tree_map(torch.abs, grad_g),
            tree_map(torch.abs, grad_i),
            self.eps,
            per_tensor=self.magnitude == "tensor",
            joint=self.normalize == "joint",
        )
        return interpolate(phi_i, phi_g, alpha), alpha

    def start_head_from(
        self, features: Tensor, model: Tree, phi_i: Tree, data: ClientData
    ) -> tuple[Tree, Tree]:
        """:meth:`start_head` given the body ω^t's features of the local rows."""
        y, w = data.y, data.mask
        phi_g = self.task.split(model)[1]

        def head_grad(params: Tree, _x: Tensor, y: Tensor, w: Tensor, _wrt) -> tuple[Tensor, Tree]:
            return self.task.head_value_and_grad(params, features, y, w)

        # Step 2, as Algorithm.full_batch_steps (the same loop), on the body's features.
        tuned, _ = train(
            head_grad,
            {**model, **phi_i},
            full_batch(data, self.finetune_steps),
            make_optimizer("sgd", self.finetune_lr),
            tuple(phi_i),
        )
        phi_i = {k: tuned[k] for k in phi_i}
        if not self.interpolate:
            return phi_i, tree_map(torch.ones_like, phi_i)
        _, grad_g = self.task.head_value_and_grad(model, features, y, w)
        _, grad_i = self.task.head_value_and_grad({**model, **phi_i}, features, y, w)
        return self.interpolate_head(phi_i, phi_g, grad_g, grad_i)

    def head_posterior(self, down: Tree, data: ClientData) -> tuple[Moments, Posterior]:
        """Steps 1–2 of the posterior rule: the head's moments and posterior under ω of ``down``."""
        design = head_design(self.task, down["model"], data.x)
        stats = moments(design, data.y[..., 0], data.mask)
        return stats, finite_posterior(
            stats, down["head_mu"], down["head_sigma"], down["noise_var"]
        )

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        if self.bayesian:
            return self.posterior_update(down, data)
        phi_hat, alpha = self.start_head(down, state, data)
        # Step 5: train the whole model from (ω^t, φ̂_i).
        trained, loss = self.local_train(self.task.join(down["model"], phi_hat), data)
        reply = trained if self.upload == "full" else self.task.split(trained)[0]
        alpha_mean = torch.stack([a.reshape(a.shape[0], -1).mean(1) for a in alpha.values()]).mean(
            0
        )
        return ClientResult(
            {"model": reply}, {"model": trained}, {"train_loss": loss, "alpha_mean": alpha_mean}
        )

    def posterior_update(self, down: Tree, data: ClientData) -> ClientResult:
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
        }
        return ClientResult(reply, {"model": trained}, {"train_loss": loss, "loglik": post.loglik})

    def posterior_server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
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
        }

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        if self.bayesian:
            return self.posterior_server_update(server, replies, weights)
        # With upload="body" the head is not uploaded: the global head keeps its value.
        return super().server_update(server, replies, weights)

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        if self.evaluate == "local":
            return state["model"]
        if self.bayesian:
            # (ω^{t+1}, m_i) with m_i under ω^{t+1}'s features and the latest prior.
            _, post = self.head_posterior(down, data)
            noise = down["noise_var"].expand(post.mean.shape[0])
            head = head_tree(self.task, post.mean, data.x.dtype)
            return {**down["model"], **head, "head_cov": post.cov, "noise_var": noise}
        return self.task.join(down["model"], state["model"])

    def predictive_std(self, params: Tree, x: Tensor) -> Tensor | None:
        """√(Φ(x) V_i Φ(x)ᵀ + σ²) per row (clients, rows, 1) when the model carries V_i."""
        if "head_cov" not in params:
            return None
        design = head_design(self.task, params, x)
        var = predictive_var(design, params["head_cov"], params["noise_var"])
        return var.sqrt().unsqueeze(-1).to(x.dtype)

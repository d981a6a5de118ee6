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

Variant (ours, issue 10): ``interpolation="posterior"``, the Bayesian head — its own
algorithm, :class:`~fedcal.algorithms.fedgmi_posterior.FedGMIPosterior` (registered as
``fedgmi_bayes``). ``FedGMI(..., interpolation="posterior")`` builds that class
(:meth:`FedGMI.built_class`, which ``FedGMI.__new__`` and the build use), so the shipped
variants ``fedgmi_posterior`` and ``fedgmi_posterior_frozen`` stay tables of ``fedgmi``.
Both read the split model's head as the coefficients of a linear model of the body's
features (:func:`head_design`, :func:`head_vector`, :func:`head_tree`), defined here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData, full_batch
from fedcal.core.local import train
from fedcal.core.optim import make_optimizer
from fedcal.core.task import Task
from fedcal.core.tree import Tree, per_client, sq_norm, tree_map


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


@dataclass(frozen=True)
class FedGMI(Algorithm):
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

    @classmethod
    def built_class(cls, settings: dict[str, Any]) -> type[Algorithm]:
        """``FedGMI(..., interpolation=rule)`` of a rule with its own algorithm builds that one.

        The Bayesian head (``"posterior"``, :mod:`fedcal.algorithms.fedgmi_posterior`) registers
        itself in :data:`HEAD_RULES` when the package loads (it imports every module).
        """
        if cls is not FedGMI:
            return cls
        return HEAD_RULES.get(settings.get("interpolation", "gradient"), cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> FedGMI:
        return super().__new__(cls.built_class(kwargs))

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

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
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

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        if self.evaluate == "local":
            return state["model"]
        return self.task.join(down["model"], state["model"])


# Head rules with an algorithm of their own (rule → class), filled by their modules:
# fedgmi_posterior.py registers "posterior".
HEAD_RULES: dict[str, type[FedGMI]] = {}

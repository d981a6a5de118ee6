"""APFL — adaptive personalized federated learning (Deng, Kamani, Mahdavi, 2020, Algorithm 1).

Client i keeps a personal model v_i and a mixing weight α_i; its personalized
model is the mixture v̄_i = α_i·v_i + (1 − α_i)·w. Per round, starting from
the global model (w_i ← w^t), at every local step on a minibatch ξ (all three
updates use the previous iterates, as in Algorithm 1):

    w_i ← w_i − η·∇f_i(w_i; ξ)                            (the FedAvg update)
    v_i ← v_i − η·∇_v f_i(v̄_i; ξ) = v_i − η·α_i·∇f_i(v̄_i; ξ)
    α_i ← clip_[0,1](α_i − η_α·∇_α f_i(v̄_i; ξ)),
          ∇_α f_i(v̄_i) = ⟨v_i − w_i, ∇f_i(v̄_i)⟩                (eq. 10)

for E local epochs; w_i is uploaded, v_i and α_i stay on the client. Server:
w^{t+1} = mean of the uploads (or sample-weighted). Client i's model is
α_i·v_i + (1 − α_i)·w^{t+1}; v_i starts from w^0.

Defaults: α_i starts at 0.5 and is learned with the model's learning rate —
the authors' code (FedTorch, ``--fed_personal_alpha 0.5``, α stepped with the
local lr); ``alpha_lr=0`` freezes α (the paper's fixed-α variants). The same
optimizer recipe (lr, momentum, weight decay) drives w and v, each with its
own optimizer state. With α fixed at 0 the method is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, minibatches
from fedcal.core.local import run_steps
from fedcal.core.tree import Tree, leaves, per_client, tree_map


def mix(personal: Tree, global_: Tree, alpha: Tensor) -> Tree:
    """α·v + (1 − α)·w, leaf-wise, α (clients,)."""
    return tree_map(
        lambda v, w: per_client(alpha, v) * v + (1 - per_client(alpha, v)) * w, personal, global_
    )


@dataclass(frozen=True)
class APFL(Algorithm):
    alpha_init: Annotated[float, Field(ge=0.0)] = 0.5
    alpha_lr: Annotated[float, Field(ge=0.0)] | None = None  # None: the local learning rate

    name = "apfl"

    def client_init(self, down: Tree) -> Tree:
        n = leaves(down)[0].shape[0]
        dtype = leaves(down)[0].dtype
        return {"personal": down["model"], "alpha": torch.full((n,), self.alpha_init, dtype=dtype)}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        alpha_lr = self.lr if self.alpha_lr is None else self.alpha_lr
        batches = minibatches(data, self.local_epochs, self.batch_size)
        opt = self.make_optimizer()

        def step(carry: Tree, s: int, active: Tensor | None) -> tuple[Tree, dict[str, Tensor]]:
            w, v, alpha = carry["w"], carry["v"], carry["alpha"]
            value_w, grad_w = self.task.value_and_grad(w, *batches.at(s))
            value_mix, grad_mix = self.task.value_and_grad(mix(v, w, alpha), *batches.at(s))
            # Chain rule through v̄ = α·v + (1 − α)·w.
            grad_v = tree_map(lambda g: per_client(alpha, g) * g, grad_mix)
            grad_alpha = sum(
                ((v[k] - w[k]) * g).reshape(g.shape[0], -1).sum(1) for k, g in grad_mix.items()
            )
            new_w, w_opt = opt.update(w, grad_w, carry["w_opt"], active)
            new_v, v_opt = opt.update(v, grad_v, carry["v_opt"], active)
            new_alpha = (alpha - alpha_lr * grad_alpha).clamp(0.0, 1.0)
            new = {"w": new_w, "v": new_v, "alpha": new_alpha, "w_opt": w_opt, "v_opt": v_opt}
            return new, {"train_loss": value_w, "personal_loss": value_mix}

        w, v = down["model"], state["personal"]
        start = {
            "w": w,
            "v": v,
            "alpha": state["alpha"],
            "w_opt": opt.init(w),
            "v_opt": opt.init(v),
        }
        end, losses = run_steps(batches, start, step, ("train_loss", "personal_loss"))
        alpha = end["alpha"]
        return ClientResult(
            {"model": end["w"]}, {"personal": end["v"], "alpha": alpha}, {**losses, "alpha": alpha}
        )

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return mix(state["personal"], down["model"], state["alpha"])

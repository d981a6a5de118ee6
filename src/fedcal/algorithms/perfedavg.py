"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020): federated MAML.

The global model w is trained for the personalized (MAML) objective of §2

    F(w) = (1/n)·Σ_i f_i(w − α·∇f_i(w)),

whose per-client gradient is

    ∇F_i(w) = (I − α·∇²f_i(w))·∇f_i(w − α·∇f_i(w)).

Client i runs τ local steps (Algorithm 1), each with three independent
batches D, D′, D″ of its data (independent minibatch streams 0, 1, 2):

    w̃ = w − α·∇f_i(w; D)                                  (temporary adaptation)
    FO: w ← w − β·∇f_i(w̃; D′)                             (first-order: Hessian term dropped)
    HF: w ← w − β·(I − α·∇²f_i(w; D″))·∇f_i(w̃; D′)         (Hessian-free)

The paper's HF variant estimates the Hessian-vector product by finite
differences of gradients; here it is exact, by double backward through
autograd (``hessian_vector_product``): cheap at this model size and free of
the difference step δ. The server averages the uploads (FedAvg). The
personalized model of a client is ``personal_steps`` gradient steps of size α
on its local data from the global model (the paper evaluates after one step),
full batch so that it is deterministic.

τ = E epochs of minibatches (``local_epochs``, ``batch_size``). Step sizes
are ours: β defaults to the project's local SGD rate ``lr`` (0.05); α = 0.01
(inner step) keeps the one-step adaptation a small correction of the meta
model. The paper's image experiments use step sizes of order 1e-3 over far
more local steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, minibatches
from fedcal.core.local import run_steps, value_and_grad
from fedcal.core.task import Task
from fedcal.core.tree import Tree

Batch = tuple[Tensor, Tensor, Tensor]  # x, y, w of one step


def hessian_vector_product(task: Task, params: Tree, batch: Batch, vector: Tree) -> Tree:
    """∇²f(params; batch)·vector per client, by differentiating ⟨∇f, v⟩ again.

    Client c's gradient depends only on row c, so the gradient of
    Σ_c ⟨∇f_c, v_c⟩ is, row by row, each client's H_c·v_c.
    """
    x, y, w = batch
    with torch.enable_grad():
        live = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        _, grads = value_and_grad(lambda p: task.loss(p, x, y, w), live, create_graph=True)
        inner = sum((grads[k] * vector[k].detach()).sum() for k in live)
        hv = torch.autograd.grad(inner, list(live.values()), allow_unused=True)
    return {
        k: torch.zeros_like(live[k]) if h is None else h.detach()
        for k, h in zip(live, hv, strict=True)
    }


def meta_gradient(
    task: Task,
    params: Tree,
    inner: Batch,
    outer: Batch,
    hessian: Batch,
    alpha: float,
    variant: str,
) -> tuple[Tensor, Tree]:
    """The loss after adaptation f(w̃; D′) (clients,) and the FO or HF meta-gradient."""
    _, grad_inner = task.value_and_grad(params, *inner)
    adapted = {k: params[k] - alpha * grad_inner[k] for k in params}
    value, grad_outer = task.value_and_grad(adapted, *outer)
    if variant == "fo":
        return value, grad_outer
    hv = hessian_vector_product(task, params, hessian, grad_outer)
    return value, {k: grad_outer[k] - alpha * hv[k] for k in params}


@dataclass(frozen=True)
class PerFedAvg(Algorithm):
    variant: Literal["hf", "fo"] = "hf"  # Hessian-free (exact HVP) | first-order
    alpha: Annotated[float, Field(ge=0.0)] = 0.01
    beta: Annotated[float, Field(ge=0.0)] | None = None  # outer step; None: the local SGD ``lr``
    personal_steps: Annotated[int, Field(ge=0)] = 1

    name = "perfedavg"

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        # Three independent plans with the same steps (same counts): D, D′, D″.
        d, d1, d2 = [minibatches(data, self.local_epochs, self.batch_size, s) for s in (0, 1, 2)]
        optimizer = self.make_optimizer(self.lr if self.beta is None else self.beta)

        def step(carry: Tree, s: int, active: Tensor | None) -> tuple[Tree, dict[str, Tensor]]:
            params = carry["params"]
            value, grads = meta_gradient(
                self.task, params, d.at(s), d1.at(s), d2.at(s), self.alpha, self.variant
            )
            params, opt_state = optimizer.update(params, grads, carry["opt"], active)
            return {"params": params, "opt": opt_state}, {"loss": value}

        start = {"params": down["model"], "opt": optimizer.init(down["model"])}
        end, mean = run_steps(d, start, step)
        return ClientResult({"model": end["params"]}, state, {"train_loss": mean["loss"]})

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return self.full_batch_steps(down["model"], data, self.personal_steps, self.alpha)

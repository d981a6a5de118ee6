"""FedMTL — shared body, client-specific heads tied by a task-relationship regularizer.

Survey seed 002 §3.1: client k's model is w_k = g(θ, α_k), a shared part θ
averaged across clients and a client-specific part α_k kept local. MOCHA
(Smith et al., NeurIPS 2017) writes the federated multi-task objective as

    min_{W, Ω}  Σ_k ℓ_k(w_k) + λ · tr(W Ω Wᵀ),

whose best-known instance, mean-regularized MTL (Evgeniou & Pontil, KDD 2004;
Ω = I − 11ᵀ/K), is Σ_k ℓ_k(w_k) + λ Σ_k ‖w_k − w̄‖²: each task near a common
centre w̄. Here the model splits into the body ω (all but the last
``task.head_layers`` layers) and the head; per client:

* θ = (ω, c): the shared body and the head *centre* c. They form an ordinary
  model, trained by FedAvg (E local epochs on ℓ_k, uploaded, averaged).
* α_k = φ_k: the client's personal head, never uploaded, trained each round
  with the received body frozen on

      ℓ_k(ω̄, φ_k) + λ ‖φ_k − c̄‖²                                 (1)

  (gradient of the regularizer: 2λ(φ_k − c̄)), ``head_epochs`` epochs of
  minibatch SGD. The regularizer is applied as its exact proximal step after
  each gradient step, φ ← (u + 2ηλ c̄)/(1 + 2ηλ) with u the SGD iterate: the
  same fixed points as the gradient of (1), but stable for every λ, so the
  two limits are exact: λ = 0 gives independent local heads on the shared
  body; λ = ∞ puts every head on c̄, i.e. the FedAvg model.

The personal model of client k is (ω̄, φ_k) with φ_k fitted by (1) to the
*latest* broadcast (``personalize`` runs the same head epochs, with the
evaluation seeds, without storing them), so that λ = ∞ evaluates exactly the
FedAvg model of that round.

Choices, stated honestly:
* Learned Ω (MOCHA's alternating update Ω = (WᵀW)^{1/2}/tr(·)) needs the
  server to know which head belongs to which client; the contract hides
  client identities from ``server_update`` (order-invariant aggregation), and
  personal heads never leave the client. So Ω is the fixed mean-regularizing
  one.
* The centre c̄ is learned by federated training of the shared model rather
  than taken as the arithmetic mean of uploaded personal heads: with an anchor
  that is itself the mean of heads pinned to it, λ → ∞ would freeze the head
  at its initial value instead of reaching FedAvg. The construction is
  Ditto's (Li et al., ICML 2021) restricted to the head, on a shared body.

Defaults: λ = 0.1 (ours: of the order of the scaled local loss' curvature on
the head); ``head_epochs`` = ``local_epochs`` when 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, minibatches
from fedcal.core.local import train
from fedcal.core.task import Task
from fedcal.core.tree import Tree, per_client, sq_norm, sub, tree_map

HEAD_STREAM = 1  # batches of the personal-head epochs, independent of the FedAvg epochs


def relation_penalty(head: Tree, centre: Tree, lam: float) -> Tensor:
    """λ‖φ_k − c̄‖² per client (clients,); its gradient w.r.t. φ_k is 2λ(φ_k − c̄)."""
    return lam * sq_norm(sub(head, centre))


@dataclass(frozen=True)
class PullToward:
    """An optimizer step followed by the proximal step of λ‖p − anchor‖² (step size lr).

    prox(u) = argmin_p ½‖p − u‖² + lr·λ‖p − a‖² = (u + 2·lr·λ·a)/(1 + 2·lr·λ),
    written as lerp(u, a, 2·lr·λ/(1 + 2·lr·λ)): exactly u at λ = 0, exactly a
    at λ = ∞. Clients without a batch at a step keep their parameters.
    """

    inner: object
    anchor: Tree
    lam: float

    def init(self, params: Tree) -> Tree:
        return self.inner.init(params)

    def update(
        self, params: Tree, grads: Tree, state: Tree, active: Tensor | None = None
    ) -> tuple[Tree, Tree]:
        moved, state = self.inner.update(params, grads, state, active)
        strength = 2.0 * self.inner.lr * self.lam
        weight = 1.0 if strength == float("inf") else strength / (1.0 + strength)
        pulled = tree_map(lambda u, a: torch.lerp(u, a, weight), moved, self.anchor)
        if active is not None:
            pulled = tree_map(
                lambda new, old: torch.where(per_client(active, new) > 0, new, old), pulled, moved
            )
        return pulled, state


@dataclass(frozen=True)
class FedMTL(Algorithm):
    lam: Annotated[float, Field(ge=0.0)] = 0.1
    head_epochs: Annotated[int, Field(ge=0)] = 0  # 0: the same as local_epochs

    name = "fedmtl"

    def check_task(self, task: Task) -> None:
        if not task.head:
            raise ValueError("fedmtl needs a head (task.head_layers >= 1)")

    def client_init(self, down: Tree) -> Tree:
        # Every personal head starts at the initial centre.
        return {"head": self.task.split(down["model"])[1]}

    def fit_head(self, down: Tree, head: Tree, data: ClientData) -> tuple[Tree, Tensor]:
        """Objective (1): head epochs on the received body, pulled toward the centre c̄."""
        centre = self.task.split(down["model"])[1]
        epochs = self.head_epochs or self.local_epochs
        batches = minibatches(data, epochs, self.batch_size, HEAD_STREAM)
        optimizer = PullToward(self.make_optimizer(), centre, self.lam)
        start = self.task.join(down["model"], head)
        fitted, loss = train(self.task.value_and_grad, start, batches, optimizer, self.task.head)
        return self.task.split(fitted)[1], loss

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        head, head_loss = self.fit_head(down, state["head"], data)
        trained, loss = self.local_train(down["model"], data)  # θ = (ω, c): FedAvg
        centre = self.task.split(down["model"])[1]
        metrics = {
            "train_loss": loss,
            "head_loss": head_loss,
            "head_gap": sq_norm(sub(head, centre)),
        }
        return ClientResult({"model": trained}, {"head": head}, metrics)

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        head, _ = self.fit_head(down, state["head"], data)
        return self.task.join(down["model"], head)

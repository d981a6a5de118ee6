"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh, Chung, Yin &
Ramchandran, NeurIPS 2020), model-averaging version (Algorithm 2).

The server holds k cluster models θ_1…θ_k and broadcasts all of them. Client i

1. estimates its cluster: ĵ = argmin_j F_i(θ_j), the loss of each model on
   its training data (ties: the lowest index), as a one-hot s_i ∈ {0, 1}^k;
2. trains θ_ĵ locally (E epochs of minibatch SGD) and uploads the trained
   model with s_i.

The server averages per cluster, θ_j ← Σ_i p_i s_ij θ̃_i / Σ_i p_i s_ij, and a
cluster nobody chose keeps its model. The personalized model of a client is
the cluster model with the least loss on its training data.

Initialization: the k models must differ. We split one model θ (as LBG
k-means does) into θ_j = θ + ``init_spread``·(ε_j − mean_l ε_l), ε_j ~ N(0, I)
from a generator seeded with ``init_seed``. Centred perturbations keep θ the
models' mean and, for k = 2, make the split symmetric (θ ± δ·e): both models
then carry the same second-order loss increase and client i's first choice
is the sign of ⟨∇F_i(θ), e⟩ — decided by its own gradient. Splitting the
untrained initial model (``warmup_rounds=0``) lets a gradient component
common to all clients (the untrained model's overall error) decide, and every
client may pick the same model, after which the others never get members.
So by default the split happens after ``warmup_rounds`` rounds in which all
models are the same model trained as FedAvg (ties go to θ_1): near the FedAvg
solution the clients' gradients average to about zero, and what is left is
the difference between families. The paper initializes at random (with
restarts) and its analysis needs an initialization close enough to the true
cluster centres; the warm-up and split are our deterministic way there.
With k = 1 the split is the identity and IFCA is FedAvg.

Defaults (ours): k = 2 (the smallest number of planted families), spread
0.1 (of the order of the hidden weights' initial scale 1/√64), 5 warm-up
rounds (a tenth of a default 50-round run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree, clone, expand, tree_map, weighted_mean


@dataclass(frozen=True)
class IFCA(Algorithm):
    clusters: Annotated[int, Field(ge=1)] = 2
    init_spread: Annotated[float, Field(ge=0.0)] = 0.1
    init_seed: Annotated[int, Field(ge=0)] = 0
    warmup_rounds: Annotated[int, Field(ge=0)] = 5

    name = "ifca"
    uploads = ("model", "cluster_choice")

    reply_aggregation = "custom"  # per-cluster means by assignment

    def server_init(self, params: Tree) -> Tree:
        start = self.split(params) if self.warmup_rounds == 0 else self.copies(params)
        return {"models": start, "round": torch.zeros((), dtype=_dtype(params))}

    def copies(self, model: Tree) -> Tree:
        """k identical models (leaves (k, ...))."""
        return clone(expand(model, self.clusters))

    def split(self, model: Tree) -> Tree:
        """θ_j = θ + spread·(ε_j − mean ε) (leaves (k, ...)), ε drawn from ``init_seed``."""
        gen = torch.Generator().manual_seed(self.init_seed)

        def spread(t: Tensor) -> Tensor:
            noise = torch.randn((self.clusters, *t.shape), generator=gen, dtype=torch.float64)
            centred = noise - noise.mean(0, keepdim=True)
            return t.unsqueeze(0) + (self.init_spread * centred).to(t.dtype)

        return tree_map(spread, model)

    def broadcast(self, server: Tree) -> Tree:
        return {"models": server["models"]}

    def cluster_losses(self, models: Tree, data: ClientData) -> Tensor:
        """F_i(θ_j) on each client's training rows: (clients, k)."""
        return torch.stack(
            [self.local_loss(_cluster(models, j), data) for j in range(self.clusters)], dim=1
        )

    def choose(self, models: Tree, data: ClientData) -> tuple[Tree, Tensor]:
        """The least-loss cluster model of each client and the one-hot choice (clients, k)."""
        with torch.no_grad():
            best = self.cluster_losses(models, data).argmin(dim=1)
        rows = torch.arange(best.shape[0])
        chosen = {k: t[rows, best] for k, t in models.items()}
        one_hot = torch.nn.functional.one_hot(best, self.clusters).to(data.x.dtype)
        return chosen, one_hot

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        start, assignment = self.choose(down["models"], data)
        trained, loss = self.local_train(start, data)
        cluster = assignment.argmax(dim=1).to(data.x.dtype)
        return ClientResult(
            {"model": trained, "assignment": assignment},
            state,
            {"train_loss": loss, "cluster": cluster},
        )

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        base = self.weights(weights)
        models = []
        for j in range(self.clusters):
            members = base * replies["assignment"][:, j].to(base.dtype)
            average = weighted_mean(replies["model"], members)  # NaN when nobody chose j
            keep = members.sum() > 0
            models.append(
                {k: torch.where(keep, v, server["models"][k][j]) for k, v in average.items()}
            )
        averaged = {k: torch.stack([m[k] for m in models]) for k in models[0]}
        # Warm-up: every model is the shared (first) one; at its end, split it into k.
        now = server["round"] + 1
        first = {k: v[0] for k, v in averaged.items()}
        shared, split = self.copies(first), self.split(first)
        warming, at_split = now < self.warmup_rounds, now == self.warmup_rounds
        models = {
            k: torch.where(warming, shared[k], torch.where(at_split, split[k], v))
            for k, v in averaged.items()
        }
        return {"models": models, "round": now}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return self.choose(down["models"], data)[0]


def _dtype(tree: Tree) -> torch.dtype:
    return next(iter(tree.values())).dtype


def _cluster(models: Tree, j: int) -> Tree:
    """Cluster j's model from client trees of leaves (clients, k, ...)."""
    return {k: t[:, j] for k, t in models.items()}

"""FedProto — federated prototype learning (Tan et al., AAAI 2022, Algorithm 1).

Clients keep their own models; only class prototypes travel. With f_i the
representation (here the normalized embedding h of
:class:`~fedcal.models.classifier.HypersphereClassifier`, the input of the
classifier, as in the authors' code) and C classes:

* local prototype (eq. 5): C_i^(j) = mean of f_i(x) over client i's rows of
  class j, uploaded with the count |D_{i,j}|;
* global prototype (eq. 6): C̄^(j) = Σ_i |D_{i,j}|·C_i^(j) / Σ_i |D_{i,j}|, i.e.
  the mean embedding of class j over every participating client's rows. A
  class no participating client holds keeps its previous global prototype;
  one never seen has none yet;
* local objective (eq. 7): L_CE(F_i(x), y) + λ·‖f_i(x) − C̄^(y)‖²/L, the
  squared distance averaged over the L embedding dimensions as the authors'
  ``nn.MSELoss`` does; rows whose class has no global prototype yet (all rows
  in round 0) get no regularizer.

Prototypes are computed after local training by one pass of the trained
model over all local rows (eq. 5; the authors' code averages the embeddings
seen during the training epochs instead). Each client's model is its local
model (inference by the classifier head, the paper's first protocol).

``share_model=True`` is the variant the FedLSA paper benchmarks under the
name FedProto (the FPL code base): models are also averaged as in FedAvg and
every client uses the global model.

Defaults: λ = 1 (authors' ``ld``); the optimizer recipe is FedLSA's (SGD lr
0.01, momentum 0.9, batch 64, 5 epochs;
:class:`~fedcal.core.classification.FedLSARecipe`) so the two are compared on equal
terms — the FedProto paper uses lr 0.01, momentum 0.5, 1 local epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import ClientResult
from fedcal.core.classification import (
    FedLSARecipe,
    class_index,
    local_prototypes,
    masked_cross_entropy,
    prototype_consensus,
    prototype_distance,
)
from fedcal.core.data import ClientData
from fedcal.core.local import LossFn
from fedcal.core.task import Task
from fedcal.core.tree import Tree
from fedcal.models.classifier import require_embedding


def aggregate_prototypes(
    protos: Tensor, counts: Tensor, previous: Tensor, known: Tensor
) -> tuple[Tensor, Tensor]:
    """Global prototypes (eq. 6) from stacked uploads; classes nobody holds keep ``previous``.

    protos: (clients, C, L); counts: (clients, C); previous: (C, L); known: (C,)
    1 where a global prototype exists → new (C, L) and known (C,).
    """
    mean, held, known = prototype_consensus(protos, counts, known)
    return torch.where(held, mean, previous), known


@dataclass(frozen=True)
class FedProto(FedLSARecipe):  # sample-weighted: FedAvg's n_m/n (used with share_model)
    lam: Annotated[float, Field(ge=0.0)] = 1.0  # λ, weight of the prototype regularizer (eq. 7)
    share_model: bool = False  # True: FedAvg + prototypes, as FedLSA's benchmark runs it

    name = "fedproto"
    uploads = ("prototypes", "label_counts", "model")  # model: with share_model

    reply_aggregation = "custom"  # count-weighted prototypes
    task_kind = "classification"

    def check_task(self, task: Task) -> None:
        require_embedding(task.model, self.name)

    def server_init(self, params: Tree) -> Tree:
        c, dim = self.task.model.num_classes, self.task.model.embed_dim
        dtype = next(iter(params.values())).dtype
        # "model" is the common initialisation clients start from (and, with
        # share_model, the global model).
        return {
            "model": params,
            "protos": torch.zeros(c, dim, dtype=dtype),
            "known": torch.zeros(c, dtype=dtype),
        }

    def client_init(self, down: Tree) -> Tree:
        return {} if self.share_model else {"model": down["model"]}

    def client_loss(self, protos: Tensor, known: Tensor) -> LossFn:
        """L_CE + λ·known_y·‖h − C̄^(y)‖²/L per client (eq. 7).

        protos: (clients, C, L) global prototypes; known: (clients, C) 1 where one exists.
        """
        model = self.task.model

        def loss(params: Tree, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            h = model.embed(params, x)
            labels = class_index(y)
            ce = masked_cross_entropy(model.classify(params, h), labels, w)
            dist = prototype_distance(h, labels, protos, known)
            return ce + self.lam * (dist * w).sum(1) / w.sum(1).clamp_min(1.0)

        return loss

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        start = down["model"] if self.share_model else state["model"]
        objective = self.client_loss(down["protos"], down["known"])
        trained, loss = self.local_train(start, data, loss=objective)
        with torch.no_grad():
            h = self.task.model.embed(trained, data.x)
        protos, counts = local_prototypes(
            h, class_index(data.y), data.mask, self.task.model.num_classes
        )
        reply = {"protos": protos, "counts": counts}
        if self.share_model:
            return ClientResult({**reply, "model": trained}, state, {"train_loss": loss})
        return ClientResult(reply, {"model": trained}, {"train_loss": loss})

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        protos, known = aggregate_prototypes(
            replies["protos"], replies["counts"], server["protos"], server["known"]
        )
        if self.share_model:
            server = super().server_update(server, replies, weights)
        return {**server, "protos": protos, "known": known}

    def broadcast(self, server: Tree) -> Tree:
        return server

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return down["model"] if self.share_model else state["model"]

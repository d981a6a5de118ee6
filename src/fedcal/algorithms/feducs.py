"""FedUCS — federated learning with a unified coding space (seed 004's fourth baseline).

Huang, Fu, Li, Chen, Zheng & Dai, "A Cross-Client Coordinator in Federated
Learning Framework for Conquering Heterogeneity", IEEE TNNLS 2024,
doi:10.1109/TNNLS.2024.3439878. **The paper's text was not available here**
(searched: the stored web pages, code, issues and docs; only citations of it
were found). What we have, and build on:

* seed 004 (ref. [36]): FedUCS "introduces a cross-client coordinator that
  learns unified coding rules across clients, reducing the divergence of the
  clients' learning targets caused by differing data distributions";
* the FedLSA paper (AAAI 2025, same group) files Huang et al. 2024 with FedProx
  and MOON among methods that "introduce a local regularity term to force the
  optimization directions of local models closer to the global direction"
  under label skew.

Our reading (every step below is ours, built to have exactly those properties):
a client's *code* of an input is the representation its model assigns it —
the embedding h = f(x) of a model with an encoder (``embed``), or for the
seed's linear one-vs-rest SVM the vector of its C machines' scores (the
output code of the multiclass problem). Under label skew each client drifts
to its own coding rule (class → region of code space); the coordinator is a
server-held codebook K ∈ R^{C×D}, one codeword per class, learned across
clients, and each client is regularized into that one space.

1. Client i receives the global model w and the codebook K (with ``known``,
   1 for classes that have a codeword) and runs τ local steps (5) on
       F_i(w) + λ · mean over rows of known_y · ‖z(x) − K_y‖² / D      (UCS-1)
   (z the code, D its dimension) — the local regularity term.
2. After training it uploads w_i, and per class c its mean code z̄_ic over its
   rows of class c with the count n_ic (FedProto's eq. 5, one pass of w_i).
3. The coordinator forms the cross-client consensus
       m_c = Σ_i n_ic z̄_ic / Σ_i n_ic                                   (UCS-2)
   and takes one normalized gradient step of rate κ on ½ Σ_c ‖K_c − m_c‖²:
       K_c ← (1 − κ)·K_c + κ·m_c   (a class seen for the first time: K_c = m_c);
   a class no participant holds keeps its codeword                     (UCS-3)
   κ = 1 makes K the last round's consensus (FedProto with a shared model).
4. The model is aggregated as every baseline of seed 004's comparison is.

Everything else is AFL-CSEM's FedAvg baseline (:mod:`fedcal.algorithms.fixedtau`):
fixed τ = 10 local minibatch steps, Q-weighted aggregation (7), the cost
accounting (9)–(11), budget stop and best-model rule (8), so that the seed's
comparison at equal budget isolates the coordinator. F(w^f) is the task's
loss, without the regularizer. λ = 0 is exactly ``fixedtau`` (tested).

Defaults (ours; none is known from the paper): λ = 1 (FedProto's), κ = 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.algorithms.aflcsem import LAST_INTERVAL, RUNNING
from fedcal.algorithms.fixedtau import FixedTau
from fedcal.core.algorithm import ClientResult
from fedcal.core.classification import (
    class_index,
    local_prototypes,
    prototype_consensus,
    prototype_distance,
)
from fedcal.core.data import ClientData
from fedcal.core.local import GradFn, autograd_of
from fedcal.core.tree import Tree


def code_shape(model) -> tuple[int, int]:
    """(classes C, code dimension D): the embedding of an encoder model, else the scores."""
    if hasattr(model, "embed"):
        return model.num_classes, model.embed_dim
    classes = getattr(model, "out_features", None) or getattr(model, "num_classes", None)
    if classes is None:
        raise ValueError(f"feducs: cannot tell the classes of model {type(model).__name__}")
    return classes, classes


def coordinate(
    codebook: Tensor, known: Tensor, codes: Tensor, counts: Tensor, rate: float
) -> tuple[Tensor, Tensor]:
    """The coordinator's step (UCS-2, UCS-3) from stacked uploads.

    codebook: (C, D); known: (C,); codes: (clients, C, D) per-class mean codes;
    counts: (clients, C) → new codebook (C, D) and known (C,).
    """
    consensus, held, now_known = prototype_consensus(codes, counts, known)
    seen = (known > 0).unsqueeze(-1)
    stepped = torch.where(seen, (1.0 - rate) * codebook + rate * consensus, consensus)
    return torch.where(held, stepped, codebook), now_known


@dataclass(frozen=True)
class FedUCS(FixedTau):
    """See the module docstring: which parts are the paper's and which are our reading."""

    lam: Annotated[float, Field(ge=0.0)] = 1.0  # λ, weight of the coding-space term (UCS-1)
    coordinator_rate: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5  # κ, coordinator step (UCS-3)

    name = "feducs"
    task_kind = "classification"
    uploads = ("model", "gradients", "costs", "prototypes", "label_counts")

    def codes(self, params: Tree, x: Tensor) -> Tensor:
        """z(x): (clients, rows, D) — the embedding, or the scores of a model without one."""
        model = self.task.model
        return model.embed(params, x) if hasattr(model, "embed") else self.task.predict(params, x)

    def server_init(self, params: Tree) -> Tree:
        classes, dim = code_shape(self.task.model)
        dtype = next(iter(params.values())).dtype
        return {
            **super().server_init(params),
            "codebook": torch.zeros(classes, dim, dtype=dtype),
            "known": torch.zeros(classes, dtype=dtype),
        }

    def broadcast(self, server: Tree) -> Tree:
        return {
            **super().broadcast(server),
            "codebook": server["codebook"],
            "known": server["known"],
        }

    def local_objective(self, down: Tree) -> GradFn:
        """∇ of (UCS-1): F_i + λ·known_y·‖z − K_y‖²/D, per client."""
        codebook, known = down["codebook"], down["known"]  # (clients, C, D), (clients, C)

        def loss(params: Tree, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            z = self.codes(params, x)
            dist = prototype_distance(z, class_index(y), codebook, known)  # codebook K_y per row
            reg = (dist * w).sum(1) / w.sum(1).clamp_min(1.0)
            return self.task.loss(params, x, y, w) + self.lam * reg

        return autograd_of(loss)

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        result = super().client_update(down, state, data)
        with torch.no_grad():
            z = self.codes(result.reply["model"], data.x)
        codes, counts = local_prototypes(
            z, class_index(data.y), data.mask, down["codebook"].shape[1]
        )
        reply = {**result.reply, "codes": codes, "code_counts": counts}
        return ClientResult(reply, result.state, result.metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        trained = int(server["stage"]) in (RUNNING, LAST_INTERVAL) and int(server["tau"]) > 0
        new = super().server_update(server, replies, weights)
        if not trained:  # the evaluation-only round, or stopped: nothing was coded anew
            return new
        codebook, known = coordinate(
            server["codebook"],
            server["known"],
            replies["codes"],
            replies["code_counts"],
            self.coordinator_rate,
        )
        return {**new, "codebook": codebook, "known": known}

"""Classification as a :class:`~fedcal.core.task.Task`: logits, cross-entropy, error rate.

The engine stores every target as a float column, so a class label lives in
``y`` as its index ``0.0 … C−1`` with shape (clients, rows, 1); it is turned
into an integer index here, never scaled (see ``scale_target`` in
:func:`fedcal.data.scaling.fit_scaler`). The model's ``apply`` returns logits
(clients, rows, C). Gradients come from autograd: the task's criterion is not
the MSE a model's hand-written gradient is for, so :meth:`Task.value_and_grad`
never uses one here (see :attr:`Task.hand_gradient`), whatever the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.core.algorithm import Algorithm
from fedcal.core.task import Task


def class_index(y: Tensor) -> Tensor:
    """(clients, rows, 1) float labels → (clients, rows) int64 class indices."""
    return y.squeeze(-1).round().long()


def masked_cross_entropy(logits: Tensor, labels: Tensor, w: Tensor) -> Tensor:
    """Per-client mean cross-entropy over the real rows: (clients,).

    logits: (clients, batch, C); labels: (clients, batch) int64; w: (clients,
    batch), 0 on padding. Clients without rows get 0.
    """
    nll = -torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (nll * w).sum(1) / w.sum(1).clamp_min(1.0)


def local_prototypes(
    h: Tensor, labels: Tensor, w: Tensor, num_classes: int
) -> tuple[Tensor, Tensor]:
    """Per-class mean representations and counts of a cohort (FedProto eq. 5).

    h: (clients, rows, L); labels: (clients, rows) int64; w: (clients, rows)
    0 on padding → prototypes (clients, C, L) (0 for absent classes) and
    counts (clients, C).
    """
    onehot = torch.nn.functional.one_hot(labels, num_classes).to(h.dtype) * w.unsqueeze(-1)
    counts = onehot.sum(1)
    sums = onehot.transpose(1, 2) @ h
    return sums / counts.clamp_min(1.0).unsqueeze(-1), counts


def prototype_consensus(
    protos: Tensor, counts: Tensor, known: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The count-weighted mean over clients of each class's prototype (FedProto eq. 6).

    protos: (clients, C, L); counts: (clients, C); known: (C,) 1 where a class
    already has a global prototype → mean (C, L), 0 for a class no client holds;
    held (C, 1) bool, whether any client holds it; known (C,) updated with held.
    """
    total = counts.sum(0)
    mean = (counts.unsqueeze(-1) * protos).sum(0) / total.clamp_min(1.0).unsqueeze(-1)
    held = total > 0
    return mean, held.unsqueeze(-1), torch.maximum(known, held.to(known.dtype))


def prototype_distance(h: Tensor, labels: Tensor, protos: Tensor, known: Tensor) -> Tensor:
    """known_y·‖h − protos_y‖²/L per row (FedProto eq. 7's regularizer): (clients, rows).

    h: (clients, rows, L); labels: (clients, rows) int64; protos: (clients, C, L);
    known: (clients, C), 1 where class c has a prototype (rows of other classes get 0).
    """
    onehot = torch.nn.functional.one_hot(labels, protos.shape[1]).to(h.dtype)
    target = onehot @ protos  # protos_y per row
    has = (onehot @ known.unsqueeze(-1)).squeeze(-1)
    return (h - target).pow(2).mean(-1) * has


@dataclass(frozen=True)
class ClassificationTask(Task):
    """A model returning logits, trained on cross-entropy and ranked by error rate."""

    kind = "classification"
    primary_metric = "error_rate"  # lower is better, as the engine's summaries assume

    def criterion(self, pred: Tensor, y: Tensor, w: Tensor) -> Tensor:
        """Per-client cross-entropy of logits ``pred`` against the class labels ``y``."""
        return masked_cross_entropy(pred, class_index(y), w)

    def metrics(self, pred: Tensor, y: Tensor, mask: Tensor, y_scale: Tensor) -> dict[str, Tensor]:
        """Per-client ``error_rate`` = 1 − ``accuracy`` over the real rows (clients,).

        ``pred`` are logits; ``y_scale`` is ignored (labels are never scaled).
        A client without rows gets accuracy 0.
        """
        hit = (pred.argmax(-1) == class_index(y)).to(mask.dtype) * mask
        accuracy = hit.sum(1) / mask.sum(1).clamp_min(1.0)
        return {"error_rate": 1.0 - accuracy, "accuracy": accuracy}


@dataclass(frozen=True)
class FedLSARecipe(Algorithm):
    """The local optimizer recipe of FedLSA's benchmark (seed 001, §5.1) as a method's defaults:
    SGD lr 0.01, momentum 0.9, batch 64, E_c = 5 local epochs, aggregation weighted by train
    rows (n_m/n).

    FedLSA's own, and FedProto's, so that the two are compared on equal terms (the FedProto
    paper's lr 0.01, momentum 0.5, 1 epoch is not used). The fields are
    :class:`~fedcal.core.algorithm.Recipe`'s
    (their ranges, their place in the repr); only the defaults change.
    """

    lr: float = 0.01
    momentum: float = 0.9
    batch_size: int = 64
    local_epochs: int = 5
    sample_weighted: bool = True

"""FedAvg + local fine-tuning ("FedAvg-FT"), the simplest personalization.

Training is FedAvg (McMahan et al., AISTATS 2017, Algorithm 1: E local epochs
from the global model, server mean of the uploads). Personalization is the
classical baseline of the personalization literature (e.g. Wang et al. 2019,
"Federated evaluation of on-device personalization"; listed first by the
seed-002 survey): client i's model is the global model after
``finetune_epochs`` epochs of local minibatch SGD on its own rows —
``finetune="all"`` trains the whole model, ``finetune="head"`` only the head φ
(the last ``task.head_layers`` layers) with the body frozen.

Defaults (ours): 5 fine-tuning epochs, one round's worth of local training
(the same budget ``centralized_ft`` gets); the local learning rate unless
``finetune_lr`` is given. With ``finetune_epochs=0`` this is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from fedcal.algorithms.fedavg import FedAvg
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree


@dataclass(frozen=True)
class FedAvgFinetune(FedAvg):
    finetune_epochs: Annotated[int, Field(ge=0)] = 5
    finetune: Literal["all", "head"] = "all"
    finetune_lr: Annotated[float, Field(ge=0.0)] | None = None

    name = "fedavg_ft"

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        wrt = None if self.finetune == "all" else self.task.head
        tuned, _ = self.local_train(
            down["model"], data, wrt=wrt, epochs=self.finetune_epochs, lr=self.finetune_lr
        )
        return tuned

"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, Algorithm 1).

Shared representation ω (the body), personal head φ_i (the last
``task.head_layers`` layers). Per round, client i:

1. takes the global representation ω^t and its own head φ_i^{t-1}
   (round 0: the common initial head);
2. **head update** — ``head_epochs`` epochs of minibatch SGD on φ_i with ω^t
   frozen: φ_i^t ← GRD(f_i(φ, ω^t), φ_i^{t-1}, η);
3. **representation update** — ``body_epochs`` epochs of minibatch SGD on ω
   with the new head φ_i^t frozen: ω_i^{t+1} ← GRD(f_i(φ_i^t, ω), ω^t, η);
4. uploads ω_i^{t+1} only; keeps φ_i^t.

Server: ω^{t+1} = mean of the uploaded representations (or sample-weighted).
Client i's model is (ω^{t+1}, φ_i^t).

Defaults from the paper (§5: "10 local epochs for the head, 1 for the
representation"; the authors' code runs 10 local epochs of which the last one
trains the representation): ``head_epochs=10``, ``body_epochs=1``. The two
phases draw independent minibatch orders (streams 0 and 1).

Evaluation (``evaluate``): "stored", the paper's (ω^{t+1}, φ_i^t); or
"refit", the head first re-trained for ``head_epochs`` on the new ω^{t+1}
(the head step the client would take next round) — the stored head was fitted
to ω^t and, with a large learning rate, ω moves enough in one round to
mismatch it (default fleet, seed 2, 50 rounds: 131 hPa stored, 33 hPa refit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import Tree

HEAD_STREAM, BODY_STREAM = 0, 1


@dataclass(frozen=True)
class FedRep(Algorithm):
    head_epochs: Annotated[int, Field(ge=0)] = 10
    body_epochs: Annotated[int, Field(ge=0)] = 1
    evaluate: Literal["stored", "refit"] = "stored"  # "stored": the paper's

    name = "fedrep"

    def check_task(self, task: Task) -> None:
        if not task.body:
            raise ValueError(
                "fedrep needs shared base layers, but every layer of this model is head"
            )

    def client_init(self, down: Tree) -> Tree:
        return {"head": self.task.split(down["model"])[1]}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        model = self.task.join(down["model"], state["head"])
        # Step 2: the head, with the representation frozen.
        model, head_loss = self.local_train(
            model, data, wrt=self.task.head, epochs=self.head_epochs, stream=HEAD_STREAM
        )
        # Step 3: the representation, with the new head frozen.
        model, body_loss = self.local_train(
            model, data, wrt=self.task.body, epochs=self.body_epochs, stream=BODY_STREAM
        )
        body, head = self.task.split(model)
        return ClientResult(
            {"model": body},
            {"head": head},
            {"train_loss": body_loss if self.body_epochs else head_loss, "head_loss": head_loss},
        )

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        model = self.task.join(down["model"], state["head"])
        if self.evaluate == "stored":
            return model
        return self.local_train(
            model, data, wrt=self.task.head, epochs=self.head_epochs, stream=HEAD_STREAM
        )[0]

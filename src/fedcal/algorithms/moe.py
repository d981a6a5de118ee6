"""Mixture of experts: global experts, a private gate per client (survey seed 002, §4.1).

The survey's federated MoE: a pool of E experts trained by federated
learning, and on each client a small gating network, trained locally and
never uploaded, that mixes the experts' outputs:

    y_k(x) = Σ_e softmax(gate_k(x))_e · expert_e(x).

Each expert is a full copy of the task's model (an MLP); the gate is an MLP
(in → ``gate_hidden`` → E, or linear in → E when ``gate_hidden`` = 0) on the
same scaled (f, T) inputs, so a sensor can weight experts differently across
its operating range. One round, client k:

1. model (experts^t, gate_k); E local epochs of minibatch SGD on ℓ_k over all
   of it (experts and gate together, as the survey's steps 1–2 in one pass);
2. upload the experts only; keep the gate;
3. server: experts^{t+1} = mean of the uploads (FedAvg, expert by expert).

The personal model is (experts^{t+1}, gate_k).

Initialisation: expert 0 is the task's model as initialised by the engine;
expert e ≥ 1 is drawn with seed ``expert_seed + e`` (the same for every run of
the same hyperparameters); the gate's last layer starts at zero (a uniform
mixture) and its hidden layer from ``gate_seed``. With E = 1 the gate's
softmax is identically 1 and the method is FedAvg.

Defaults (ours): E = 4 experts, linear gate (``gate_hidden`` = 0): the
sensors of a fleet differ smoothly, a gate linear in (f, T) can already route
frequency bands to experts; a deeper gate is one switch away.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import Tree, clone, expand, stack, weighted_mean
from fedcal.models.mlp import MLP
from fedcal.models.moe import EXPERTS, GATE, MixtureOfExperts, prefixed, unprefixed


@dataclass(frozen=True)
class MoE(Algorithm):
    num_experts: Annotated[int, Field(ge=1)] = 4
    gate_hidden: Annotated[int, Field(ge=0)] = 0
    expert_seed: Annotated[int, Field(ge=0)] = 1
    gate_seed: Annotated[int, Field(ge=0)] = 0

    name = "moe"

    @property
    def mixture(self) -> MixtureOfExperts:
        inputs = self.task.model.in_features
        hidden = (self.gate_hidden,) if self.gate_hidden else ()
        gate = MLP(inputs, hidden, self.num_experts, getattr(self.task.model, "activation", "tanh"))
        return MixtureOfExperts(self.task.model, self.num_experts, gate)

    @property
    def mixture_task(self) -> Task:
        """The task, with the mixture as its model (same loss)."""
        return replace(self.task, model=self.mixture)

    def server_init(self, params: Tree) -> Tree:
        dtype = next(iter(params.values())).dtype
        others = [
            self.task.model.init(torch.Generator().manual_seed(self.expert_seed + e), dtype)
            for e in range(1, self.num_experts)
        ]
        return {"experts": stack([params, *others])}  # leaves (experts, …)

    def client_init(self, down: Tree) -> Tree:
        n = next(iter(down["experts"].values())).shape[0]
        dtype = next(iter(down["experts"].values())).dtype
        gate = self.mixture.init_gate(torch.Generator().manual_seed(self.gate_seed), dtype)
        return {"gate": clone(expand(gate, n))}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        params = {**prefixed(EXPERTS, down["experts"]), **prefixed(GATE, state["gate"])}
        trained, loss = self.local_train(params, data, loss=self.mixture_task.loss)
        with torch.no_grad():
            usage = self.mixture.gate_weights(trained, data.x)  # (clients, rows, experts)
            share = (usage * data.mask.unsqueeze(-1)).sum(1) / data.count.clamp_min(1).unsqueeze(1)
        return ClientResult(
            {"experts": unprefixed(EXPERTS, trained)},
            {"gate": unprefixed(GATE, trained)},
            {"train_loss": loss, "top_expert_share": share.amax(-1)},
        )

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        return {**server, "experts": weighted_mean(replies["experts"], self.weights(weights))}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return {**prefixed(EXPERTS, down["experts"]), **prefixed(GATE, state["gate"])}

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        return self.mixture_task.predict(params, x)

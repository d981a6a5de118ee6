"""FedBN (Li, Jiang, Zhang, Kamp & Dou, ICLR 2021): batch norm stays local.

The model has a batch-norm layer after each hidden linear layer
(:class:`fedcal.models.mlp_bn.MLPBN`; given a plain MLP task, FedBN uses its
BN variant with the same sizes). Per round (the paper's Algorithm 1):

1. client i builds its model from the global non-BN parameters w^t and its own
   BN parameters (γ_i, β_i) and running statistics (μ_i, σ²_i);
2. E epochs of minibatch SGD on the local objective, BN in training mode:
   each batch is normalized with the client's own batch statistics, and the
   running statistics follow the batches (BatchNorm1d's update, momentum 0.1);
3. the client uploads only the non-BN parameters;
4. the server averages every non-BN layer over the clients,
   w^{t+1} = (1/K)·Σ_i w_i (or sample-weighted).

BN affine parameters and running statistics are never averaged: the server
holds none of them; each client's start at BatchNorm's fixed initial values
(γ=1, β=0, μ=0, σ²=1), so no randomness is involved. The personalized model of
client i is (w^t, γ_i, β_i, μ_i, σ²_i), evaluated with the running statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, minibatches
from fedcal.core.local import run_steps, value_and_grad
from fedcal.core.task import Task
from fedcal.core.tree import Tree, drop, expand, select
from fedcal.models.mlp import MLP
from fedcal.models.mlp_bn import MLPBN


@dataclass(frozen=True)
class FedBN(Algorithm):
    name = "fedbn"

    def __post_init__(self) -> None:
        model = self.task.model
        if isinstance(model, MLP):
            # FedBN needs BN layers: the BN variant of the given architecture, same task.
            object.__setattr__(self, "task", replace(self.task, model=MLPBN.from_mlp(model)))

    def check_task(self, task: Task) -> None:
        if not isinstance(task.model, MLPBN):
            raise ValueError(f"FedBN needs an MLP or MLPBN model, got {type(task.model).__name__}")

    @property
    def bn_model(self) -> MLPBN:
        return self.task.model  # an MLPBN after __post_init__

    def server_init(self, params: Tree) -> Tree:
        # The server keeps only what is averaged.
        return {"model": drop(params, self.bn_model.norm_names)}

    def client_init(self, down: Tree) -> Tree:
        first = next(iter(down["model"].values()))
        return {"bn": expand(self.bn_model.norm_init(first.dtype), first.shape[0])}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        trained, loss = self.train_with_batch_norm({**down["model"], **state["bn"]}, data)
        norm = self.bn_model.norm_names
        return ClientResult(
            {"model": drop(trained, norm)}, {"bn": select(trained, norm)}, {"train_loss": loss}
        )

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return {**down["model"], **state["bn"]}

    def train_with_batch_norm(self, params: Tree, data: ClientData) -> tuple[Tree, Tensor]:
        """E epochs of minibatch SGD, BN in training mode; returns params and mean batch loss.

        ``core.local.train`` with the model's training-mode forward: the
        gradient is taken through the batch statistics, and after each step the
        running statistics of active clients are replaced by the updated ones.
        """
        trainable = [k for k in params if k not in set(self.bn_model.stat_names)]
        batches = minibatches(data, self.local_epochs, self.batch_size, stream=0)
        optimizer = self.make_optimizer()

        def step(carry: Tree, s: int, active: Tensor | None) -> tuple[Tree, dict[str, Tensor]]:
            params = carry["params"]
            value, grads, stats = self._value_grad_and_stats(params, *batches.at(s), trainable)
            new, opt_state = optimizer.update(
                select(params, trainable), grads, carry["opt"], active
            )
            return {"params": {**params, **new, **stats}, "opt": opt_state}, {"loss": value}

        start = {"params": params, "opt": optimizer.init(select(params, trainable))}
        end, mean = run_steps(batches, start, step)
        return end["params"], mean["loss"]

    def _value_grad_and_stats(
        self, params: Tree, x: Tensor, y: Tensor, w: Tensor, trainable: list[str]
    ) -> tuple[Tensor, Tree, Tree]:
        """Training-mode loss (clients,), its gradient, and the updated running statistics."""
        stats: Tree = {}

        def loss(p: Tree) -> Tensor:
            out, new_stats = self.bn_model.apply_train(p, x, w)
            stats.update(new_stats)  # the forward pass's by-product, kept for the step
            return self.task.criterion(out, y, w)

        value, grads = value_and_grad(loss, params, trainable)
        return value, grads, {k: v.detach() for k, v in stats.items()}

"""Layer-sharing choice: which layers to share, decided from held-out data (survey seed 002, §4.2).

The survey's "dynamic layer selection": instead of fixing the split of
FedPer (shared lower layers, private top layers), let the data say how many
top layers to keep private. With L layers the candidates are k = 0 … L
private top layers (k = 0 is FedAvg, k = L is local training, k = 1 is
FedPer's usual head).

Rule (ours, one split for the whole fleet):

1. Probing, rounds 0 … ``probe_rounds`` − 1: every candidate k runs as its
   own FedPer — its own server model, its own private layers on every
   client — all K = L + 1 of them side by side (folded into the clients axis:
   one batched training for all candidates). Each client holds out the rows
   whose index is ≡ −1 mod ``holdout_every`` (a fixed interleave, so the same
   rows stay unseen during the whole probe; a fresh random subset per round
   would soon have been trained on) and trains on the rest. At the start of
   each probe round it reports the held-out MSE of every candidate's personal
   model (ω̄_k, φ_{i,k}) — the model it would use now.
2. After the last probe round the server picks
   k* = argmin_k Σ_i w_i · val_i(k) / Σ_i w_i over that round's reports
   (ties → the smaller k, i.e. more sharing).
3. Then FedPer with k* on all rows; the other candidates are frozen.

``force_k`` ≥ 0 skips the probe and runs FedPer with that split (k = 0:
FedAvg; k = L: local training; personal model (ω̄, φ_i) throughout).

The phase (probing or not) and k* are fleet-wide scalars of the broadcast,
read once per round as Python integers: control flow of the protocol, the
same for every client, not per-client arithmetic.

A per-client choice (each client keeping its own best k, with per-layer
masked aggregation) was considered; with 20 sensors of one physics one split
for all is the simpler, less noisy reading, and it is what is implemented.

Defaults (ours): 10 probe rounds of 50 (a fifth of the budget), one row in 5
held out during the probe; before the choice the personal model uses the
task's ``head_layers`` split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult, SettingError
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import Tree, weighted_mean


@dataclass(frozen=True)
class LayerChoice(Algorithm):
    probe_rounds: Annotated[int, Field(ge=0)] = 10
    holdout_every: Annotated[int, Field(ge=2)] = 5
    force_k: Annotated[int, Field(ge=-1)] = -1  # ≥ 0: no probe, FedPer with this many top layers

    name = "layerchoice"
    uploads = ("model", "validation_losses")

    def check_task(self, task: Task) -> None:
        layers = len(task.model.layers())
        if self.force_k > layers:
            raise SettingError(
                "force_k", f"must be <= the model's {layers} layers, got {self.force_k}"
            )

    # ---- candidates ---------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.task.model.layers())

    @property
    def candidates(self) -> list[int]:
        return list(range(self.num_layers + 1))

    def shared_names(self, k: int) -> tuple[str, ...]:
        """Parameters of the L − k lower layers, averaged by the server under split k."""
        layers = self.task.model.layers()[: self.num_layers - k]
        return tuple(n for layer in layers for n in layer)

    def hybrid(self, k: int, global_model: Tree, own: Tree) -> Tree:
        """(ω̄_k, φ_{i,k}): the shared layers from the server, the private ones own."""
        shared = set(self.shared_names(k))
        return {n: (global_model[n] if n in shared else own[n]) for n in own}

    def split_rows(self, data: ClientData) -> tuple[ClientData, ClientData]:
        """(training rows, held-out rows): row r is held out when r % holdout_every == m − 1."""
        m = self.holdout_every
        keep, held = [], []
        for n in data.count.tolist():
            rows = list(range(n))
            keep.append([r for r in rows if r % m != m - 1])
            held.append([r for r in rows if r % m == m - 1])
        return self._rows(data, keep), self._rows(data, held)

    @staticmethod
    def _rows(data: ClientData, rows: list[list[int]]) -> ClientData:
        width = max(max((len(r) for r in rows), default=0), 1)
        index = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
        ar = torch.arange(data.num_clients).unsqueeze(1)
        count = torch.tensor([len(r) for r in rows], dtype=torch.int64)
        return ClientData(data.x[ar, index], data.y[ar, index], count, data.seeds)

    def _phase(self, down: Tree) -> tuple[bool, int]:
        # Fleet-wide scalars of the broadcast (identical on every client).
        probing = self.force_k < 0 and int(down["round"].reshape(-1)[0]) < self.probe_rounds
        return probing, int(down["choice"].reshape(-1)[0])

    # ---- the contract -------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        dtype = next(iter(params.values())).dtype
        first = self.force_k if self.force_k >= 0 else self.task.head_layers
        return {
            "candidates": {f"k{k}": params for k in self.candidates},
            "score": torch.zeros(len(self.candidates), dtype=dtype),
            "round": torch.zeros((), dtype=torch.int64),
            "choice": torch.tensor(first, dtype=torch.int64),
        }

    def client_init(self, down: Tree) -> Tree:
        return {"candidates": dict(down["candidates"])}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        probing, choice = self._phase(down)
        starts = {
            f"k{k}": self.hybrid(k, down["candidates"][f"k{k}"], state["candidates"][f"k{k}"])
            for k in self.candidates
        }
        n, kk = data.num_clients, len(self.candidates)
        if probing:
            train_rows, held_rows = self.split_rows(data)
            val = torch.stack(
                [self.local_loss(starts[f"k{k}"], held_rows) for k in self.candidates], 1
            )  # (clients, K)
            # All candidates in one batched run: candidate-major along the clients axis.
            folded = {
                name: torch.cat([starts[f"k{k}"][name] for k in self.candidates])
                for name in starts["k0"]
            }
            rows = ClientData(
                train_rows.x.repeat(kk, 1, 1),
                train_rows.y.repeat(kk, 1, 1),
                train_rows.count.repeat(kk),
                train_rows.seeds * kk,
            )
            trained, loss = self.local_train(folded, rows)
            new = {
                f"k{k}": {name: t[i * n : (i + 1) * n] for name, t in trained.items()}
                for i, k in enumerate(self.candidates)
            }
            loss = loss.reshape(kk, n)[choice]
        else:
            val = torch.zeros(n, kk, dtype=data.x.dtype)
            trained, loss = self.local_train(starts[f"k{choice}"], data)
            # Frozen candidates: echo what was received (their averages do not move).
            new = {f"k{k}": down["candidates"][f"k{k}"] for k in self.candidates}
            new[f"k{choice}"] = trained
            state_new = dict(state["candidates"])
            state_new[f"k{choice}"] = trained
        own = new if probing else state_new
        return ClientResult(
            {"candidates": new, "val_loss": val},
            {"candidates": {k: dict(v) for k, v in own.items()}},
            {"train_loss": loss},
        )

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        w = self.weights(weights)
        t = int(server["round"])
        new = {
            **server,
            "candidates": weighted_mean(replies["candidates"], w),
            "round": server["round"] + 1,
        }
        if self.force_k < 0 and t < self.probe_rounds:
            score = weighted_mean({"s": replies["val_loss"]}, w)["s"]
            new["score"] = score
            if t == self.probe_rounds - 1:
                new["choice"] = torch.argmin(score).to(torch.int64)  # first minimum
        return new

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        _, choice = self._phase(down)
        return self.hybrid(
            choice, down["candidates"][f"k{choice}"], state["candidates"][f"k{choice}"]
        )

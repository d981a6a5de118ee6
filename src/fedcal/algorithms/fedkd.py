"""FedKD / FedMD-style distillation over shared unlabeled inputs (survey seed 002, §2.2).

FedMD (Li & Wang, NeurIPS-W 2019) and the FedKD family of the survey replace
(or complement) parameter averaging by sharing *predictions on a public
unlabeled set*. One round, client k with private model θ_k:

1. digest + revisit: train θ_k for E epochs on
   L_k(θ_k) + ``kd_weight`` · (1/|X_pub|) Σ_{x∈X_pub} ‖r(θ_k; x) − r̄(x)‖²
   (the survey's "hard-label loss plus distillation to the teacher's soft
   labels"; for regression the KL of soft labels becomes a squared error);
2. communicate: upload r(θ_k; X_pub), the model's representation of the public set;
3. aggregate (server): the consensus r̄ = Σ_k w_k r(θ_k; X_pub) / Σ_k w_k,
   broadcast next round. Round 0 has no consensus yet: the distillation term
   is switched off (``ready`` = 0) until the first aggregate exists.

The personal model is the private model θ_k.

**The public set.** Calibration has a natural public unlabeled set (our
choice): the (frequency, temperature) operating grid without reference
pressures. It is built deterministically from hyperparameters, in scaled
units: ``public_points`` values per input, evenly spaced over ``public_box``.
Default: frequency 32.75–37.75 kHz (the quartz family's span from 0 to
1550 hPa, docs/simulated-fleet.md), i.e. [−0.05, 0.95] under the physical
scaling 28–38 kHz → [−1, 1]; temperature the six chamber plateaus −40…60 °C,
i.e. six points over [−1, 1]. 11 × 6 = 66 public inputs.

**What is distilled — the subtlety.** Sensors map the same (f, T) to very
different pressures (sensitivity 1.9–2.8 Hz/hPa and offsets of tens of Hz:
one pooled calibration is off by ~90 hPa), and each sensor only ever sees its
own frequency band. A consensus of *pressure predictions* at a raw (f, T)
is therefore the fleet-average calibration — the FedAvg answer — and pulling a
sensor toward it pulls it away from its own truth; where the grid lies outside
a sensor's band, its "prediction" is an extrapolation nobody measured. So the
default ``distill="features"`` shares the *representation*: the body's
features r(θ; x) (input of the last ``task.head_layers`` layers) on the public
grid. Agreeing on features is the functional form of FedPer's assumption —
one shared basis of (f, T) functions, a private head per sensor — and it
constrains each body also outside its own band, where the others have data.
``distill="output"`` is the literal FedMD (predictions r = f_θ(x)),
kept for comparison; expect it to hurt here, for the reason above.

``share="logits"`` (FedMD): only the public-set representations leave the
client. ``share="both"``: the body parameters are also uploaded and averaged,
and each round starts from (ω̄, φ_k) as in FedPer; the personal model is then
(ω̄, φ_k), the FedPer convention.

Defaults (ours): ``kd_weight`` = 1 (scaled units; FedMD itself alternates
digest and revisit phases instead of weighting, the survey's weighted sum is
what is implemented), grid as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult, SettingError
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import Tree, expand, weighted_mean
from fedcal.models.mlp import MLP
from fedcal.models.split import body_features


@dataclass(frozen=True)
class FedKD(Algorithm):
    kd_weight: Annotated[float, Field(ge=0.0)] = 1.0
    share: Literal["logits", "both"] = "logits"  # FedMD: predictions only | + body parameters
    distill: Literal["features", "output"] = "features"  # body representation (ours) | FedMD
    public_box: tuple[tuple[float, float], ...] = ((-0.05, 0.95), (-1.0, 1.0))
    public_points: tuple[Annotated[int, Field(ge=1)], ...] = (11, 6)

    name = "fedkd"
    uploads = ("public_outputs", "model")  # model: only with share="both"

    def check_task(self, task: Task) -> None:
        if not isinstance(task.model, MLP):
            raise ValueError("fedkd needs an MLP (its body features are distilled)")
        if len(self.public_box) != task.model.in_features or len(self.public_points) != len(
            self.public_box
        ):
            raise SettingError(
                "public_box, public_points",
                f"need one entry per input feature ({task.model.in_features})",
            )

    # ---- the public unlabeled set and what is shared about it -------------
    def public_inputs(self, dtype: torch.dtype) -> Tensor:
        """The grid X_pub (points, features), row-major over the inputs."""
        axes = [
            torch.linspace(lo, hi, n, dtype=torch.float64)
            for (lo, hi), n in zip(self.public_box, self.public_points, strict=True)
        ]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)
        return grid.reshape(-1, len(axes)).to(dtype)

    def represent(self, params: Tree, x: Tensor) -> Tensor:
        """r(θ; x): body features or model output, (clients, points, dims)."""
        head_layers = self.task.head_layers if self.distill == "features" else 0
        return body_features(self.task.model, params, x, head_layers)

    def _public(self, like: Tensor) -> Tensor:
        x = self.public_inputs(like.dtype)
        return x.unsqueeze(0).expand(like.shape[0], *x.shape)

    # ---- the contract -------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        one = expand(params, 1)
        return {
            # The common starting model. With share="logits" it never changes and
            # only serves to initialise clients (a deployment ships it once; the
            # simulator's byte count re-sends it every round).
            "model": params,
            # A placeholder of the right shape; unused while ``ready`` = 0.
            "consensus": self.represent(one, self._public(next(iter(one.values()))))[0],
            "ready": torch.zeros((), dtype=next(iter(params.values())).dtype),
        }

    def client_init(self, down: Tree) -> Tree:
        return {"model": down["model"]}

    def start_model(self, down: Tree, state: Tree) -> Tree:
        """θ_k to train from: the private model, with the averaged body if share="both"."""
        if self.share == "both":
            return self.task.join(down["model"], state["model"])  # (ω̄, φ_k)
        return state["model"]

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        consensus = down["consensus"]  # (clients, points, dims)
        on = down["ready"] * self.kd_weight  # (clients,)
        public = self._public(consensus)

        def distillation(params: Tree) -> Tensor:
            # Leaves it does not use (the head, for features) get a zero gradient.
            return on * (self.represent(params, public) - consensus).pow(2).mean((1, 2))

        trained, loss = self.local_train(self.start_model(down, state), data, penalty=distillation)
        with torch.no_grad():
            mine = self.represent(trained, public)
        reply: Tree = {"predictions": mine}
        if self.share == "both":
            reply["model"] = self.task.split(trained)[0]
        metrics = {"train_loss": loss, "kd_gap": (mine - consensus).pow(2).mean((1, 2))}
        return ClientResult(reply, {"model": trained}, metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        # share="both": the uploaded bodies are averaged, the server's head kept.
        new = super().server_update(server, replies, weights) if self.share == "both" else server
        return {
            **new,
            "consensus": weighted_mean({"r": replies["predictions"]}, self.weights(weights))["r"],
            "ready": torch.ones_like(server["ready"]),
        }

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return self.start_model(down, state)

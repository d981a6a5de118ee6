"""FedGen — data-free knowledge distillation with a server-side generator (Zhu, Hong & Zhou,
ICML 2021), adapted to regression. Survey seed 002, §2.2.

FedGen learns, on the server, a conditional generator G(z, c) of *features* —
the input of the model's head (predictor) — such that the clients' heads,
ensembled, map G(z, c) to label c. Clients then regularize local training with
generated features: their head must also map G(z, c) to c, which carries the
fleet's knowledge of "what a feature for label c looks like" without sharing
data. Per round (paper Alg. 1):

* client k: E epochs on
      ℓ_k(θ_k) + ``gen_weight`` · Σ_c p_k(c) · mean_z ‖head_k(G(z, c)) − t_c‖²    (1)
  (z ~ N(0, I) drawn from the client's round seed; p_k the client's own label
  distribution — the reference code samples y from the client's available
  labels); upload θ_k and the label counts n_{k,c};
* server: average the model (see ``head`` below), then ``gen_steps`` Adam
  steps on the generator loss (paper eq. 4 with the diversity term of the
  reference code)
      J(G) = Σ_c p(c) · mean_z ‖Σ_k α_{k,c} head_k(G(z, c)) − t_c‖²
             + ``diversity_weight`` · exp(−mean_{i,j} d₁(G_i, G_j) · d₂(z_i, z_j)),      (2)
  α_{k,c} = n_{k,c} / Σ_j n_{j,c} (each head weighted by its share of the label,
  as in the paper's ensemble), p(c) = Σ_k n_{k,c} / Σ n, d₁ the mean absolute
  and d₂ the mean squared difference.

**Regression labels.** Labels are ``num_bins`` bins of the scaled target over
``target_range``; c is the one-hot bin, t_c its centre, and the
classification loss becomes the squared error to t_c. Default 16 bins over
[−1, 1] = 0…1600 hPa: 100 hPa wide, centred on 50, 150, …, 1550 hPa — exactly
the 16 pressure levels of the calibration protocol.

**Generator.** A one-hidden-layer MLP [z, onehot(c)] → ``gen_hidden`` →
features, with the model's activation also on its output so that generated
features live where the body's features do (tanh: (−1, 1)). It is initialised
from ``seed`` and its noise drawn from (``seed``, round): deterministic.
Adam's moments restart every round (the reference keeps one optimizer).

**Head: personal (default) or shared.** FedGen averages the whole model and
serves the global model (``head="shared"``). A global calibration is useless
for sensors ~90 hPa apart, so by default (ours) the body is averaged and each
client keeps its head (FedPer with FedGen's regularizer); the personal model
is (ω̄, φ_k). Either way the heads are uploaded: the server's ensemble needs
them. With ``gen_weight`` = 0 the method is FedAvg / FedPer exactly.

Defaults: ``diversity_weight`` = 1 and ``noise_dim``/``gen_hidden`` small
(reference: ensemble_eta = 1; its generator sizes are for images);
``gen_steps`` = 10, ``gen_lr`` = 1e-3 (ours: more generator progress per
round than the reference's lr 3e-4). ``gen_weight`` = 0.01 (ours, measured):
generated tanh features are near-saturated, so the regularizer's curvature on
a linear head is ≈ 2·w·‖f‖² ≈ 2·w·width, and SGD is stable only for
lr·w·width < 1 (w < 0.3 at lr 0.05, width 64); on the default fleet (50
rounds, seed 0) w = 1 diverged, w = 0.1 gave 19.3 hPa, w = 0.01 16.9 hPa
(the reference's α = 10 is for CE losses on image features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData, per_client_normal
from fedcal.core.local import value_and_grad
from fedcal.core.optim import Adam
from fedcal.core.task import Task
from fedcal.core.tree import Tree, expand, tree_map
from fedcal.models.mlp import ACTIVATIONS, MLP
from fedcal.models.split import apply_head, feature_size

NOISE_STREAM = 7  # a client's generator noise, independent of its minibatch plan


def diversity(features: Tensor, noise: Tensor) -> Tensor:
    """exp(−mean_{i,j} d₁(f_i, f_j)·d₂(z_i, z_j)) per client: (clients,)."""
    d_feat = (features.unsqueeze(2) - features.unsqueeze(1)).abs().mean(-1)
    d_noise = (noise.unsqueeze(2) - noise.unsqueeze(1)).pow(2).mean(-1)
    return torch.exp(-(d_feat * d_noise).mean((1, 2)))


@dataclass(frozen=True)
class FedGen(Algorithm):
    gen_weight: Annotated[float, Field(ge=0.0)] = 0.01
    num_bins: Annotated[int, Field(ge=1)] = 16
    target_range: tuple[float, float] = (-1.0, 1.0)
    noise_dim: Annotated[int, Field(ge=0)] = 8
    gen_hidden: Annotated[int, Field(ge=0)] = 32
    samples_per_bin: Annotated[int, Field(ge=1)] = 4
    gen_steps: Annotated[int, Field(ge=0)] = 10
    gen_lr: Annotated[float, Field(ge=0.0)] = 1e-3
    diversity_weight: Annotated[float, Field(ge=0.0)] = 1.0
    head: Literal["personal", "shared"] = "personal"  # ours | the paper: FedAvg + generator
    seed: Annotated[int, Field(ge=0)] = 0

    name = "fedgen"
    uploads = ("model", "label_counts")  # label_counts: the pressure-bin histogram

    reply_aggregation = "custom"  # the generator trains on each client's head

    def check_task(self, task: Task) -> None:
        if not isinstance(task.model, MLP) or task.head_layers < 1:
            raise ValueError("fedgen needs an MLP with a head (task.head_layers >= 1)")

    # ---- labels: bins of the target ------------------------------------------
    def bin_centres(self, dtype: torch.dtype) -> Tensor:
        lo, hi = self.target_range
        width = (hi - lo) / self.num_bins
        return lo + width * (torch.arange(self.num_bins, dtype=torch.float64) + 0.5).to(dtype)

    def bin_counts(self, data: ClientData) -> Tensor:
        """n_{k,c}: rows of each client per target bin (clients, bins); out-of-range rows clamp."""
        lo, hi = self.target_range
        index = ((data.y[..., 0] - lo) / (hi - lo) * self.num_bins).floor().long()
        onehot = torch.nn.functional.one_hot(index.clamp(0, self.num_bins - 1), self.num_bins)
        return (onehot.to(data.x.dtype) * data.mask.unsqueeze(-1)).sum(1)

    # ---- the generator --------------------------------------------------------
    @property
    def generator_net(self) -> MLP:
        width = feature_size(self.task.model, self.task.head_layers)
        return MLP(
            self.noise_dim + self.num_bins, (self.gen_hidden,), width, self.task.model.activation
        )

    def generate(self, generator: Tree, noise: Tensor) -> tuple[Tensor, Tensor]:
        """Features G(z, c) for every bin: noise (clients, bins·samples, noise_dim) →
        (features (clients, bins·samples, width), bin index of each row (bins·samples,))."""
        bins = torch.arange(self.num_bins).repeat_interleave(self.samples_per_bin)
        onehot = torch.nn.functional.one_hot(bins, self.num_bins).to(noise.dtype)
        inputs = torch.cat([noise, onehot.expand(noise.shape[0], -1, -1)], -1)
        out = self.generator_net.apply(generator, inputs)
        return ACTIVATIONS[self.task.model.activation](out), bins

    def heads_on(self, heads: Tree, features: Tensor) -> Tensor:
        """head_k(f): (clients, rows) for features (clients, rows, width)."""
        return apply_head(self.task.model, heads, features, self.task.head_layers)[..., 0]

    def generator_loss(self, generator: Tree, heads: Tree, counts: Tensor, noise: Tensor) -> Tensor:
        """J(G) of eq. (2) for one noise draw (1, bins·samples, noise_dim): a scalar."""
        features, bins = self.generate(generator, noise)  # (1, S, width)
        clients = counts.shape[0]
        preds = self.heads_on(heads, features.expand(clients, -1, -1))  # (clients, S)
        share = counts / counts.sum(0, keepdim=True).clamp_min(1e-12)  # α_{k,c}
        ensemble = (share[:, bins] * preds).sum(0)  # (S,)
        prior = counts.sum(0) / counts.sum()  # p(c)
        err = (ensemble - self.bin_centres(preds.dtype)[bins]).pow(2)
        teacher = (prior[bins] * err).sum() / self.samples_per_bin
        return teacher + self.diversity_weight * diversity(features, noise)[0]

    def train_generator(
        self, generator: Tree, heads: Tree, counts: Tensor, round_index: int
    ) -> Tree:
        """``gen_steps`` Adam steps on J(G), the heads fixed; noise from (seed, round)."""
        dtype = counts.dtype
        shape = (self.gen_steps, 1, self.num_bins * self.samples_per_bin, self.noise_dim)
        noise = per_client_normal((self.seed,), shape, round_index, dtype)[0]
        params = expand(generator, 1)
        adam = Adam(self.gen_lr)
        state = adam.init(params)
        for step in range(self.gen_steps):
            _, grads = value_and_grad(
                lambda g, z=noise[step]: self.generator_loss(g, heads, counts, z).reshape(1),
                params,
            )
            params, state = adam.update(params, grads, state)
        return tree_map(lambda t: t[0], params)

    # ---- the contract ---------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        dtype = next(iter(params.values())).dtype
        generator = self.generator_net.init(torch.Generator().manual_seed(self.seed), dtype)
        return {
            "model": params,
            "generator": generator,
            "round": torch.zeros((), dtype=torch.int64),
        }

    def client_init(self, down: Tree) -> Tree:
        return {"model": down["model"]} if self.head == "personal" else {}

    def start_model(self, down: Tree, state: Tree) -> Tree:
        if self.head == "shared":
            return down["model"]
        return self.task.join(down["model"], state["model"])  # (ω̄, φ_k)

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        model = self.start_model(down, state)
        counts = self.bin_counts(data)  # (clients, bins)
        own = counts / counts.sum(1, keepdim=True).clamp_min(1.0)  # p_k(c)
        shape = (self.num_bins * self.samples_per_bin, self.noise_dim)
        noise = per_client_normal(data.seeds, shape, NOISE_STREAM, data.x.dtype)
        with torch.no_grad():
            features, bins = self.generate(down["generator"], noise)
        targets = self.bin_centres(data.x.dtype)[bins]
        # Round 0: the generator is untrained, the regularizer waits (as in the reference).
        on = self.gen_weight * (down["round"] > 0).to(data.x.dtype)  # (clients,)

        def fit_error(params: Tree) -> Tensor:
            err = (self.heads_on(self.task.split(params)[1], features) - targets).pow(2)
            return (own[:, bins] * err).sum(1) / self.samples_per_bin

        def regularizer(params: Tree) -> Tensor:
            return on * fit_error(params)  # the body gets a zero gradient from it

        trained, loss = self.local_train(model, data, penalty=regularizer)
        with torch.no_grad():
            metrics = {"train_loss": loss, "gen_fit": fit_error(trained)}
        state = {"model": trained} if self.head == "personal" else {}
        return ClientResult({"model": trained, "bin_counts": counts}, state, metrics)

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        # The heads are uploaded for the generator's ensemble; with personal heads
        # only the bodies are averaged.
        bodies, heads = self.task.split(replies["model"])
        shared = {"model": replies["model"] if self.head == "shared" else bodies}
        averaged = super().server_update(server, shared, weights)["model"]
        generator = self.train_generator(
            server["generator"],
            heads,
            replies["bin_counts"],
            int(server["round"]),
        )
        return {"model": averaged, "generator": generator, "round": server["round"] + 1}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        return self.start_model(down, state)

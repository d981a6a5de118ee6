"""FedLSA — learnable semantic anchors with hyperspherical contrast (seed 001).

"Beyond Federated Prototype Learning: Learnable Semantic Anchors with
Hyperspherical Contrast for Domain-Skewed Data", AAAI 2025, as read from
the seed's code walk-through. Model Φ = ψ ∘ projector ∘ nor ∘ classifier
(:class:`~fedcal.models.classifier.HypersphereClassifier`), h on the unit
sphere of R^L, C classes.

Server (alg. 1, server side), every round and once before the first:

* anchors A = nor(Θ(R)) (eq. 2), R ∈ R^{C×L} ~ N(0, 1) learnable, Θ a 2-layer
  MLP L → L → L with ReLU (the seed's ``SemanticAnchorLearner``);
* E_s Adam steps (lr 1e-3) on L_LSA = L_ACE + α·L_SEP (eq. 5) over (R, Θ):
  L_ACE = CE(φ_glo(a_i), i) averaged over i = 0…C−1 (eq. 3), φ_glo the
  classifier of the current global model, held fixed (alg. 1 updates R and Θ
  only; the seed's diagram also lists φ_glo — ``tune_global_classifier=True``
  takes that reading and broadcasts the tuned classifier);
  L_SEP = mean_i log( Σ_{j≠i} exp(a_i·a_jᵀ/τ) / (C−1) ) (eq. 4). The seed's
  code omits the −log(C−1) constant of eq. 4; it shifts the loss, not the
  gradient. The Adam state persists across rounds, as the seed's server
  keeps one optimizer.

Round order: the engine runs broadcast → clients → server_update, so the
server trains the anchors at the end of ``server_update`` (after FedAvg,
against the new φ_glo) and in ``server_init``: every broadcast carries anchors
trained on the model it carries, as in the seed's flow chart.

Client (alg. 1, client side): from the global model, E_c epochs of SGD on
L_HC = L_CE + λ·L_COM (eq. 10), L_COM = CE(h·Aᵀ/τ, y) (eq. 8) against the
broadcast anchors (fixed during local training). Upload the model; the server
averages the uploads weighted by train rows, Φ_glo = Σ_m n_m/n·Φ_m.

FedLSA is not personalized (alg. 1 outputs Φ_glo): each client's model is
the global one. Ablations of the paper's table: ``use_com=False`` (no L_COM —
the client step is then FedAvg's exactly, and the server skips anchor
training, which nothing reads), ``use_sep=False`` (anchors on L_ACE only).

Defaults are the seed's (§5.1 config): λ = 0.5, τ = 0.1, α = 0.4, E_s = 500,
anchor lr 1e-3, E_c = 5, SGD lr 0.01 momentum 0.9, batch 64, sample-weighted
aggregation. The seed's Office-Caltech config adds weight decay 5e-4; its
hyperparameter list does not, and neither does our default.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated

import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import ClientResult
from fedcal.core.classification import FedLSARecipe, class_index, masked_cross_entropy
from fedcal.core.data import ClientData
from fedcal.core.local import LossFn
from fedcal.core.task import Task
from fedcal.core.tree import Tree, zeros_like
from fedcal.models.classifier import normalize, require_embedding
from fedcal.models.mlp import MLP


def separation_loss(anchors: Tensor, tau: float) -> Tensor:
    """L_SEP (eq. 4) of anchors (..., C, L) → (...,): mean_i log(Σ_{j≠i} e^{a_i·a_j/τ} / (C−1))."""
    c = anchors.shape[-2]
    sim = anchors @ anchors.transpose(-1, -2) / tau
    eye = torch.eye(c, dtype=torch.bool, device=anchors.device)
    sim = sim.masked_fill(eye, float("-inf"))  # exp(−∞) = 0 drops j = i
    return (torch.logsumexp(sim, -1) - torch.log(torch.tensor(c - 1.0, dtype=sim.dtype))).mean(-1)


def compactness_loss(h: Tensor, anchors: Tensor, labels: Tensor, w: Tensor, tau: float) -> Tensor:
    """L_COM (eq. 8), per client (clients,): mean over real rows of CE(h·Aᵀ/τ, y).

    h: (clients, batch, L); anchors: (clients, C, L); labels (clients, batch);
    w: (clients, batch), 0 on padding.
    """
    return masked_cross_entropy(h @ anchors.transpose(1, 2) / tau, labels, w)


def _seed_from(params: Tree) -> int:
    # R's draw follows the model's initialisation (hence the run's init seed)
    # without needing a generator in server_init.
    h = hashlib.sha256()
    for v in params.values():
        h.update(v.detach().to(torch.float64).numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


@dataclass(frozen=True)
class FedLSA(FedLSARecipe):
    lam: Annotated[float, Field(ge=0.0)] = 0.5  # λ, weight of L_COM (eq. 10)
    tau: Annotated[float, Field(gt=0.0)] = 0.1  # τ, temperature of eqs. 4 and 8
    alpha: Annotated[float, Field(ge=0.0)] = 0.4  # α, weight of L_SEP (eq. 5)
    anchor_steps: Annotated[int, Field(ge=0)] = 500  # E_s
    anchor_lr: Annotated[float, Field(ge=0.0)] = 1e-3
    use_com: bool = True
    use_sep: bool = True
    tune_global_classifier: bool = False
    # None: derived from the initial model parameters
    anchor_seed: Annotated[int, Field(ge=0)] | None = None

    name = "fedlsa"
    task_kind = "classification"

    def check_task(self, task: Task) -> None:
        require_embedding(task.model, self.name)

    @property
    def classifier(self) -> tuple[str, ...]:
        return self.task.head

    def _mapping(self) -> MLP:
        dim = self.task.model.embed_dim
        return MLP(dim, (dim,), dim, "relu")  # Θ: Linear, ReLU, Linear

    # ---- server: the semantic anchor learner ----------------------------
    def anchors_of(self, learner: Tree) -> Tensor:
        """A = nor(Θ(R)) for a learner tree with a leading axis: (k, C, L)."""
        theta = {k.removeprefix("theta."): v for k, v in learner.items() if k != "R"}
        return normalize(self._mapping().apply(theta, learner["R"]))

    def anchor_loss(self, learner: Tree, classifier: Tree) -> Tensor:
        """L_LSA = L_ACE + α·L_SEP (eq. 5); trees with a leading axis of 1 → (1,)."""
        anchors = self.anchors_of(learner)
        c = anchors.shape[1]
        labels = torch.arange(c).unsqueeze(0)
        ones = torch.ones(1, c, dtype=anchors.dtype)
        ace = masked_cross_entropy(self.task.model.classify(classifier, anchors), labels, ones)
        if not self.use_sep:
            return ace
        return ace + self.alpha * separation_loss(anchors, self.tau)

    def train_anchors(self, server: Tree) -> Tree:
        """E_s Adam steps on L_LSA; returns the server with new learner, optimizer, anchors.

        Plain torch (``torch.optim.Adam`` on fresh leaf copies): this is the
        server's own computation on a handful of small tensors, and the fused
        optimizer makes the 500 steps of a round cheap. The optimizer state is
        restored from and saved to the server tree, so rounds chain as one run.
        """
        if not self.use_com:
            return server  # no client reads the anchors: nothing to train them for
        tune = self.tune_global_classifier
        learner = {k: v.unsqueeze(0).clone().requires_grad_() for k, v in server["learner"].items()}
        classifier = {
            k: server["model"][k].unsqueeze(0).clone().requires_grad_(tune) for k in self.classifier
        }
        trained = {**learner, **classifier} if tune else learner
        adam = torch.optim.Adam(list(trained.values()), lr=self.anchor_lr, foreach=True)
        saved = server["anchor_opt"]
        for k, p in trained.items():
            adam.state[p] = {
                "step": saved["step"].clone(),
                "exp_avg": saved["exp_avg"][k].unsqueeze(0).clone(),
                "exp_avg_sq": saved["exp_avg_sq"][k].unsqueeze(0).clone(),
            }
        with torch.enable_grad():
            for _ in range(self.anchor_steps):
                adam.zero_grad(set_to_none=True)
                self.anchor_loss(learner, classifier).sum().backward()
                adam.step()
        with torch.no_grad():
            anchors = self.anchors_of(learner)[0]
        state = [adam.state[p] for p in trained.values()]
        return {
            **server,
            "model": {**server["model"], **{k: v[0].detach() for k, v in classifier.items()}},
            "learner": {k: v[0].detach() for k, v in learner.items()},
            "anchor_opt": {
                "step": state[0]["step"].clone(),  # one counter: every leaf steps together
                "exp_avg": {k: s["exp_avg"][0] for k, s in zip(trained, state, strict=True)},
                "exp_avg_sq": {k: s["exp_avg_sq"][0] for k, s in zip(trained, state, strict=True)},
            },
            "anchors": anchors,
        }

    def server_init(self, params: Tree) -> Tree:
        dtype = next(iter(params.values())).dtype
        seed = _seed_from(params) if self.anchor_seed is None else self.anchor_seed
        gen = torch.Generator().manual_seed(seed)
        c, dim = self.task.model.num_classes, self.task.model.embed_dim
        r = torch.randn(c, dim, generator=gen, dtype=torch.float64).to(dtype)
        theta = {f"theta.{k}": v for k, v in self._mapping().init(gen, dtype).items()}
        learner = {"R": r, **theta}
        trained = (
            {**learner, **self.task.split(params)[1]} if self.tune_global_classifier else learner
        )
        opt = {
            "step": torch.zeros((), dtype=torch.float32),  # torch.optim.Adam's step counter
            "exp_avg": zeros_like(trained),
            "exp_avg_sq": zeros_like(trained),
        }
        server = {
            "model": params,
            "learner": learner,
            "anchor_opt": opt,
            "anchors": torch.zeros(c, dim, dtype=dtype),
        }
        return self.train_anchors(server)

    def broadcast(self, server: Tree) -> Tree:
        return {"model": server["model"], "anchors": server["anchors"]}

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        return self.train_anchors(super().server_update(server, replies, weights))

    # ---- clients -------------------------------------------------------
    def client_loss(self, anchors: Tensor) -> LossFn:
        """L_HC = L_CE + λ·L_COM against the given anchors (clients, C, L), per client."""
        model = self.task.model

        def loss(params: Tree, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            h = model.embed(params, x)
            labels = class_index(y)
            ce = masked_cross_entropy(model.classify(params, h), labels, w)
            return ce + self.lam * compactness_loss(h, anchors, labels, w, self.tau)

        return loss

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        objective = self.client_loss(down["anchors"]) if self.use_com else None
        trained, loss = self.local_train(down["model"], data, loss=objective)
        return ClientResult({"model": trained}, state, {"train_loss": loss})

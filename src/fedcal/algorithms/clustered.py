"""Parameter-layered clustered pFL (seed 003: patent "一种基于参数分层的个性化联邦学习方法").

The model is split into base layers W_B (shared: ``task.body``) and personalized
layers W_P,i (private: ``task.head``). One round (patent steps S3–S6):

S3. client i trains both from (W_B^{t−1}, W_P,i^{t−1}) by local SGD and forms its
    base-layer update Δ_i = W_B,i^t − W_B^{t−1};
S4. it reduces Δ_i by SVD to its three leading directions V_i = [v_i1, v_i2, v_i3]
    (the "triple vector matrix"). Our reading: per base layer, the update matrix
    [ΔW | Δb] (out × (in+1), a tensor with leading dimension ``out`` reshaped to
    out × rest) and its top-3 *left* singular vectors (out × 3). Left vectors
    live in the layer's output (neuron) space, which all clients share because
    W_B^{t−1} is common; the right vectors of the first layer would span all of
    R^{in+1} = R^3 and say nothing. ``torch.linalg.svd`` runs batched over clients;
S5. the server compares clients by a subspace similarity of their directions
    (the patent's formulas are lost images; two principled choices, parameter
    ``similarity``), averaged over base layers:
      * ``"principal_angles"`` (default): ‖U_iᵀU_j‖_F² / r, the mean squared cosine
        of the principal angles between the two r-dim subspaces (1 = same span);
      * ``"matched_cosine"``: mean_k |u_ik · u_jk|, |cos| of matched leading vectors;
    distance α_ij = 1 − similarity, K-Medoids (PAM: BUILD then SWAP, the swap cost
    being the change of total distance, the patent's Cost = E_m − E_{m−1}) into K
    groups; each group averages its members' base layers weighted by sample count
    (S43: n_i / n within the group);
S6. the server averages the group means into W_B^t — the plain mean over groups
    (``group_weighting="uniform"``, default: each group one voice, so a large
    family cannot drown a small one) or weighted by the groups' sample counts
    (``"samples"``, which equals FedAvg of the base layers).

S8. after the last round the base is frozen and the personal layers are
    fine-tuned locally: ``personalize`` runs ``finetune_epochs`` head-only epochs
    from (W_B, W_P,i).

Order invariance: PAM's result can depend on the order of its input (ties in
BUILD/SWAP). Each reply carries a client key (the client's round seed, a function
of run seed, round and client index only); the server sorts clients by key before
clustering and numbers the groups by first appearance in key order, so labels do
not depend on the order replies arrive in. The latest labels are kept in the
server state, sorted by key, in a table of fixed size ``label_capacity`` (−1 =
empty) so the state keeps its shape; :func:`labels_of` reads them back for a list
of keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import Tree, tree_map, weighted_mean

Similarity = Literal["principal_angles", "matched_cosine"]


def leading_directions(delta: Tree, layers: list[tuple[str, ...]], rank: int = 3) -> Tree:
    """Per layer: the top-``rank`` left singular vectors of [ΔW | Δb] → (clients, out, r).

    ``delta`` is a flat client tree; each layer's tensors share the leading
    (out) dimension and are reshaped to (clients, out, −1) and concatenated.
    """
    out: Tree = {}
    for names in layers:
        cols = [delta[n].reshape(delta[n].shape[0], delta[n].shape[1], -1) for n in names]
        update = torch.cat(cols, dim=2)  # (clients, out, in + 1)
        u, _, _ = torch.linalg.svd(update, full_matrices=False)
        out[names[0]] = u[..., : min(rank, u.shape[-1])]
    return out


def subspace_similarity(directions: Tree, kind: Similarity = "principal_angles") -> Tensor:
    """Pairwise similarity (n, n) of clients' directions, averaged over layers."""
    per_layer = []
    for u in directions.values():  # (n, out, r), orthonormal columns
        if kind == "principal_angles":
            cross = torch.einsum("aor,bos->abrs", u, u)  # U_aᵀU_b for every pair
            per_layer.append(cross.pow(2).sum((2, 3)) / u.shape[-1])
        elif kind == "matched_cosine":
            per_layer.append(torch.einsum("aor,bor->abr", u, u).abs().mean(-1))
        else:
            raise ValueError(f"similarity must be one of {get_args(Similarity)}")
    return torch.stack(per_layer).mean(0)


def k_medoids(distance: Tensor, keys: Tensor, k: int, method: str = "pam", seed: int = 0) -> Tensor:
    """Group labels (n,) of K-Medoids on ``distance``, independent of the clients' order.

    Clients are sorted by ``keys`` before the search and groups are numbered by
    their first member in key order.
    """
    n = distance.shape[0]
    k = min(k, n)
    order = torch.argsort(keys).numpy()
    d = distance.detach().to(torch.float64).numpy()[np.ix_(order, order)]
    d = np.clip((d + d.T) / 2.0, 0.0, None)
    np.fill_diagonal(d, 0.0)
    import kmedoids  # here, not at module level: it pulls scipy/sklearn into every import

    if k == n:
        sorted_labels = np.arange(n)
    elif method == "pam":
        sorted_labels = np.asarray(kmedoids.pam(d, k, init="build", random_state=seed).labels)
    elif method == "fasterpam":
        sorted_labels = np.asarray(kmedoids.fasterpam(d, k, random_state=seed, n_cpu=1).labels)
    else:
        raise ValueError("method must be 'pam' or 'fasterpam'")
    first_seen: dict[int, int] = {}
    canonical = np.array([first_seen.setdefault(int(g), len(first_seen)) for g in sorted_labels])
    labels = np.empty(n, dtype=np.int64)
    labels[order] = canonical
    return torch.as_tensor(labels)


def group_means(replies: Tree, labels: Tensor, weights: Tensor, k: int) -> tuple[Tree, Tensor]:
    """Per group: Σ_{i∈g} w_i x_i / Σ_{i∈g} w_i (patent S43) → (k, ...), and group weights (k,)."""
    member = torch.nn.functional.one_hot(labels, k).to(torch.float64) * weights.unsqueeze(1)
    totals = member.sum(0)  # (k,)
    share = member / totals.clamp_min(torch.finfo(torch.float64).tiny)

    def mean(t: Tensor) -> Tensor:
        return torch.einsum("nk,n...->k...", share.to(t.dtype), t)

    return tree_map(mean, replies), totals


def labels_of(server: Tree, keys: Tensor) -> Tensor:
    """The stored labels of clients with ``keys`` (−1 for keys not in the last round)."""
    table = server["clusters"]
    stored = {int(a): int(b) for a, b in zip(table["key"], table["label"], strict=True) if a >= 0}
    return torch.tensor([stored.get(int(key), -1) for key in keys], dtype=torch.int64)


@dataclass(frozen=True)
class ClusteredLayered(Algorithm):
    """Defaults: K = 2 and 3 directions (patent: "three leading directions"; K is
    not given, ours); group_weighting "uniform" (patent: unspecified, ours);
    sample_weighted True (patent S43: n_i/n inside a group); finetune_epochs 5
    (ours, = local_epochs); label_capacity bounds the cohort size kept for
    inspection."""

    num_groups: Annotated[int, Field(ge=1)] = 2
    rank: Annotated[int, Field(ge=1)] = 3
    similarity: Similarity = "principal_angles"
    group_weighting: Literal["uniform", "samples"] = "uniform"
    kmedoids_method: Literal["pam", "fasterpam"] = "pam"
    cluster_seed: Annotated[int, Field(ge=0)] = 0
    finetune_epochs: Annotated[int, Field(ge=0)] = 5
    sample_weighted: bool = True
    label_capacity: Annotated[int, Field(ge=0)] = 1024

    name = "clustered"
    uploads = ("model", "update_directions")  # SVD directions of Δ_i

    reply_aggregation = "custom"  # clustering of the replies

    def check_task(self, task: Task) -> None:
        if not task.body:
            raise ValueError(
                "clustered needs shared base layers, but every layer of this model is head"
            )

    def base_layers(self) -> list[tuple[str, ...]]:
        head = set(self.task.head)
        return [layer for layer in self.task.model.layers() if not set(layer) & head]

    def server_init(self, params: Tree) -> Tree:
        empty = torch.full((self.label_capacity,), -1, dtype=torch.int64)
        return {"model": params, "clusters": {"key": empty, "label": empty.clone()}}

    def broadcast(self, server: Tree) -> Tree:
        return {"model": server["model"]}

    def client_init(self, down: Tree) -> Tree:
        return {"head": self.task.split(down["model"])[1]}

    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        base = self.task.split(down["model"])[0]
        # S3: SGD on base and personal layers from (W_B^{t−1}, W_P,i^{t−1}).
        trained, loss = self.local_train(self.task.join(base, state["head"]), data)
        new_base, new_head = self.task.split(trained)
        delta = {k: new_base[k] - base[k] for k in base}
        # S4: the three leading directions of the update, per base layer.
        directions = leading_directions(delta, self.base_layers(), self.rank)
        key = torch.tensor(data.seeds, dtype=torch.int64)
        reply = {"base": new_base, "directions": directions, "key": key}
        return ClientResult(reply, {"head": new_head}, {"train_loss": loss})

    def cluster(self, replies: Tree) -> Tensor:
        """S5: labels (clients,) of K-Medoids on 1 − similarity of the directions."""
        distance = 1.0 - subspace_similarity(replies["directions"], self.similarity)
        return k_medoids(
            distance, replies["key"], self.num_groups, self.kmedoids_method, self.cluster_seed
        )

    def server_update(self, server: Tree, replies: Tree, weights: Tensor) -> Tree:
        labels = self.cluster(replies)
        k = int(labels.max()) + 1
        means, totals = group_means(replies["base"], labels, self.weights(weights), k)
        # S6: the new base is the mean of the group means.
        group_w = totals if self.group_weighting == "samples" else torch.ones_like(totals)
        new_base = weighted_mean(means, group_w)
        return {
            **server,
            "model": {**server["model"], **new_base},
            "clusters": self.label_table(replies["key"], labels),
        }

    def label_table(self, keys: Tensor, labels: Tensor) -> Tree:
        if keys.shape[0] > self.label_capacity:
            raise ValueError(f"cohort of {keys.shape[0]} > label_capacity={self.label_capacity}")
        order = torch.argsort(keys)
        key = torch.full((self.label_capacity,), -1, dtype=torch.int64)
        label = key.clone()
        key[: len(order)] = keys[order]
        label[: len(order)] = labels[order]
        return {"key": key, "label": label}

    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        # S8: base frozen, personal layers fine-tuned on local data.
        model = self.task.join(down["model"], state["head"])
        if self.finetune_epochs == 0:
            return model
        tuned, _ = self.local_train(
            model, data, wrt=self.task.head, epochs=self.finetune_epochs, stream=1
        )
        return tuned

"""FedLSA (seed 001) against hand-computed losses, the seed's own server code, and FedAvg."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.fedlsa import FedLSA, compactness_loss, separation_loss
from fedcal.core.classification import ClassificationTask
from fedcal.core.data import ClientData
from fedcal.core.tree import expand, flatten, weighted_mean
from fedcal.models.classifier import HypersphereClassifier

D64 = torch.float64
MODEL = HypersphereClassifier(in_features=6, encoder=(7,), embed_dim=4, num_classes=3)


def make(**kw) -> FedLSA:
    kw.setdefault("anchor_steps", 5)
    return FedLSA(ClassificationTask(MODEL), **kw)


def init(seed=0):
    return MODEL.init(torch.Generator().manual_seed(seed), D64)


def cohort(counts=(9, 5), seed=0) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    rows = max(counts)
    x = torch.randn(len(counts), rows, 6, generator=gen, dtype=D64)
    y = torch.randint(0, 3, (len(counts), rows, 1), generator=gen).to(D64)
    mask = torch.arange(rows).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
    return ClientData(
        x * mask.unsqueeze(-1), y * mask.unsqueeze(-1), torch.tensor(counts), (11, 12)
    )


def test_separation_loss_hand_computed():
    """a = (1,0), (0,1), (−1,0); τ = 0.5; a_i·a_j/τ: (1,2) 0, (1,3) −2, (2,3) 0.
    i=1: log((e^0 + e^−2)/2); i=2: log((e^0 + e^0)/2) = 0; i=3: log((e^−2 + e^0)/2).
        oracle = (2 * math.log((1 + math.exp(-2)) / 2) + 0.0) / 3"""
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=D64)
    oracle = (2 * math.log((1 + math.exp(-2)) / 2) + 0.0) / 3
    assert separation_loss(a, 0.5).item() == pytest.approx(oracle, abs=1e-14)
    # Batched over a leading axis, each set on its own.
    both = separation_loss(torch.stack([a, a.flip(0)]), 0.5)
    assert torch.allclose(both, torch.full((2,), oracle, dtype=D64), atol=1e-14)


def test_compactness_loss_hand_computed():
    """Anchors as above, τ = 0.5. Client 0: h = (1,0), y = 0 → logits (2, 0, −2):
        row0 = math.log(1 + math.exp(-2) + math.exp(-4))
    h = (0,1), y = 2 → logits (0, 2, 0): row1 = -math.log(1 / (2 + math.exp(2)))
    client 0 = (row0 + row1)/2; its third row is padding (w = 0).
    Client 1: h = (−1,0), y = 1 → logits (−2, 0, 2): math.log(math.exp(-2) + 1 + math.exp(2))"""
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=D64)
    h = torch.tensor(
        [[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]], [[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]], dtype=D64
    )
    labels = torch.tensor([[0, 2, 1], [1, 0, 0]])
    w = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D64)
    row0 = math.log(1 + math.exp(-2) + math.exp(-4))
    row1 = -math.log(1 / (2 + math.exp(2)))
    client1 = math.log(math.exp(-2) + 1 + math.exp(2))
    got = compactness_loss(h, torch.stack([a, a]), labels, w, 0.5)
    assert got.tolist() == pytest.approx([(row0 + row1) / 2, client1], abs=1e-14)


def seed_server(alg: FedLSA, learner: dict, classifier: dict):
    """The seed's server code (§2.3, ``SemanticAnchorLearner`` + ``train_semantic_anchors``)
    as an nn.Module with torch.optim.Adam, loaded with our initial R and Θ."""
    dim = learner["R"].shape[1]
    module = nn.Module()
    module.anchor_params = nn.Parameter(learner["R"].clone())
    module.mapping_func = nn.Sequential(
        nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim)
    ).double()
    with torch.no_grad():
        module.mapping_func[0].weight.copy_(learner["theta.l0.weight"])
        module.mapping_func[0].bias.copy_(learner["theta.l0.bias"])
        module.mapping_func[2].weight.copy_(learner["theta.l1.weight"])
        module.mapping_func[2].bias.copy_(learner["theta.l1.bias"])
    opt = torch.optim.Adam(module.parameters(), lr=alg.anchor_lr)

    def anchors():
        return F.normalize(module.mapping_func(module.anchor_params), p=2, dim=1)

    def train(cls_w, cls_b, steps):
        for _ in range(steps):
            opt.zero_grad()
            a = anchors()
            ace = F.cross_entropy(F.linear(a, cls_w, cls_b), torch.arange(a.shape[0]))
            sim = a @ a.T / alg.tau
            mask = 1.0 - torch.eye(a.shape[0], dtype=a.dtype)
            sep = torch.logsumexp(sim * mask + (1.0 - mask) * (-1e9), dim=1).mean()
            (ace + alg.alpha * sep).backward()
            opt.step()
        return anchors().detach()

    return train


def test_anchor_training_matches_the_seed_code_across_rounds():
    """Initial training and one more round (new global classifier, Adam state carried over)
    equal the seed's module-and-optimizer code at float64."""
    alg = make(anchor_steps=40)
    params = init()
    untrained = make(anchor_steps=0).server_init(params)
    train = seed_server(alg, untrained["learner"], {})
    server = alg.server_init(params)
    ref = train(params["cls.weight"], params["cls.bias"], 40)
    assert torch.allclose(server["anchors"], ref, atol=1e-12)
    # A round: clients' uploads averaged, then 40 more steps against the new classifier.
    replies = {"model": {k: torch.stack([v, v + 0.3]) for k, v in params.items()}}
    new = alg.server_update(server, replies, torch.tensor([1.0, 3.0]))
    mean = weighted_mean(replies["model"], torch.tensor([1.0, 3.0], dtype=D64))
    for k in params:
        assert torch.allclose(new["model"][k], mean[k], atol=1e-14)  # FedAvg, n-weighted
    ref = train(mean["cls.weight"], mean["cls.bias"], 40)
    assert torch.allclose(new["anchors"], ref, atol=1e-12)
    assert new["anchor_opt"]["step"].item() == 80


def test_anchors_are_unit_norm_separated_and_classified_by_their_index():
    model = HypersphereClassifier(in_features=6, encoder=(7,), embed_dim=16, num_classes=10)
    params = model.init(torch.Generator().manual_seed(1), D64)
    before = FedLSA(ClassificationTask(model), anchor_steps=0).server_init(params)["anchors"]
    after = FedLSA(ClassificationTask(model), anchor_steps=500).server_init(params)["anchors"]

    def max_cos(a):
        return (a @ a.T - 2 * torch.eye(10, dtype=D64)).max().item()

    assert torch.allclose(after.norm(dim=1), torch.ones(10, dtype=D64), atol=1e-12)
    assert max_cos(before) > 0.9  # Θ(R) starts nearly collapsed (ReLU MLP on Gaussian R)
    assert max_cos(after) < 0.2  # pushed apart by L_SEP
    logits = model.classify(expand(params, 1), after.unsqueeze(0))[0]
    assert torch.equal(logits.argmax(1), torch.arange(10))  # L_ACE: anchor i reads as class i


def test_without_separation_the_anchor_loss_is_the_anchor_ce_alone():
    params = init()
    server = make(anchor_steps=0).server_init(params)
    one = {k: v.unsqueeze(0) for k, v in server["learner"].items()}
    cls = {k: params[k].unsqueeze(0) for k in ("cls.weight", "cls.bias")}
    full = make().anchor_loss(one, cls)
    ace = make(use_sep=False).anchor_loss(one, cls)
    sep = separation_loss(make().anchors_of(one), 0.1)
    assert torch.allclose(full - ace, 0.4 * sep, atol=1e-14)


def test_clients_use_the_broadcast_anchors_as_hand_computed():
    """One full batch: the reported loss is L_CE + λ·L_COM at the start model (taken before
    the one step; lr > 0 is the contract's range). Perturbing the broadcast anchors changes it
    by λ·ΔL_COM, recomputed row by row here:
        com = mean_rows(-log(exp(a_y·h/τ) / Σ_j exp(a_j·h/τ)))"""
    alg = make(lr=1e-9, local_epochs=1, batch_size=64)
    params = init()
    server = alg.server_init(params)
    data = cohort()
    h = MODEL.embed(expand(params, 2), data.x)

    def com(anchors, c):
        rows = []
        for r in range(int(data.count[c])):
            s = [math.exp(float(anchors[j] @ h[c, r]) / 0.1) for j in range(3)]
            rows.append(-math.log(s[int(data.y[c, r, 0])] / sum(s)))
        return sum(rows) / len(rows)

    def reported(anchors):
        down = expand({"model": params, "anchors": anchors}, 2)
        return alg.client_update(down, {}, data).metrics["train_loss"]

    other = torch.nn.functional.normalize(
        server["anchors"] + torch.tensor([0.5, -1.0, 0, 2]), dim=1
    )
    delta = reported(other) - reported(server["anchors"])
    hand = [0.5 * (com(other, c) - com(server["anchors"], c)) for c in range(2)]
    assert delta.tolist() == pytest.approx(hand, abs=1e-12)
    assert min(abs(d) for d in hand) > 1e-3  # the perturbation matters
    # The server state's own anchors are not read by clients: only the broadcast is.
    assert set(alg.broadcast(server)) == {"model", "anchors"}


def test_client_step_matches_autograd_of_the_written_out_loss():
    """One SGD step (lr 0.1, no momentum, full batch) = params − 0.1·∇(L_CE + λ·L_COM)."""
    alg = make(lr=0.1, momentum=0.0, local_epochs=1, batch_size=64)
    params = init()
    anchors = alg.server_init(params)["anchors"]
    data = cohort(counts=(9,))
    data = ClientData(data.x, data.y, data.count, (11,))
    out = alg.client_update(expand({"model": params, "anchors": anchors}, 1), {}, data)
    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    one = {k: v.unsqueeze(0) for k, v in live.items()}
    h = MODEL.embed(one, data.x)[0]
    y = data.y[0, :, 0].long()
    loss = F.cross_entropy(MODEL.classify(one, h.unsqueeze(0))[0], y) + 0.5 * F.cross_entropy(
        h @ anchors.T / 0.1, y
    )
    grads = torch.autograd.grad(loss, list(live.values()))
    for (k, v), g in zip(params.items(), grads, strict=True):
        assert torch.allclose(out.reply["model"][k][0], v - 0.1 * g, atol=1e-13), k


def test_without_compactness_the_client_update_is_fedavgs_exactly():
    kw = dict(lr=0.01, momentum=0.9, batch_size=4, local_epochs=2)
    alg = make(use_com=False, **kw)
    fedavg = FedAvg(ClassificationTask(MODEL), **kw)
    params = init()
    server = alg.server_init(params)
    data = cohort()
    ours = alg.client_update(expand(alg.broadcast(server), 2), {}, data)
    theirs = fedavg.client_update(expand({"model": params}, 2), {}, data)
    for k, v in flatten(theirs.reply).items():
        assert torch.equal(flatten(ours.reply)[k], v), k
    assert torch.equal(ours.metrics["train_loss"], theirs.metrics["train_loss"])
    assert torch.equal(
        alg.server_update(server, ours.reply, data.count)["anchors"], server["anchors"]
    )
    # ... while with L_COM (and trained anchors) it differs.
    with_com = make(**kw)
    full = with_com.client_update(
        expand(with_com.broadcast(with_com.server_init(params)), 2), {}, data
    )
    assert not torch.allclose(
        full.reply["model"]["enc0.weight"], ours.reply["model"]["enc0.weight"]
    )


def test_global_model_is_every_clients_model():
    alg = make()
    server = alg.server_init(init())
    down = expand(alg.broadcast(server), 2)
    personal = alg.personalize(down, {}, cohort())
    assert all(torch.equal(personal[k], down["model"][k]) for k in personal)


def test_tuning_the_global_classifier_moves_only_the_classifier():
    params = init()
    fixed = make(anchor_steps=20).server_init(params)
    tuned = make(anchor_steps=20, tune_global_classifier=True).server_init(params)
    assert torch.equal(fixed["model"]["cls.weight"], params["cls.weight"])
    assert not torch.allclose(tuned["model"]["cls.weight"], params["cls.weight"])
    for k in params:
        if not k.startswith("cls."):
            assert torch.equal(tuned["model"][k], params[k])
    assert set(tuned["anchor_opt"]["exp_avg"]) == {*fixed["learner"], "cls.weight", "cls.bias"}

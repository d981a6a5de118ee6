"""FedProto (Tan et al., AAAI 2022): prototypes, aggregation, regularizer, private models."""

from __future__ import annotations

import math

import pytest
import torch

from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.fedproto import FedProto, aggregate_prototypes, local_prototypes
from fedcal.core.classification import ClassificationTask
from fedcal.core.data import ClientData
from fedcal.core.tree import expand, weighted_mean
from fedcal.models.classifier import HypersphereClassifier

D64 = torch.float64
MODEL = HypersphereClassifier(in_features=6, encoder=(7,), embed_dim=4, num_classes=3)


def make(**kw) -> FedProto:
    return FedProto(ClassificationTask(MODEL), **kw)


def init(seed=0):
    return MODEL.init(torch.Generator().manual_seed(seed), D64)


def cohort(counts=(9, 5), seed=0, labels=None) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    rows = max(counts)
    x = torch.randn(len(counts), rows, 6, generator=gen, dtype=D64)
    y = torch.randint(0, 3, (len(counts), rows, 1), generator=gen).to(D64)
    if labels is not None:
        y = labels.to(D64).reshape(len(counts), rows, 1)
    mask = torch.arange(rows).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
    return ClientData(
        x * mask.unsqueeze(-1), y * mask.unsqueeze(-1), torch.tensor(counts), (11, 12)
    )


def test_local_prototypes_hand_computed():
    """Client 0: h (1,0), (0,1) of class 0 and (1,1) of class 1; a padded row (w = 0) of class 2.
    → p0 = (.5, .5), p1 = (1, 1), p2 absent = (0, 0); counts (2, 1, 0).
    Client 1: one row (2, −2) of class 2 → p2 = (2, −2), counts (0, 0, 1)."""
    h = torch.tensor(
        [[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [9.0, 9.0]], [[2.0, -2.0], [0, 0], [0, 0], [0, 0]]]
    )
    labels = torch.tensor([[0, 0, 1, 2], [2, 0, 0, 0]])
    w = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    protos, counts = local_prototypes(h, labels, w, 3)
    assert protos[0].tolist() == [[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]]
    assert protos[1].tolist() == [[0.0, 0.0], [0.0, 0.0], [2.0, -2.0]]
    assert counts.tolist() == [[2.0, 1.0, 0.0], [0.0, 0.0, 1.0]]


def test_aggregation_is_count_weighted_and_absent_classes_keep_their_old_value():
    """Class 0: client A (.5, .5) × 2, client B (2, −1) × 1 → ((1 + 2)/3, (1 − 1)/3) = (1, 0).
    Class 1: only A (1, 1) × 1 → (1, 1) (B's zero placeholder carries no weight).
    Class 2: nobody → previous (7, 7) kept; known stays as it was (0)."""
    protos = torch.tensor([[[0.5, 0.5], [1.0, 1.0], [0.0, 0.0]], [[2.0, -1.0], [0.0, 0.0], [0, 0]]])
    counts = torch.tensor([[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    previous = torch.tensor([[0.0, 0.0], [0.0, 0.0], [7.0, 7.0]])
    new, known = aggregate_prototypes(protos, counts, previous, torch.zeros(3))
    assert new.tolist() == [[1.0, 0.0], [1.0, 1.0], [7.0, 7.0]]
    assert known.tolist() == [1.0, 1.0, 0.0]
    # Once known, a class stays known when absent from a round.
    _, known = aggregate_prototypes(protos, counts * torch.tensor([1.0, 0, 0]), new, known)
    assert known.tolist() == [1.0, 1.0, 0.0]


def test_server_prototype_is_the_mean_embedding_of_the_class_over_all_clients():
    alg = make(local_epochs=1, batch_size=4)
    params = init()
    server = alg.server_init(params)
    data = cohort()
    result = alg.client_update(expand(server, 2), alg.client_init(expand(server, 2)), data)
    new = alg.server_update(server, result.reply, data.count)
    trained = result.state["model"]
    h = MODEL.embed(trained, data.x)
    for c in range(3):
        rows = [
            h[i, r] for i in range(2) for r in range(int(data.count[i])) if data.y[i, r, 0] == c
        ]
        assert torch.allclose(new["protos"][c], torch.stack(rows).mean(0), atol=1e-14)


def test_first_round_without_prototypes_is_plain_local_training():
    """No global prototype yet: the regularizer is 0 and the step is FedAvg's client step."""
    kw = dict(lr=0.05, momentum=0.9, batch_size=4, local_epochs=2)
    alg = make(**kw)
    server = alg.server_init(init())
    down = expand(alg.broadcast(server), 2)
    ours = alg.client_update(down, alg.client_init(down), cohort())
    theirs = FedAvg(ClassificationTask(MODEL), **kw).client_update(
        expand({"model": server["model"]}, 2), {}, cohort()
    )
    for k, v in theirs.reply["model"].items():
        assert torch.equal(ours.state["model"][k], v), k


def test_regularizer_hand_computed():
    """lr = 0, one full batch: reported loss − CE = λ·mean_rows known_y·‖h − C̄_y‖²/L,
    recomputed row by row: sum((h[r][d] - P[y][d])**2 for d in range(4)) / 4.
    Class 2 has no global prototype: its rows add nothing."""
    protos = torch.tensor([[0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    known = torch.tensor([1.0, 1.0, 0.0])
    params = init()
    data = cohort(counts=(9, 5))
    h = MODEL.embed(expand(params, 2), data.x)

    def reported(lam):
        alg = make(lr=1e-9, local_epochs=1, batch_size=64, lam=lam)  # loss before the step
        down = expand({"model": params, "protos": protos.to(D64), "known": known.to(D64)}, 2)
        return alg.client_update(down, {"model": down["model"]}, data).metrics["train_loss"]

    hand = []
    for c in range(2):
        n = int(data.count[c])
        total = 0.0
        for r in range(n):
            y = int(data.y[c, r, 0])
            if known[y]:
                total += sum((float(h[c, r, d]) - float(protos[y, d])) ** 2 for d in range(4)) / 4
        hand.append(2.5 * total / n)
    assert (reported(2.5) - reported(0.0)).tolist() == pytest.approx(hand, abs=1e-12)
    assert min(hand) > 0 and math.isfinite(sum(hand))


def test_models_stay_private_and_personal():
    alg = make(local_epochs=1, batch_size=4)
    server = alg.server_init(init())
    down = expand(alg.broadcast(server), 2)
    result = alg.client_update(down, alg.client_init(down), cohort())
    assert set(result.reply) == {"protos", "counts"}  # no model leaves a client
    new = alg.server_update(server, result.reply, torch.tensor([9, 5]))
    assert all(torch.equal(new["model"][k], server["model"][k]) for k in server["model"])
    # Round 2 starts from each client's own model, and that model is its personal one.
    second = alg.client_update(expand(alg.broadcast(new), 2), result.state, cohort(seed=1)).state[
        "model"
    ]
    personal = alg.personalize(expand(alg.broadcast(new), 2), {"model": second}, cohort())
    assert all(torch.equal(personal[k], second[k]) for k in second)
    assert not torch.allclose(second["cls.weight"][0], second["cls.weight"][1])


def test_shared_model_variant_averages_models_like_fedavg():
    alg = make(local_epochs=1, batch_size=4, share_model=True)
    server = alg.server_init(init())
    down = expand(alg.broadcast(server), 2)
    result = alg.client_update(down, alg.client_init(down), cohort())
    assert alg.client_init(down) == {} and result.state == {}
    new = alg.server_update(server, result.reply, torch.tensor([9, 5]))
    mean = weighted_mean(result.reply["model"], torch.tensor([9.0, 5.0], dtype=D64))
    assert all(torch.allclose(new["model"][k], mean[k], atol=1e-14) for k in mean)
    personal = alg.personalize(expand(alg.broadcast(new), 2), {}, cohort())
    assert torch.equal(personal["cls.weight"][1], new["model"]["cls.weight"])

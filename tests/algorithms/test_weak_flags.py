"""Status "weak" for linear-in-parameters methods beyond fedprior and leastsq (issue 20):
fedpoly's private terms and FedGMI's Bayesian head, on planted fleets."""

from __future__ import annotations

import torch

from fedcal.algorithms.fedgmi import FedGMI, head_design
from fedcal.algorithms.fedpoly import FedPoly, legendre_design
from fedcal.core.data import ClientData
from fedcal.core.identify import unlearned_directions, unlearned_share
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.mlp import MLP
from fedcal_support.rounds import run_rounds

F64 = torch.float64


def _fleet(xs: torch.Tensor, seed: int = 0) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    c, n, _ = xs.shape
    y = torch.sin(xs @ torch.tensor([1.3, -0.7], dtype=F64)).unsqueeze(-1)
    y = y + 0.01 * torch.randn(c, n, 1, generator=gen, dtype=F64)
    return ClientData(xs, y, torch.full((c,), n), tuple(range(c)))


def test_fedpoly_six_point_units_with_seven_private_terms_are_weak():
    """Units 0–3 on a 3 × 2 grid (6 points, 2 temperatures): the default 7 private terms have
    an undetermined direction (T² is affine in T on two temperatures; 7 terms > 6 points),
    which the private design at off-grid inputs loads on → weak. Units 4–7 with 20 random
    points: none. fedpoly_p3's 3 private terms (1, f, T) are determined on the grid."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[f, t] for f in (-0.8, 0.0, 0.8) for t in (-0.6, 0.6)], dtype=F64)
    many = torch.rand(8, 20, 2, generator=gen, dtype=F64) * 2 - 1
    many[:4, :6] = grid  # units 0-3: the grid, then padding
    data = _fleet(many)
    data = ClientData(data.x, data.y, torch.tensor([6] * 4 + [20] * 4), data.seeds)  # padded
    test_x = torch.rand(8, 30, 2, generator=gen, dtype=F64) * 2 - 1
    for alg, weak in (
        (FedPoly(Task(MLP())), [True] * 4 + [False] * 4),
        (FedPoly(Task(MLP()), private_terms=((0, 0), (1, 0), (0, 1))), [False] * 8),
    ):
        server, _, personal, _ = run_rounds(alg, data, 1)
        flags = alg.client_status(server, personal, test_x, torch.ones(8, 30))
        assert flags["weak"].tolist() == weak
    # the projector's directions are exactly what the grid units' private design cannot see
    alg = FedPoly(Task(MLP()))
    personal = run_rounds(alg, data, 1)[2]
    design = legendre_design(data.x[:4, :6], alg.private_terms)
    assert torch.allclose(design @ personal["null"][:4], torch.zeros(4, 6, 7, dtype=F64), atol=1e-6)
    assert [round(float(torch.trace(p))) for p in personal["null"]] == [1] * 4 + [0] * 4


def _bayes_head(data: ClientData, rounds: int = 10):
    """FedGMI's Bayesian head on a frozen tanh body of 3 features (head: 3 weights + bias)."""
    alg = FedGMI(
        Task(MLP(hidden=(3,), activation="tanh")),
        interpolation="posterior",
        evaluate="global_body",
        local_epochs=0,
    )
    c = data.num_clients
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(1), F64))
    states = alg.client_init(expand(alg.broadcast(server), c))
    for _ in range(rounds):
        result = alg.client_update(expand(alg.broadcast(server), c), states, data)
        states = result.state
        server = alg.server_update(server, result.reply, data.count)
    return alg, server, alg.personalize(expand(alg.broadcast(server), c), states, data)


def test_bayes_head_is_weak_where_no_two_units_determine_a_head_direction():
    """6 units of 20 random points determine every head direction (support eigenvalues ≥ 2):
    none weak. The same 6 units each read 20 times at one input: every unit's Gram has rank 1,
    three head directions are seen by fewer than 2 units, keep the vague start and carry most
    of the σ² at random inputs → every unit weak."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 20, 2, generator=gen, dtype=F64) * 2 - 1
    test_x = torch.rand(6, 30, 2, generator=gen, dtype=F64) * 2 - 1
    alg, server, personal = _bayes_head(_fleet(x))
    assert float(torch.linalg.eigvalsh(server["head_support"])[0]) >= 2.0
    flags = alg.client_status(server, personal, test_x, torch.ones(6, 30))
    assert flags["weak"].tolist() == [False] * 6
    one = x[:, :1].expand(6, 20, 2).clone()
    alg, server, personal = _bayes_head(_fleet(one))
    assert int((torch.linalg.eigvalsh(server["head_support"]) < 2.0).sum()) == 3
    flags = alg.client_status(server, personal, test_x, torch.ones(6, 30))
    assert flags["weak"].tolist() == [True] * 6
    # inputs in another dtype than the body's (the run passes float64): the same flags
    flags32 = alg.client_status(server, personal, test_x.float(), torch.ones(6, 30))
    assert flags32["weak"].tolist() == [True] * 6


def test_bayes_head_counts_only_the_units_its_prior_was_learned_from():
    """Units 0–2 (20 random points each) would determine every head direction, but the server
    takes only units 3–5's replies (each read at one input), as when screening rejects 0–2:
    its summed support is theirs alone, and units 3–5 are weak."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(6, 20, 2, generator=gen, dtype=F64) * 2 - 1
    x[3:] = x[3:, :1].expand(3, 20, 2)
    data = _fleet(x)
    alg = FedGMI(
        Task(MLP(hidden=(3,), activation="tanh")),
        interpolation="posterior",
        evaluate="global_body",
        local_epochs=0,
    )
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(1), F64))
    states = alg.client_init(expand(alg.broadcast(server), 6))
    kept = torch.tensor([3, 4, 5])
    for _ in range(10):
        result = alg.client_update(expand(alg.broadcast(server), 6), states, data)
        states = result.state
        reply = {
            k: (
                v.index_select(0, kept)
                if k != "model"
                else {n: t.index_select(0, kept) for n, t in v.items()}
            )
            for k, v in result.reply.items()
        }
        server = alg.server_update(server, reply, data.count.index_select(0, kept))
    personal = alg.personalize(expand(alg.broadcast(server), 6), states, data)
    assert int((torch.linalg.eigvalsh(server["head_support"]) < 2.0).sum()) == 3
    test_x = torch.rand(6, 30, 2, generator=gen, dtype=F64) * 2 - 1
    flags = alg.client_status(server, personal, test_x, torch.ones(6, 30))
    assert flags["weak"][3:].tolist() == [True] * 3


def test_bayes_head_units_whose_points_determine_their_predictions_are_not_weak():
    """Units 0–3: 100 points in a narrow box |f|, |T| ≤ 0.3 of targets the frozen 16-feature
    body fits (σ² ≈ 1e-8); units 4–7: 6 points over the whole square. 5 head directions stay
    unlearned (support < 2), and V_i of a data-rich unit is vague along them, but its
    points determine φᵀc in the box: knowing the unlearned coordinates removes < 1 % of its
    predictive variance there, so none is weak. The projection (φᵀW)(WᵀV_iW)(Wᵀφ) (the
    rule's first form) was 27 × the whole predictive variance and flagged units 0–3 (as it
    flagged the mixed fleet's 384-point reference units, docs/statuses.md)."""
    gen = torch.Generator().manual_seed(0)
    c = 8
    alg = FedGMI(
        Task(MLP(hidden=(16,), activation="tanh")),
        interpolation="posterior",
        evaluate="global_body",
        local_epochs=0,
    )
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(1), F64))
    x = (torch.rand(c, 100, 2, generator=gen, dtype=F64) * 2 - 1) * 0.3
    x[4:, :6] = torch.rand(4, 6, 2, generator=gen, dtype=F64) * 2 - 1
    phi = head_design(alg.task, expand(server["model"], c), x)
    heads = torch.randn(17, generator=gen, dtype=F64) + 0.3 * torch.randn(
        c, 17, generator=gen, dtype=F64
    )
    y = (phi * heads.unsqueeze(1)).sum(-1) + 1e-4 * torch.randn(c, 100, generator=gen, dtype=F64)
    data = ClientData(x, y.unsqueeze(-1), torch.tensor([100] * 4 + [6] * 4), tuple(range(c)))
    states = alg.client_init(expand(alg.broadcast(server), c))
    for _ in range(10):
        result = alg.client_update(expand(alg.broadcast(server), c), states, data)
        states = result.state
        server = alg.server_update(server, result.reply, data.count)
    personal = alg.personalize(expand(alg.broadcast(server), c), states, data)
    test_x = (torch.rand(c, 30, 2, generator=gen, dtype=F64) * 2 - 1) * 0.3
    weak = unlearned_directions(server["head_support"], 2.0)
    assert weak.shape[1] == 5
    flags = alg.client_status(server, personal, test_x, torch.ones(c, 30))
    assert flags["weak"].tolist() == [False] * c
    design = head_design(alg.task, personal, test_x)
    share = unlearned_share(
        design, personal["head_cov"], personal["noise_var"], weak, torch.ones(c, 30)
    )
    assert bool((share >= 0).all()) and bool((share[:4] < 0.01).all())

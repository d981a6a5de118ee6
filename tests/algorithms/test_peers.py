"""The peers of FedGMI, each against its defining property.

centralized(_ft), fedavg_ft, fedper, fedrep, fedala, ditto, apfl:
limiting cases that reduce a method to a known one, hand-computed updates,
and independent reference computations (a plain autograd SGD loop); the
per-sensor polynomial is tested in ``test_polynomial.py``.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcal.algorithms.apfl import APFL
from fedcal.algorithms.centralized import Centralized, CentralizedFinetune
from fedcal.algorithms.ditto import Ditto
from fedcal.algorithms.fedala import FedALA
from fedcal.algorithms.fedavg import FedAvg
from fedcal.algorithms.fedavg_ft import FedAvgFinetune
from fedcal.algorithms.fedper import FedPer
from fedcal.algorithms.fedrep import FedRep
from fedcal.core.data import _generator, client_round_seed
from fedcal.core.task import Task
from fedcal.core.tree import drop, expand, flatten, select, sq_norm, sub, tree_map
from fedcal.engine.simulation import prepare
from fedcal.models.mlp import MLP

F64 = torch.float64


def cohort(make_fleet, clients=3, train=None, seed=0, round_index=0):
    fleet = prepare(make_fleet(num_clients=clients, train=train or 24, seed=seed), dtype="float64")
    seeds = tuple(client_round_seed(0, round_index, c) for c in range(clients))
    return fleet.train.with_seeds(seeds)


def start(alg, clients):
    params = alg.task.model.init(torch.Generator().manual_seed(0), F64)
    server = alg.server_init(params)
    down = expand(alg.broadcast(server), clients)
    return server, down, alg.client_init(down)


def assert_close(a, b, atol=1e-12):
    fa, fb = flatten(a), flatten(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert torch.allclose(fa[k], fb[k], rtol=0, atol=atol), k


def differ(a, b, keys):
    return all(not torch.allclose(a[k], b[k]) for k in keys)


TASK = Task(MLP(hidden=(6, 5)))
RECIPE = {"lr": 0.05, "local_epochs": 2, "batch_size": 8}


# ---- centralized --------------------------------------------------------------
def test_centralized_equals_a_plain_sgd_loop_over_the_sorted_pool(make_fleet):
    data = cohort(make_fleet, clients=3, train=[11, 6, 9])
    alg = Centralized(TASK, lr=0.1, local_epochs=2, batch_size=4)
    server, down, state = start(alg, 3)
    result = alg.client_update(down, state, data)
    new = alg.server_update(server, result.reply, data.count)

    # Independent reference: numpy pooling and lexicographic sort, then SGD by autograd.
    rows = [
        np.hstack([data.x[c, :n].numpy(), data.y[c, :n].numpy()]) for c, n in enumerate([11, 6, 9])
    ]
    pooled = np.vstack(rows)
    pooled = pooled[np.lexsort(pooled.T[::-1])]  # column 0 is the primary key
    x, y = torch.as_tensor(pooled[:, :2]), torch.as_tensor(pooled[:, 2:])
    ordered = sorted(data.seeds)
    seed = int(np.random.SeedSequence(ordered).generate_state(1, dtype=np.uint64)[0] >> 1)
    gen = _generator(seed, 0)
    params = {k: v.clone() for k, v in server["model"].items()}
    for _ in range(2):
        perm = torch.randperm(len(x), generator=gen)
        for b in range(0, len(x), 4):
            idx = perm[b : b + 4]
            live = {k: v.unsqueeze(0).requires_grad_() for k, v in params.items()}
            loss = (TASK.model.apply(live, x[idx].unsqueeze(0)) - y[idx]).pow(2).mean()
            grads = torch.autograd.grad(loss, list(live.values()))
            params = {k: params[k] - 0.1 * g[0] for k, g in zip(live, grads, strict=True)}
    assert_close(new["model"], params, atol=1e-10)
    # Every client uses the global model; the upload is the data itself.
    personal = alg.personalize(expand(new, 3), {}, data)
    assert_close(personal, expand(new["model"], 3), atol=0)
    assert torch.equal(result.reply["x"], data.x) and torch.equal(result.reply["y"], data.y)


def test_centralized_ft_fine_tunes_each_client_from_the_global_model(make_fleet):
    data = cohort(make_fleet)
    plain = CentralizedFinetune(TASK, **RECIPE, finetune_epochs=0)
    tuned = CentralizedFinetune(TASK, **RECIPE, finetune_epochs=3)
    _, down, state = start(plain, 3)
    assert_close(plain.personalize(down, state, data), down["model"], atol=0)
    expected = FedAvg(TASK, **RECIPE).local_train(down["model"], data, epochs=3)[0]
    assert_close(tuned.personalize(down, state, data), expected, atol=0)


# ---- fedavg_ft ----------------------------------------------------------------
def test_fedavg_ft_with_no_fine_tuning_is_fedavg(make_fleet):
    data = cohort(make_fleet)
    ft = FedAvgFinetune(TASK, **RECIPE, finetune_epochs=0)
    avg = FedAvg(TASK, **RECIPE)
    _, down, state = start(ft, 3)
    a, b = ft.client_update(down, state, data), avg.client_update(down, state, data)
    assert_close(a.reply, b.reply, atol=0)
    assert_close(ft.personalize(down, state, data), avg.personalize(down, state, data), atol=0)


def test_fedavg_ft_head_mode_moves_only_the_head(make_fleet):
    data = cohort(make_fleet)
    alg = FedAvgFinetune(TASK, **RECIPE, finetune_epochs=2, finetune="head")
    _, down, state = start(alg, 3)
    personal = alg.personalize(down, state, data)
    assert_close(drop(personal, TASK.head), drop(down["model"], TASK.head), atol=0)
    assert differ(personal, down["model"], TASK.head)


# ---- FedPer / FedRep ------------------------------------------------------------
def test_fedper_never_averages_the_head(make_fleet):
    data = cohort(make_fleet)
    alg = FedPer(TASK, **RECIPE)
    server, down, state = start(alg, 3)
    result = alg.client_update(down, state, data)
    assert set(result.reply["model"]) == set(TASK.body)  # only the body leaves the client
    new = alg.server_update(server, result.reply, data.count)
    assert_close(select(new["model"], TASK.head), select(server["model"], TASK.head), atol=0)
    body_mean = tree_map(lambda t: t.mean(0), result.reply["model"])
    assert_close(drop(new["model"], TASK.head), body_mean)
    heads = result.state["head"]["l2.weight"]
    assert not torch.allclose(heads[0], heads[1]) and not torch.allclose(heads[1], heads[2])
    # The personal model is (new global body, own head).
    personal = alg.personalize(expand(new, 3), result.state, data)
    assert_close(select(personal, TASK.head), result.state["head"], atol=0)
    assert_close(drop(personal, TASK.head), expand(drop(new["model"], TASK.head), 3), atol=0)
    # Next round starts from the client's own head, not the server's.
    again = alg.client_update(expand(new, 3), result.state, data)
    restart = alg.client_update(expand(new, 3), alg.client_init(expand(new, 3)), data)
    assert differ(again.state["head"], restart.state["head"], TASK.head)


def test_fedrep_freezes_the_body_during_head_epochs_and_vice_versa(make_fleet):
    data = cohort(make_fleet)
    _, down, state = start(FedRep(TASK), 3)
    body0 = drop(down["model"], TASK.head)
    head_only = FedRep(TASK, **RECIPE, head_epochs=3, body_epochs=0).client_update(
        down, state, data
    )
    assert_close(head_only.reply["model"], body0, atol=0)  # body untouched
    assert differ(head_only.state["head"], state["head"], TASK.head)
    body_only = FedRep(TASK, **RECIPE, head_epochs=0, body_epochs=2).client_update(
        down, state, data
    )
    assert_close(body_only.state["head"], state["head"], atol=0)  # head untouched
    assert differ(body_only.reply["model"], body0, TASK.body)
    # Both phases = head phase (body frozen at ω^t), then body phase from the new head.
    both = FedRep(TASK, **RECIPE, head_epochs=3, body_epochs=2).client_update(down, state, data)
    assert_close(both.state["head"], head_only.state["head"], atol=0)
    then_body = FedRep(TASK, **RECIPE, head_epochs=0, body_epochs=2).client_update(
        down, head_only.state, data
    )
    assert_close(both.reply["model"], then_body.reply["model"], atol=0)
    assert set(both.reply["model"]) == set(TASK.body)
    # evaluate="refit": the stored head re-trained on the current body, as a head phase.
    refit = FedRep(TASK, **RECIPE, head_epochs=3, evaluate="refit").personalize(down, state, data)
    assert_close(select(refit, TASK.head), head_only.state["head"], atol=0)
    assert_close(drop(refit, TASK.head), body0, atol=0)


# ---- Ditto ----------------------------------------------------------------------
def test_ditto_with_a_large_lambda_solves_the_proximal_problem_near_w(make_fleet):
    """Full batch, λ = 500, lr·λ = 0.5: v converges to argmin F(v) + λ/2‖v − w‖², whose
    stationarity condition is ∇F(v) + λ(v − w) = 0, hence ‖v − w‖ = ‖∇F(v)‖/λ."""
    data = cohort(make_fleet)
    lam = 500.0
    alg = Ditto(TASK, lr=1e-3, local_epochs=1, batch_size=64, lam=lam, personal_epochs=80)
    _, down, state = start(alg, 3)
    w = down["model"]
    v = alg.client_update(down, state, data).state["personal"]
    _, grad = TASK.value_and_grad(v, data.x, data.y, data.mask)
    stationarity = sq_norm(tree_map(lambda g, a, b: g + lam * (a - b), grad, v, w)).sqrt()
    assert stationarity.max() < 1e-10
    gap = sq_norm(sub(v, w)).sqrt()
    assert torch.allclose(gap, sq_norm(grad).sqrt() / lam, rtol=1e-6)
    free = Ditto(TASK, lr=1e-3, local_epochs=1, batch_size=64, lam=0.0, personal_epochs=80)
    assert (
        gap < 0.05 * sq_norm(sub(free.client_update(down, state, data).state["personal"], w)).sqrt()
    ).all()


def test_ditto_with_zero_lambda_is_local_training(make_fleet):
    data = cohort(make_fleet)
    alg = Ditto(TASK, **RECIPE, lam=0.0, personal_epochs=3)
    server, down, state = start(alg, 3)
    other = expand(tree_map(lambda t: t + 0.3, server["model"]), 3)
    a = alg.client_update(down, state, data).state["personal"]
    b = alg.client_update({"model": other}, state, data).state["personal"]
    assert_close(a, b, atol=0)  # v does not see w
    local = FedAvg(TASK, **RECIPE).local_train(state["personal"], data, epochs=3, stream=1)[0]
    assert_close(a, local, atol=0)
    # The global model is FedAvg's.
    fedavg = FedAvg(TASK, **RECIPE).client_update(down, {}, data)
    assert_close(alg.client_update(down, state, data).reply, fedavg.reply, atol=0)


# ---- APFL -----------------------------------------------------------------------
def test_apfl_with_alpha_fixed_at_zero_is_fedavg(make_fleet):
    data = cohort(make_fleet)
    alg = APFL(TASK, **RECIPE, alpha_init=0.0, alpha_lr=0.0)
    server, down, state = start(alg, 3)
    result = alg.client_update(down, state, data)
    fedavg = FedAvg(TASK, **RECIPE).client_update(down, {}, data)
    assert_close(result.reply, fedavg.reply, atol=1e-13)
    new = alg.server_update(server, result.reply, data.count)
    personal = alg.personalize(expand(new, 3), result.state, data)
    assert_close(personal, expand(new["model"], 3), atol=0)


def test_apfl_one_step_matches_autograd_of_the_mixed_loss(make_fleet):
    """One full-batch step: v ← v − η·∂L(v̄)/∂v, α ← α − η_α·∂L(v̄)/∂α, v̄ = αv + (1−α)w."""
    data = cohort(make_fleet, clients=1)
    alg = APFL(TASK, lr=0.05, local_epochs=1, batch_size=64, alpha_init=0.3, alpha_lr=0.7)
    _, down, state = start(alg, 1)
    v0 = tree_map(
        lambda t: t + 0.1 * torch.sin(torch.arange(t.numel(), dtype=F64)).view_as(t), down["model"]
    )
    result = alg.client_update(down, {"personal": v0, "alpha": state["alpha"]}, data)
    live_v = {k: t.clone().requires_grad_() for k, t in v0.items()}
    live_a = torch.tensor([0.3], dtype=F64, requires_grad=True)
    mixed = {
        k: live_a.view(1, *[1] * (t.dim() - 1)) * live_v[k]
        + (1 - live_a.view(1, *[1] * (t.dim() - 1))) * down["model"][k]
        for k, t in v0.items()
    }
    loss = (TASK.model.apply(mixed, data.x) - data.y).pow(2).mean()
    grads = torch.autograd.grad(loss, [*live_v.values(), live_a])
    expected_v = {k: v0[k] - 0.05 * g for k, g in zip(v0, grads[:-1], strict=True)}
    assert_close(result.state["personal"], expected_v, atol=1e-12)
    assert torch.allclose(result.state["alpha"], (0.3 - 0.7 * grads[-1]).clamp(0, 1), atol=1e-12)


# ---- FedALA ---------------------------------------------------------------------
def fedala_setup(make_fleet, clients=3, **kw):
    data = cohort(make_fleet, clients=clients)
    alg = FedALA(TASK, **{**RECIPE, **kw})
    _, down, state = start(alg, clients)
    local = tree_map(
        lambda t: t + 0.2 * torch.cos(torch.arange(t[0].numel(), dtype=F64)).view_as(t[0]),
        down["model"],
    )
    return alg, data, down, {**state, "model": local}


def test_fedala_weights_of_one_take_the_global_model(make_fleet):
    """W ≡ 1 (η = 0 keeps the initial ones): θ̂ = θ_i + (θ − θ_i)·1 = θ, so FedALA = FedAvg."""
    alg, data, down, state = fedala_setup(make_fleet, eta=0.0)
    result = alg.client_update(down, state, data)
    fedavg = FedAvg(TASK, **RECIPE).client_update(down, {}, data)
    assert_close(result.reply, fedavg.reply, atol=1e-13)


def test_fedala_weights_of_zero_keep_the_local_top_layers(make_fleet):
    """W ≡ 0: the top layer keeps the local model, the lower layers take the global."""
    alg, data, down, state = fedala_setup(make_fleet, eta=0.0)
    state = {**state, "weights": tree_map(torch.zeros_like, state["weights"])}
    start_model, *_ = alg.adaptive_local_aggregation(down, state, data)
    assert alg.top == TASK.head
    assert_close(select(start_model, alg.top), select(state["model"], alg.top), atol=0)
    assert_close(drop(start_model, alg.top), drop(down["model"], alg.top), atol=0)


def test_fedala_one_weight_step_by_hand(make_fleet):
    """One client, all rows in one batch, past its start phase: one step of eq. 6 at W = 1."""
    alg, data, down, state = fedala_setup(
        make_fleet, clients=1, rand_percent=100, batch_size=64, eta=0.8
    )
    state = {**state, "started": torch.ones(1, dtype=F64)}
    _, weights, _, epochs = alg.adaptive_local_aggregation(down, state, data)
    assert epochs.tolist() == [1.0]
    live = {k: t.clone().requires_grad_(k in alg.top) for k, t in down["model"].items()}
    loss = (TASK.model.apply(live, data.x) - data.y).pow(2).mean()
    grads = torch.autograd.grad(loss, [live[k] for k in alg.top])
    for k, g in zip(alg.top, grads, strict=True):
        delta = down["model"][k] - state["model"][k]
        assert torch.allclose(weights[k], (1 - 0.8 * g * delta).clamp(0, 1), atol=1e-12)


def test_fedala_start_phase_runs_until_the_losses_settle(make_fleet):
    kw = {"num_pre_loss": 3, "max_start_epochs": 7, "batch_size": 8}
    alg, data, down, state = fedala_setup(make_fleet, threshold=1e9, **kw)
    # Local = global (the first round): ALA idles and the start phase is not consumed.
    fresh = alg.client_init(down)
    _, w, started, epochs = alg.adaptive_local_aggregation(down, fresh, data)
    assert epochs.tolist() == [0.0] * 3 and started.tolist() == [0.0] * 3
    assert_close(w, fresh["weights"], atol=0)
    # First round with a differing local model: num_pre_loss + 1 epochs satisfy any threshold.
    _, w, started, epochs = alg.adaptive_local_aggregation(down, state, data)
    assert epochs.tolist() == [4.0] * 3 and started.tolist() == [1.0] * 3
    # An unreachable threshold runs the whole budget; afterwards one epoch per round.
    never = FedALA(TASK, **{**RECIPE, **kw, "threshold": 0.0})
    assert never.adaptive_local_aggregation(down, state, data)[3].tolist() == [7.0] * 3
    later = {**state, "weights": w, "started": started}
    assert never.adaptive_local_aggregation(down, later, data)[3].tolist() == [1.0] * 3

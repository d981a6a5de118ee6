"""FedGMI against hand-computed numbers and the invariants of its seed (alg. 3.1–3.3)."""

import pytest
import torch

from fedcal.algorithms.fedgmi import FedGMI, interpolate, interpolation_weights
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand, select
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.models.mlp import MLP


def test_alpha_and_phi_hat_hand_computed():
    """g_g = [3, 4] → L_g = 5, ĝ_g = [.6, .8]; g_i = [1, 0] → ĝ_i = [1, 0];
    α = 1 − ĝ_i/(ĝ_i + ĝ_g) = [1 − 1/1.6, 1 − 0/.8] = [.375, 1];
    φ_i = [2, 2], φ_g = [0, 4] → φ̂ = [.375·2 + .625·0, 1·2] = [.75, 2]."""
    g_g = {"w": torch.tensor([[3.0, 4.0]], dtype=torch.float64)}
    g_i = {"w": torch.tensor([[1.0, 0.0]], dtype=torch.float64)}
    alpha = interpolation_weights(g_g, g_i, eps=0.0)
    assert torch.allclose(alpha["w"], torch.tensor([[0.375, 1.0]], dtype=torch.float64))
    phi = interpolate({"w": torch.tensor([[2.0, 2.0]])}, {"w": torch.tensor([[0.0, 4.0]])}, alpha)
    assert torch.allclose(phi["w"], torch.tensor([[0.75, 2.0]], dtype=torch.float64))


def test_norms_run_over_the_whole_head_and_per_client():
    """Two tensors in the head: L_g = ‖(3, 4, 0)‖ = 5 across both; client 2 has other numbers."""
    g_g = {"w": torch.tensor([[3.0, 4.0], [1.0, 0.0]]), "b": torch.tensor([[0.0], [0.0]])}
    g_i = {"w": torch.tensor([[0.0, 0.0], [0.0, 1.0]]), "b": torch.tensor([[2.0], [0.0]])}
    alpha = interpolation_weights(g_g, g_i, eps=0.0)
    # client 0: ĝ_g = (.6, .8, 0), ĝ_i = (0, 0, 1) → α = (1, 1, 0)
    assert alpha["w"][0].tolist() == [1.0, 1.0] and alpha["b"][0].tolist() == [0.0]
    # client 1: ĝ_g = (1, 0, 0), ĝ_i = (0, 1, 0) → α = (1, 0, 1 − 0/(0+0+ε)) = (1, 0, 1)
    assert alpha["w"][1].tolist() == [1.0, 0.0]


def test_dominant_magnitudes_pick_local_or_global():
    big, small = 1e3, 1e-3
    alpha = interpolation_weights(
        {"w": torch.tensor([[big, small]], dtype=torch.float64)},
        {"w": torch.tensor([[small, big]], dtype=torch.float64)},
    )
    # g_g ≫ g_i → keep local (α → 1); g_i ≫ g_g → take global (α → 0)
    assert alpha["w"][0, 0] > 0.999 and alpha["w"][0, 1] < 0.001


def test_zero_gradients_are_guarded():
    zero = {"w": torch.zeros(1, 3)}
    alpha = interpolation_weights(zero, zero)
    assert torch.all(alpha["w"] == 1.0)  # nothing to learn from: keep local


def test_per_tensor_ablation_gives_one_alpha_per_tensor():
    g_g = {"w": torch.tensor([[3.0, 4.0]]), "b": torch.tensor([[0.0]])}
    g_i = {"w": torch.tensor([[0.0, 0.0]]), "b": torch.tensor([[1.0]])}
    alpha = interpolation_weights(g_g, g_i, eps=0.0, per_tensor=True)
    assert alpha["w"].shape == (1,) and alpha["w"].item() == 1.0 and alpha["b"].item() == 0.0


def _tiny(head_layers=1, **kw):
    model = MLP(hidden=(4,), activation="tanh")
    return FedGMI(
        Task(model, head_layers=head_layers), lr=0.1, local_epochs=1, batch_size=4, **kw
    ), model


def _data(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(1, n, 1, generator=gen, dtype=torch.float64)
    return ClientData(x, y, torch.tensor([n]), (5,))


def test_start_head_matches_autograd_recomputation():
    """Steps 1–4 recomputed here with autograd on a tiny model, element by element."""
    alg, model = _tiny(finetune_steps=1, finetune_lr=0.3)
    gen = torch.Generator().manual_seed(3)
    g = expand(model.init(gen, torch.float64), 1)
    mine = {k: v + 0.2 for k, v in g.items()}
    data = _data()
    phi_hat, alpha = alg.start_head({"model": g}, {"model": mine}, data)

    def loss(params):
        return ((model.apply(params, data.x) - data.y) ** 2).mean()

    head = ["l1.weight", "l1.bias"]
    hybrid = {
        **{k: g[k] for k in g if k not in head},
        **{k: mine[k].clone().requires_grad_() for k in head},
    }
    grads = torch.autograd.grad(loss(hybrid), [hybrid[k] for k in head])
    phi_i = {k: hybrid[k].detach() - 0.3 * gr for k, gr in zip(head, grads, strict=True)}
    glob = {k: v.clone().requires_grad_() for k, v in g.items()}
    gg = torch.autograd.grad(loss(glob), [glob[k] for k in head])
    hyb2 = {
        **{k: g[k] for k in g if k not in head},
        **{k: phi_i[k].clone().requires_grad_() for k in head},
    }
    gi = torch.autograd.grad(loss(hyb2), [hyb2[k] for k in head])
    gg_flat = torch.cat([t.abs().flatten() for t in gg])
    gi_flat = torch.cat([t.abs().flatten() for t in gi])
    a = 1 - (gi_flat / gi_flat.norm()) / (
        gi_flat / gi_flat.norm() + gg_flat / gg_flat.norm() + 1e-8
    )
    expected = torch.cat([phi_i[k].flatten() for k in head]) * a + torch.cat(
        [g[k].flatten() for k in head]
    ) * (1 - a)
    got = torch.cat([phi_hat[k].flatten() for k in head])
    assert torch.allclose(got, expected, atol=1e-12)
    assert torch.allclose(torch.cat([alpha[k].flatten() for k in head]), a, atol=1e-12)


def test_server_aggregate_is_the_mean_of_uploads():
    alg, model = _tiny()
    replies = {
        "model": {
            k: torch.randn(3, *v.shape)
            for k, v in model.init(torch.Generator(), torch.float32).items()
        }
    }
    out = alg.server_update(
        {"model": {k: v[0] for k, v in replies["model"].items()}}, replies, torch.tensor([10, 1, 1])
    )
    for k, v in replies["model"].items():
        assert torch.allclose(out["model"][k], v.mean(0))  # plain mean: the seed's choice


def test_body_only_upload_keeps_the_global_head():
    alg, model = _tiny(upload="body")
    server = alg.server_init(model.init(torch.Generator().manual_seed(0), torch.float64))
    down = expand(server, 1)
    result = alg.client_update(down, alg.client_init(down), _data())
    assert set(result.reply["model"]) == {"l0.weight", "l0.bias"}
    new = alg.server_update(server, result.reply, torch.ones(1))
    assert torch.equal(new["model"]["l1.weight"], server["model"]["l1.weight"])
    assert torch.allclose(new["model"]["l0.weight"], result.reply["model"]["l0.weight"][0])


def test_private_head_persists_and_is_only_changed_through_interpolation(make_fleet):
    """Run 3 rounds; a client that sits out a round keeps its model bit for bit, and
    its next start head differs from the global head (it was not overwritten)."""
    fleet = prepare(make_fleet(num_clients=4), dtype="float64")
    alg = FedGMI(Task(MLP(hidden=(8, 8))), lr=0.05, local_epochs=1)
    seen = []
    config = EngineConfig(rounds=3, participation=0.5, seed=1, dtype="float64")
    res = simulate(alg, fleet, config, on_round=lambda t, s: seen.append(t))
    assert seen == [1, 2, 3]
    from fedcal.engine.simulation import cohort

    took_part = [set(cohort(1, t, 4, 0.5).tolist()) for t in range(3)]
    assert any(len(s) == 2 for s in took_part)
    # The personal model of a client equals its state (evaluate="local").
    for k in res.personal:
        assert torch.equal(res.personal[k], res.states["model"][k])
    # A client absent from the last round holds the model it trained earlier, not the global one.
    absent = sorted(set(range(4)) - took_part[2])
    head = alg.task.head
    for c in absent:
        assert not torch.allclose(
            select(res.states["model"], head)["l2.weight"][c], res.server["model"]["l2.weight"]
        )


@pytest.mark.parametrize("bad", [{"magnitude": "x"}, {"upload": "x"}, {"evaluate": "x"}])
def test_bad_switches_are_refused(bad):
    with pytest.raises(ValueError):
        FedGMI(Task(MLP()), **bad)


def test_joint_normalization_compares_magnitudes():
    """One norm L = √(25 + 1) for both: α = 1 − (1/L)/((1 + 3)/L) = 0.75 and 1 − 0 = 1;
    the seed's separate norms give 0.375 (see the first test)."""
    g_g = {"w": torch.tensor([[3.0, 4.0]], dtype=torch.float64)}
    g_i = {"w": torch.tensor([[1.0, 0.0]], dtype=torch.float64)}
    alpha = interpolation_weights(g_g, g_i, eps=0.0, joint=True)
    assert torch.allclose(alpha["w"], torch.tensor([[0.75, 1.0]], dtype=torch.float64))
    # a converged local head (tiny gradient) is kept whatever the gradients' directions
    tiny = {"w": torch.tensor([[1e-6, 1e-6]], dtype=torch.float64)}
    assert interpolation_weights(g_g, tiny, joint=True)["w"].min() > 0.999
    assert interpolation_weights(g_g, tiny)["w"].min() < 0.7


def test_alpha_is_recorded_per_round_for_the_clients_that_trained(make_fleet):
    fleet = prepare(make_fleet(num_clients=4), dtype="float64")
    alg = FedGMI(Task(MLP(hidden=(6,))), local_epochs=1)
    res = simulate(alg, fleet, EngineConfig(rounds=2, participation=0.5, seed=2, dtype="float64"))
    from fedcal.engine.simulation import cohort

    for row in res.history:
        took_part = row["client_index"] in cohort(2, row["round"] - 1, 4, 0.5).tolist()
        if took_part:
            assert 0.0 <= row["alpha_mean"] <= 1.0 and row["train_loss"] >= 0.0
        else:
            assert row["alpha_mean"] != row["alpha_mean"]  # NaN: sat this round out


@pytest.mark.parametrize("finetune_steps", [0, 2])
def test_start_head_from_shared_features_equals_the_three_full_passes(finetune_steps, monkeypatch):
    """The body's features computed once give the very numbers of fine-tuning and both
    gradient passes each running the whole model (a client without rows included)."""
    model = MLP(hidden=(6, 5))
    alg = FedGMI(Task(model), finetune_steps=finetune_steps, finetune_lr=0.2)
    gen = torch.Generator().manual_seed(8)
    arrays = [
        (torch.randn(n, 2, generator=gen).numpy(), torch.randn(n, 1, generator=gen).numpy())
        for n in (9, 4, 0)
    ]
    data = ClientData.from_arrays(arrays, seeds=(1, 2, 3))
    down = {"model": expand(model.init(gen, torch.float32), 3)}
    state = {"model": {k: v + 0.1 for k, v in down["model"].items()}}
    assert Task(model).head_input(down["model"], data.x) is not None  # the shared path runs
    shared = alg.start_head(down, state, data)
    monkeypatch.setattr(Task, "head_input", lambda self, params, x: None)
    passes = alg.start_head(down, state, data)
    for got, want in zip(shared, passes, strict=True):
        assert list(got) == list(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
    # The client without rows keeps its head through fine-tuning (its gradient is 0).
    if finetune_steps:
        monkeypatch.undo()
        tuned = FedGMI(Task(model), finetune_steps=2, finetune_lr=0.2, interpolate=False)
        phi_i = tuned.start_head(down, state, data)[0]
        assert torch.equal(phi_i["l2.weight"][2], state["model"]["l2.weight"][2])
        assert not torch.equal(phi_i["l2.weight"][0], state["model"]["l2.weight"][0])


def test_head_gradient_from_features_equals_the_whole_models():
    model = MLP(hidden=(7, 3))
    gen = torch.Generator().manual_seed(9)
    start = expand(model.init(gen), 2)
    params = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in start.items()}
    x, y = torch.randn(2, 11, 2, generator=gen), torch.randn(2, 11, 1, generator=gen)
    w = torch.ones(2, 11)
    w[1, 6:] = 0
    want = model.mse_value_and_grad(params, x, y, w, ("l2.weight", "l2.bias"))
    got = model.head_value_and_grad(params, model.head_input(params, x), y, w)
    assert torch.equal(got[0], want[0]) and list(got[1]) == list(want[1])
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    assert Task(model, head_layers=2).head_input(params, x) is None  # a deeper head: no

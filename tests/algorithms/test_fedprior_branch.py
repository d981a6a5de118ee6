"""fedprior's sweep-direction term (``branch_orders``, issue 10): y = φᵀc + b·ψᵀh + ε."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcal.algorithms.fedprior import FedPrior, term_name
from fedcal.core.bayes import F64, data_support, predictive_var
from fedcal.core.data import ClientData
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.basis import legendre_exponents, legendre_products
from fedcal.models.mlp import MLP
from fedcal_support import direction_reference
from fedcal_support.rounds import run_rounds

PHI = (3, 3)


def planted(seed: int = 0, units: int = 12, rows: int = 30, offset: float = 0.05):
    """Units y = φᵀc_i + b·h_i + noise: half calibrated both ways, half ascending only."""
    rng = np.random.default_rng(seed)
    x = torch.as_tensor(rng.uniform(-1, 1, (units, rows, 2)))
    phi = legendre_products(x, legendre_exponents(2, orders=PHI))
    coef = torch.as_tensor(rng.normal(0, 1, (units, phi.shape[-1])) * 0.3)
    h = torch.as_tensor(offset + 0.01 * rng.standard_normal(units))
    b = torch.where(torch.as_tensor(rng.uniform(size=(units, rows))) < 0.5, 1.0, -1.0).to(F64)
    b[units // 2 :] = 1.0  # the new units: ascending only
    y = (phi * coef.unsqueeze(1)).sum(-1) + b * h.unsqueeze(1)
    y = y + 0.002 * torch.as_tensor(rng.standard_normal((units, rows)))
    return x, y, b, phi, coef, h


def cohort(x, y, b) -> ClientData:
    arrays = [(x[i].numpy(), y[i, :, None].numpy()) for i in range(len(x))]
    branch = None if b is None else [b[i].numpy() for i in range(len(x))]
    return ClientData.from_arrays(arrays, dtype=F64, branch=branch)


def fit(alg: FedPrior, data: ClientData, rounds: int):
    """The engine's loop, every unit each round: (server, states, personal)."""
    return run_rounds(alg, data, rounds)[:3]


def prior(**kw) -> FedPrior:
    return FedPrior(Task(MLP()), orders=PHI, **kw)


def test_with_no_direction_known_it_is_fedprior():
    """b = 0 everywhere (or no column): every number is fedprior's.

    Exactly when the term is off; with the term on, to rounding: no unit informs h, so the
    term is out of the model (issue 20): h = 0 with the prior's floor variance, uncoupled,
    and the interval is fedprior's (before: h kept the vague start and widened it).
    """
    x, y, _, _, _, _ = planted()
    plain = fit(prior(), cohort(x, y, None), 6)
    p = plain[0]["mu"].shape[0]
    close = {"rtol": 1e-9, "atol": 1e-12}
    for b in (None, torch.zeros_like(y)):
        alg = prior(branch_orders=(2, 0))
        server, _, personal = fit(alg, cohort(x, y, b), 6)
        torch.testing.assert_close(server["mu"][:p], plain[0]["mu"], **close)
        torch.testing.assert_close(server["sigma"][:p, :p], plain[0]["sigma"], **close)
        torch.testing.assert_close(server["noise_var"], plain[0]["noise_var"], **close)
        torch.testing.assert_close(personal["coef"][:, :p], plain[2]["coef"], **close)
        torch.testing.assert_close(alg.predict(personal, x), prior().predict(plain[2], x), **close)
        # h saw no data: out of the model (μ_h = 0, Σ_hh = floor, uncoupled); fedprior's σ
        assert torch.all(server["mu"][p:] == 0) and torch.all(server["sigma"][:p, p:] == 0)
        torch.testing.assert_close(server["sigma"][p:, p:], 1e-12 * torch.eye(3, dtype=F64))
        assert server["mask"].tolist() == [1.0] * p + [0.0] * 3
        torch.testing.assert_close(
            alg.predictive_std(personal, x), prior().predictive_std(plain[2], x), **close
        )
    # Directions in the data change nothing, bit for bit, while the term is off.
    _, _, b, _, _, _ = planted()
    off = fit(prior(), cohort(x, y, b), 6)
    assert torch.equal(off[0]["mu"], plain[0]["mu"])
    assert torch.equal(off[2]["coef"], plain[2]["coef"])
    assert torch.equal(off[2]["cov"], plain[2]["cov"])


def test_the_fleet_learns_a_planted_offset_and_one_way_units_lose_its_bias():
    x, y, b, phi, coef, h = planted()
    data = cohort(x, y, b)
    server, _, personal = fit(prior(branch_orders=(0, 0)), data, 50)
    assert abs(float(server["mu"][-1]) - float(h.mean())) < 0.01  # 0.05 ± the units' spread
    assert float(server["noise_var"]) ** 0.5 < 0.004  # not in the noise any more (σ = 0.002)
    _, _, plain = fit(prior(), data, 50)
    truth = (phi * coef.unsqueeze(1)).sum(-1)  # the branch average
    new = slice(6, None)
    err = (prior(branch_orders=(0, 0)).predict(personal, x)[..., 0] - truth)[new]
    err0 = (prior().predict(plain, x)[..., 0] - truth)[new]
    rmse, rmse0 = err.pow(2).mean().sqrt(), err0.pow(2).mean().sqrt()
    assert rmse0 > 0.03  # fedprior's one-way units carry the ascending branch's offset
    assert rmse < 0.3 * rmse0


def test_prediction_is_the_mixture_of_the_two_branches():
    """Mean and variance = those of ½ N(m₊, v₊) + ½ N(m₋, v₋), each branch's predictive."""
    x, y, b, _, _, _ = planted(seed=1)
    alg = prior(branch_orders=(2, 0))
    _, _, personal = fit(alg, cohort(x, y, b), 5)
    coef, cov, noise = personal["coef"], personal["cov"], personal["noise_var"]
    branch = {}
    for sign in (1.0, -1.0):
        f = alg.design(x, torch.full(y.shape, sign, dtype=F64))
        branch[sign] = ((f * coef.unsqueeze(1)).sum(-1), predictive_var(f, cov, noise))
    (m_up, v_up), (m_down, v_down) = branch[1.0], branch[-1.0]
    torch.testing.assert_close(alg.predict(personal, x)[..., 0], 0.5 * (m_up + m_down))
    var = alg.predictive_std(personal, x)[..., 0] ** 2
    torch.testing.assert_close(var, 0.5 * (v_up + v_down) + 0.25 * (m_up - m_down) ** 2)


def test_the_em_is_the_reference_script_s_on_the_features_phi_and_b_psi():
    """fedcal_support/direction_reference.py fits the same model by hand: same prior."""
    ref = direction_reference
    x, y, b, _, _, _ = planted(seed=2)
    phi, psi = ref.bases(x, (2, 0))
    mu, sigma, noise, _ = ref.fit_prior(ref.features(phi, psi, b), y, torch.ones_like(y), 8)
    server, _, _ = fit(prior(branch_orders=(2, 0)), cohort(x, y, b), 8)
    torch.testing.assert_close(server["mu"], mu, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(server["sigma"], sigma, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(server["noise_var"], noise, rtol=1e-9, atol=0.0)


def test_bic_selects_among_phi_sub_bases_and_keeps_psi_in_every_candidate():
    x, y, b, _, _, _ = planted()
    alg = prior(branch_orders=(2, 0), select="bic")
    q = len(alg.branch_terms)
    assert q == 3 and alg.masks.shape == (16, 16 + q)
    assert torch.all(alg.masks[:, -q:] == 1)
    server, _, personal = fit(alg, cohort(x, y, b), 20)
    state = alg.export_state(server)
    p = len(state["terms"])
    assert len(state["mu"]) == p + q and np.shape(state["sigma"]) == (p + q, p + q)
    assert state["branch_terms"] == [[0, 0], [1, 0], [2, 0]]
    assert state["branch_term_names"] == ["b·1", "b·P1(x0)", "b·P2(x0)"]
    # The planted fleet is (3, 3) + a constant offset: the fleet's BIC keeps (3, 3) and
    # finds the offset on the constant ψ term.
    assert state["selection"]["chosen"] == {"orders": [3, 3]}
    assert abs(state["mu"][p] - 0.05) < 0.01
    torch.testing.assert_close(personal["coef"][:, -q:] != 0, torch.ones(12, q, dtype=torch.bool))


def test_bic_can_choose_psi_too_none_for_no_directions_the_planted_shape_otherwise():
    """branch_select: candidates = φ's 16 sub-bases × ψ ∈ {none, (0,0), (1,0), (2,0)}.

    The planted hysteresis is a constant offset: the fleet's BIC takes ψ = (0, 0), the
    exported prior has that one ψ term. With no direction known (b = 0) the ψ columns
    are empty and BIC takes no ψ (same evidence, fewer parameters).
    """
    x, y, b, _, _, _ = planted()
    alg = prior(branch_orders=(2, 0), select="bic", branch_select=True)
    assert len(alg.candidates) == 16 * 4 and alg.masks.shape == (64, 16 + 3)
    psi_sets = {tuple(map(tuple, alg.selection.candidate_branch_terms(c))) for c in alg.candidates}
    assert psi_sets == {(), ((0, 0),), ((0, 0), (1, 0)), ((0, 0), (1, 0), (2, 0))}
    assert alg.candidates[-1] == {"orders": [3, 3], "branch_orders": [2, 0]}  # round 0: all
    for k, cand in enumerate(alg.candidates):
        q = len(alg.selection.candidate_branch_terms(cand))
        assert int(alg.masks[k, 16:].sum()) == q and list(alg.masks[k, 16 : 16 + q]) == [1.0] * q

    server, _, personal = fit(alg, cohort(x, y, b), 20)
    state = alg.export_state(server)
    assert state["selection"]["chosen"] == {"orders": [3, 3], "branch_orders": [0, 0]}
    assert state["branch_terms"] == [[0, 0]] and state["branch_term_names"] == ["b·1"]
    assert len(state["mu"]) == 16 + 1 and abs(state["mu"][16] - 0.05) < 0.01
    assert torch.all(personal["coef"][:, 17:] == 0)  # ψ terms outside the choice: not in it
    # `fedcal calibrate` rebuilds the chosen model from the prior's selection record
    from fedcal.build import build_algorithm, build_task
    from fedcal.calibration import prior_config
    from tests.conftest import stored_prior

    params = {"orders": [3, 3], "select": "bic", "branch_orders": [2, 0], "branch_select": True}
    doc = {"method": "fedprior_psi", "method_params": params, "selection": state["selection"]}
    features = {"features": ["frequency_hz", "temperature_c"], "target": "p"}
    cfg = prior_config(stored_prior({**state, **doc, **features, "input_range": {}}))
    rebuilt = build_algorithm("fedprior_psi", cfg, build_task(cfg, 2))
    assert [list(t) for t in rebuilt.branch_terms] == state["branch_terms"]
    assert [list(t) for t in rebuilt.terms] == state["terms"] and rebuilt.select == "none"

    server, _, _ = fit(alg, cohort(x, y, torch.zeros_like(y)), 20)
    state = alg.export_state(server)
    assert state["selection"]["chosen"] == {"orders": [3, 3], "branch_orders": []}
    assert "branch_terms" not in state and len(state["mu"]) == 16


def test_the_chosen_basis_read_from_the_mask_is_each_candidate_s_own():
    """``chosen`` / ``chosen_branch`` / ``chosen_features`` (derived from the server's mask)
    give, for every candidate, its own terms in its own order and their design indices."""
    alg = prior(select="bic", branch_orders=(1, 1), branch_select=True)
    p = len(alg.terms)
    for k, cand in enumerate(alg.candidates):
        server = {"mask": alg.masks[k], "choice": torch.tensor(k)}
        terms, idx = alg.selection.chosen(server)
        assert terms == alg.selection.candidate_terms(cand)
        assert idx.tolist() == [alg.terms.index(t) for t in terms]
        psi = alg.selection.candidate_branch_terms(cand)
        assert alg.selection.chosen_branch(server) == psi
        names, features = alg.selection.chosen_features(server)
        assert features.tolist() == idx.tolist() + [p + alg.branch_terms.index(t) for t in psi]
        assert len(names) == len(features) and names[0] == "1"
        assert names[len(terms) :] == [f"b·{n}" for n in map(term_name, psi)]
    fixed = prior(branch_orders=(1, 0))  # no selection: the whole design, no mask needed
    assert fixed.selection.chosen({})[1].tolist() == list(range(len(fixed.terms)))
    assert fixed.selection.chosen_features({})[1].tolist() == list(range(fixed.num_features))


def test_a_bic_reply_carries_the_full_gram_and_the_chosen_candidate_s_statistics():
    """With selection the reply's top level is the chosen candidate's E-step (computed on its
    own, equal to its entry in the batch to rounding) and ``gram`` is the whole design's."""
    x, y, b, _, _, _ = planted(units=6, rows=20)
    data = cohort(x, y, b)
    alg = prior(select="bic", branch_orders=(1, 0))
    server = fit(alg, data, 3)[0]
    k = int(server["choice"])
    down = expand(alg.broadcast(server), 6)
    state = alg.client_init(down)
    reply = alg.client_update(down, state, data).reply
    design = alg.design(data.x, data.branch) * data.mask.unsqueeze(-1)
    torch.testing.assert_close(reply["gram"], design.transpose(1, 2) @ design, rtol=1e-12, atol=0)
    assert reply["n"].tolist() == [20.0] * 6
    for key in ("mean", "second", "gls_gram", "gls_rhs", "rss", "support"):
        torch.testing.assert_close(reply[key], reply["cand"][key][:, k], rtol=1e-10, atol=1e-12)
    # the whole design's support (whatever the choice): the direction term's check
    gram = design.transpose(1, 2) @ design
    torch.testing.assert_close(
        reply["branch_support"], data_support(gram, down["noise_var"], 1.0), rtol=1e-9, atol=1e-12
    )
    assert list(reply) == [
        *("mean", "second", "gls_gram", "gls_rhs", "rss", "n", "gram", "support"),
        *("branch_support", "cand"),
    ]


def test_bad_branch_orders_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"^fedprior branch_orders: \[2\] needs one order >= 0 per input"
    ):
        prior(branch_orders=(2,))


def test_every_unit_swept_one_way_leaves_the_term_out_and_is_fedprior_one_round_later():
    """Issue 20: no unit informs h apart from c (every row b = +1), so ψ is out of the model.

    Before, each unit split c + h by the vague start and predicted the branch average of a
    term no unit identifies (230–240 hPa on the simulator's all-few fleets). Now the first
    round finds J (every ψ coordinate), the EM starts again without it, and every number —
    prediction, σ (the hold-out's τ² included), the decline, the chosen basis, the weak
    terms — is fedprior's of one round fewer, to rounding.
    """
    x, y, _, _, _, _ = planted(units=12, rows=30)
    rows = [30] * 6 + [8] * 6  # 8-row units: the hold-out's probe; 30-row units emulate it
    arrays = [(x[i, : rows[i]].numpy(), y[i, : rows[i], None].numpy()) for i in range(12)]
    data = ClientData.from_arrays(arrays, dtype=F64, branch=[np.ones(r) for r in rows])
    close = {"rtol": 1e-7, "atol": 1e-10}
    for select in ("none", "bic"):
        plain = prior(select=select, interval="calibrated")
        s0, _, p0 = fit(plain, data, 7)
        alg = prior(select=select, interval="calibrated", branch_orders=(2, 0))
        server, _, personal = fit(alg, data, 8)
        assert server["pinned"].tolist() == [0.0] * 16 + [1.0] * 3
        torch.testing.assert_close(alg.predict(personal, x), plain.predict(p0, x), **close)
        std = alg.predictive_std(personal, x)
        assert torch.isfinite(std).all()  # an interval (this well-specified fleet: τ² = 0)
        torch.testing.assert_close(std, plain.predictive_std(p0, x), **close)
        torch.testing.assert_close(server["disc_var"], s0["disc_var"], **close)
        assert int(server["declined"]) == int(s0["declined"]) == 0
        state, state0 = alg.export_state(server), plain.export_state(s0)
        assert "branch_terms" not in state and state["terms"] == state0["terms"]
        assert state["identification"]["weak_terms"] == state0["identification"]["weak_terms"]
        # the term is out of the exported prior too: `fedcal calibrate` rebuilds fedprior
        assert state["selection"]["chosen"]["branch_orders"] == []
        if select == "bic":
            assert state["selection"]["chosen"]["orders"] == state0["selection"]["chosen"]["orders"]
        from fedcal.build import build_algorithm, build_task
        from fedcal.calibration import prior_config
        from tests.conftest import stored_prior

        params = {"orders": list(PHI), "select": select, "branch_orders": [2, 0]}
        doc = {"method": "fedprior_br", "method_params": params, "selection": state["selection"]}
        features = {"features": ["frequency_hz", "temperature_c"], "target": "p"}
        cfg = prior_config(stored_prior({**state, **doc, **features, "input_range": {}}))
        rebuilt = build_algorithm("fedprior_br", cfg, build_task(cfg, 2))
        assert rebuilt.branch_terms == () and [list(t) for t in rebuilt.terms] == state["terms"]
    # half of the units swept both ways: h is identified, nothing is pinned
    x, y, b, _, _, _ = planted()
    server = fit(prior(branch_orders=(2, 0)), cohort(x, y, b), 3)[0]
    assert server["pinned"].tolist() == [0.0] * 19


def test_a_partly_pinned_direction_term_travels_in_prior_json_and_calibrate_equals_the_run():
    """ψ beyond φ (orders (1, 1), branch_orders (2, 0)) on a one-way fleet: b·1 and b·P1(x0)
    are c's own columns (pinned), b·P2(x0) is a column of its own (identified), so J is part
    of ψ. The prior keeps ψ whole with J named, and the unit ``fedcal calibrate`` rebuilds
    from it has the federation's posterior (review2: the export held ψ without J and the
    rebuild refused it, 'basis terms do not match')."""
    from fedcal.calibration import prior_algorithm, prior_server
    from fedcal.data.scaling import Scaler
    from tests.conftest import stored_prior

    x, y, _, _, _, _ = planted(units=12, rows=30)
    arrays = [(x[i].numpy(), y[i, :, None].numpy()) for i in range(12)]
    data = ClientData.from_arrays(arrays, dtype=F64, branch=[np.ones(30) for _ in range(12)])
    params = {"orders": [1, 1], "branch_orders": [2, 0]}
    alg = FedPrior(Task(MLP()), **params)
    server, _, personal = fit(alg, data, 6)
    assert server["pinned"].tolist() == [0.0] * 4 + [1.0, 1.0, 0.0]
    prior = {
        **alg.export_state(server),
        "method": "fedprior",
        "method_params": params,
        "features": ["frequency_hz", "temperature_c"],
        "target": "p",
        "input_range": {"frequency_hz": [-1.0, 1.0], "temperature_c": [-1.0, 1.0]},
    }
    assert prior["branch_terms"] == [[0, 0], [1, 0], [2, 0]]
    assert prior["branch_pinned"] == [[0, 0], [1, 0]]
    rebuilt = prior_algorithm(stored_prior(prior))
    identity = Scaler(np.zeros(2), np.ones(2), np.zeros(1), np.ones(1), {})
    down = expand(rebuilt.broadcast(prior_server(stored_prior(prior), identity)), 12)
    again = rebuilt.personalize(down, rebuilt.client_init(down), data)
    close = {"rtol": 1e-9, "atol": 1e-12}
    torch.testing.assert_close(again["coef"], personal["coef"], **close)
    torch.testing.assert_close(rebuilt.predict(again, x), alg.predict(personal, x), **close)
    torch.testing.assert_close(
        rebuilt.predictive_std(again, x), alg.predictive_std(personal, x), **close
    )
    with pytest.raises(ValueError, match="branch_pinned: expected terms of branch_terms"):
        stored_prior({**prior, "branch_pinned": [[3, 0]]})

"""fedprior under client-level DP: its declared statistic maps and bounds, and a noisy run."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from fedcal.core.aggregation import AggregationPolicy, aggregate
from fedcal.core.bayes import F64
from fedcal.core.privacy import clip_statistics
from fedcal.core.tree import expand

from .test_fedprior import make, planted_fleet


def _rounds(alg, data, rounds: int, policy: AggregationPolicy | None = None):
    """fedprior's loop; with a policy the server goes through ``aggregate`` (DP included)."""
    n = data.num_clients
    server = alg.server_init({})
    state = alg.client_init(expand(alg.broadcast(server), n))
    result = None
    for r in range(rounds):
        down = alg.broadcast(server)
        result = alg.client_update(expand(down, n), state, data)
        state = result.state
        if policy is None:
            server = alg.server_update(server, result.reply, data.count)
        else:
            server, accepted, _ = aggregate(
                alg, server, down, result.reply, data.count, policy, round_seed=1000 + r
            )
            assert accepted.all()
    return server, state, result


def test_declared_maps_make_each_statistic_bounded_as_stated():
    """Lᵀ gls_gram L = A⁻¹B has eigenvalues in [0, 1), declared about I (a unit whose points
    determine every direction): in (−1, 0]; Lᵀ gls_rhs = L⁻¹(m − μ) = z̄; the second moment
    about μ is (m − μ)(m − μ)ᵀ + V; the support's eigenvalues lie in [0, 1), about I too."""
    alg = make(orders=(2, 1))
    data, _, _, _, _ = planted_fleet(12, [4, 6, 30, 200] * 3, seed=2, orders=(2, 1))
    server, _, _ = _rounds(alg, data, 4)
    down = alg.broadcast(server)
    result = alg.client_update(expand(down, 12), alg.client_init(expand(down, 12)), data)
    declared = alg.dp_statistics(down)
    assert set(declared) == set(result.reply)
    t, _ = clip_statistics(result.reply, declared, scale=1e12)  # transformed, not clipped
    vals = torch.linalg.eigvalsh(0.5 * (t["gls_gram"] + t["gls_gram"].transpose(1, 2)))
    assert vals.min() > -1 - 1e-9 and vals.max() <= 1e-9
    vals = torch.linalg.eigvalsh(t["support"])
    assert vals.min() > -1 - 1e-9 and vals.max() <= 1e-9
    chol = torch.linalg.cholesky(down["sigma"])
    dev = result.reply["mean"] - down["mu"]
    z = torch.linalg.solve_triangular(chol, dev.unsqueeze(-1), upper=False)[..., 0]
    torch.testing.assert_close(t["gls_rhs"], z, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(t["mean"], dev)
    cov = result.reply["second"] - result.reply["mean"].unsqueeze(-1) * result.reply[
        "mean"
    ].unsqueeze(-2)
    torch.testing.assert_close(t["second"], dev.unsqueeze(-1) * dev.unsqueeze(-2) + cov)
    torch.testing.assert_close(t["n"], data.count.to(F64))


def test_without_noise_the_private_path_is_the_plain_m_step():
    """σ → 0 and bounds far above every statistic: maps and their inverses cancel."""
    alg = make(orders=(2, 1))
    data, _, _, _, _ = planted_fleet(10, [5, 40] * 5, seed=3, orders=(2, 1))
    plain, _, _ = _rounds(alg, data, 5)
    policy = AggregationPolicy(dp_noise_multiplier=1e-14, dp_clip=1e4)
    private, _, _ = _rounds(alg, data, 5, policy)
    for key in ("mu", "sigma", "noise_var"):
        torch.testing.assert_close(private[key], plain[key], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("sigma", [2.85, 18.1])  # ε = 8 and ε = 1 over 20 rounds, q = 1
def test_noisy_fedprior_stays_a_valid_prior(sigma):
    """Noise far above the fleet's signal: the prior stays positive definite, the noise
    variance positive, every unit's posterior finite (the generic path's Cholesky failed)."""
    alg = make(orders=(2, 1))
    data, test, _, _, _ = planted_fleet(20, 40, seed=4, orders=(2, 1))
    policy = AggregationPolicy(dp_noise_multiplier=sigma, dp_clip=1.0)
    server, state, _ = _rounds(alg, data, 8, policy)
    assert torch.linalg.eigvalsh(server["sigma"]).min() > 0
    assert float(server["noise_var"]) > 0
    personal = alg.personalize(expand(alg.broadcast(server), 20), state, data)
    assert torch.isfinite(alg.predict(personal, test.x)).all()


def test_the_generic_single_bound_path_fails_where_the_declared_one_does_not():
    """The reason for per-statistic bounds: one joint clip bound + noise breaks Cholesky."""
    alg = make(orders=(2, 1))
    data, _, _, _, _ = planted_fleet(20, 40, seed=4, orders=(2, 1))

    class Undeclared(type(alg)):
        dp_statistics = None  # hides the declaration: aggregate takes the generic path

    generic = Undeclared(**{f.name: getattr(alg, f.name) for f in fields(alg) if f.init})
    policy = AggregationPolicy(dp_noise_multiplier=2.85, dp_clip=1.0)
    # The factorizations no longer raise (core.bayes.safe_cholesky floors the eigenvalues
    # and says so in the "jitter" metric); the run still breaks: the noisy RSS sum drives
    # σ² negative, every posterior needs the eigenvalue floor and every reply is rejected.
    n = data.num_clients
    server = generic.server_init({})
    state = generic.client_init(expand(generic.broadcast(server), n))
    accepted_counts, floors = [], []
    for r in range(8):
        down = generic.broadcast(server)
        result = generic.client_update(expand(down, n), state, data)
        state = result.state
        server, accepted, _ = aggregate(
            generic, server, down, result.reply, data.count, policy, round_seed=1000 + r
        )
        accepted_counts.append(int(accepted.sum()))
        floors.append(float(result.metrics["jitter"].max()))
    assert float(server["noise_var"]) < 0
    assert accepted_counts[-1] == 0 and floors[-1] == 1.0
    _, _, declared = _rounds(alg, data, 8, policy)  # the declared path: every reply accepted
    assert float(declared.metrics["jitter"].max()) == 0.0


def test_basis_selection_refuses_dp_in_one_line():
    """Every candidate's statistics would need their own noise: under DP, select = "bic"
    with select_by = "candidates" is refused with a message naming the marginal scores and
    the fixed-basis variant, not run half-private."""
    alg = make(orders=(1, 1), select="bic")
    data, _, _, _, _ = planted_fleet(6, [12] * 6, seed=1, orders=(1, 1))
    policy = AggregationPolicy(dp_noise_multiplier=1.0, dp_clip=1.0)
    with pytest.raises(ValueError, match=r"select_by = 'marginal'.*fedprior_fixed") as err:
        _rounds(alg, data, 1, policy)
    assert "\n" not in str(err.value)


def test_adaptive_clipping_runs_fedprior_on_bounds_below_the_declared_ones():
    """Private quantile estimation through ``aggregate``: every adapted bound (a released
    metric) is at most its declared one, the second moment's far below (its worst case
    assumes ‖m − μ‖ = 2√p s), and the noisy prior stays valid with finite predictions."""
    alg = make(orders=(2, 1), dp_whiten=True)
    data, test, _, _, _ = planted_fleet(40, 40, seed=4, orders=(2, 1))
    policy = AggregationPolicy(
        dp_noise_multiplier=2.0, dp_clip=1.0, dp_quantile=0.9, dp_count_multiplier=20.0
    )
    server, state, _ = _rounds(alg, data, 4, policy)
    assert torch.linalg.eigvalsh(server["sigma"]).min() > 0
    personal = alg.personalize(expand(alg.broadcast(server), 40), state, data)
    assert torch.isfinite(alg.predict(personal, test.x)).all()
    down = alg.broadcast(server)
    declared = alg.dp_statistics(down)
    reply = alg.client_update(expand(down, 40), state, data).reply
    _, _, metrics = aggregate(alg, server, down, reply, data.count, policy, round_seed=7)
    bounds = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("dp_bound/")}
    assert set(bounds) == set(declared)
    assert all(bounds[k] <= declared[k].bound * (1 + 1e-12) for k in declared)
    assert bounds["second"] < 0.2 * declared["second"].bound


def test_whitened_moments_are_the_prior_units_of_m_minus_mu():
    """dp_whiten: the mean is declared as L⁻¹(m − μ) (Σ = L Lᵀ, the broadcast's) and the
    second moment about μ in the same units, bounded by 2√p and (2√p)² + p."""
    alg = make(orders=(2, 1), dp_whiten=True)
    data, _, _, _, _ = planted_fleet(12, [4, 6, 30, 200] * 3, seed=2, orders=(2, 1))
    server, _, result = _rounds(alg, data, 3)
    down = alg.broadcast(server)
    result = alg.client_update(expand(down, 12), alg.client_init(expand(down, 12)), data)
    declared = alg.dp_statistics(down)
    t, _ = clip_statistics(result.reply, declared, scale=1e12)
    chol = torch.linalg.cholesky(down["sigma"])
    dev = result.reply["mean"] - down["mu"]
    z = torch.linalg.solve_triangular(chol, dev.unsqueeze(-1), upper=False)[..., 0]
    torch.testing.assert_close(t["mean"], z)
    cov = result.reply["second"] - result.reply["mean"].unsqueeze(-1) * result.reply[
        "mean"
    ].unsqueeze(-2)
    wcov = torch.linalg.solve_triangular(chol, cov, upper=False)
    wcov = torch.linalg.solve_triangular(chol, wcov.transpose(1, 2), upper=False)
    torch.testing.assert_close(t["second"], z.unsqueeze(-1) * z.unsqueeze(-2) + wcov)
    p = 6
    assert declared["mean"].bound == pytest.approx(2 * p**0.5)
    assert declared["second"].bound == pytest.approx(4 * p + p)


def test_adaptive_privacy_is_accounted_with_its_counts():
    """[privacy] quantile: the run's record gives the counts' noise multiplier and steps, and
    Opacus's composition of the sums' and the counts' mechanisms spends the recorded ε ≤ the
    target (the accountant's ε printed by a run is this one)."""
    from dataclasses import replace

    from fedcal.build import build_policy
    from fedcal.config import default_config
    from fedcal.core.privacy import composed_epsilon

    cfg = default_config()
    privacy = replace(cfg.privacy, epsilon=1.0, delta=1e-6, clip=1.0, quantile=0.9)
    cfg = replace(cfg, privacy=privacy, engine=replace(cfg.engine, rounds=6))
    policy, record = build_policy(cfg)
    assert policy.dp_quantile == 0.9 and policy.dp_count_multiplier == record["count_multiplier"]
    history = [(record["noise_multiplier"], 1.0, 6), (record["count_multiplier"], 1.0, 6 * 12)]
    assert composed_epsilon(history, 1e-6) == pytest.approx(record["epsilon"])
    assert 0.99 <= record["epsilon"] <= 1.0


def test_adaptive_clipping_without_declared_statistics_is_refused_in_one_line():
    """Adaptive clipping adapts declared bounds: a method without a declaration (here
    fedprior with its declaration hidden) is refused, not run on a silently fixed clip."""
    from fedcal.core.aggregation import AggregationError, check_policy

    alg = make(orders=(1, 1))

    class Undeclared(type(alg)):
        dp_statistics = None

    generic = Undeclared(**{f.name: getattr(alg, f.name) for f in fields(alg) if f.init})
    policy = AggregationPolicy(dp_noise_multiplier=1.0, dp_clip=1.0, dp_quantile=0.9)
    check_policy(alg, policy)  # fedprior declares its statistics: accepted
    with pytest.raises(AggregationError, match="quantile") as err:
        check_policy(generic, policy)
    assert "\n" not in str(err.value)

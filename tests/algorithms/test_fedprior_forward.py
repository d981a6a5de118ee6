"""The interval after calibration, calibrated on the units' own later rows or declined
(fedprior_forward, issue 34)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from fedcal.algorithms.fedprior import FedPrior
from fedcal.algorithms.fedprior_choice_checks import choice_problems
from fedcal.algorithms.fedprior_forward import (
    RATES,
    SCALES,
    bound_terms,
    fold_terms,
    forward_fit,
    forward_reason,
)
from fedcal.apps.flower_server import build
from fedcal.build import build_policy
from fedcal.core.algorithm import ClientResult
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.tree import flatten
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.rounds import run_rounds

from .test_fedprior_choice import make
from .test_fedprior_choice_checks import CFG, FORGER
from .test_fedprior_choice_checks import _fleet as choice_fleet

Z = 1.959964


def _fleet(units: int, rows: int, sd, gain=None, seed: int = 0):
    """Units on the line y = x, noise sd ``sd(i, t)``, optional gain drift ``gain(i, t)``;
    calibration times in [0, 1), future rows in [1, 1.3)."""
    rng = np.random.default_rng(seed)
    train, test, t_train, t_test = [], [], [], []
    for i in range(units):
        for part, (lo, hi, n) in enumerate(((0.0, 1.0, rows), (1.0, 1.3, rows // 2))):
            t = np.sort(rng.uniform(lo, hi, n))
            x = rng.uniform(-1, 1, n)
            g = 1.0 if gain is None else 1.0 + gain(i, t)
            y = g * x + sd(i, t) * rng.standard_normal(n)
            (train if part == 0 else test).append((x[:, None], y[:, None]))
            (t_train if part == 0 else t_test).append(t)
    seeds = tuple(range(units))
    return (
        ClientData.from_arrays(train, seeds, F64, time=t_train),
        ClientData.from_arrays(test, seeds, F64, time=t_test),
    )


def _coverage(alg, personal, data: ClientData) -> tuple[float, torch.Tensor]:
    std = alg.predictive_std_timed(personal, data)[..., 0]
    err = (alg.predict(personal, data.x)[..., 0] - data.y[..., 0]).abs()
    inside = (err <= Z * std).to(F64) * data.mask
    per_unit = inside.sum(1) / data.mask.sum(1)
    return float(per_unit.mean()), std


def test_fold_terms_count_rows_by_the_factor_they_need() -> None:
    """Hand values: errors 1, 2, 4 at v = 1 need κ = |e|/1.96; ρ adds h·w to v."""
    e = torch.tensor([[1.0, 2.0, 4.0, 9.0]], dtype=F64)
    v = torch.tensor([[1.0, 1.0, 1.0, math.nan]], dtype=F64)  # the last row: no σ stated
    hw = torch.tensor([[0.0, 0.0, 3.0, 0.0]], dtype=F64)
    up = fold_terms(e, v, hw, torch.ones_like(e))
    need = torch.tensor([1.0, 2.0, 4.0], dtype=F64) / Z  # at ρ = 0
    want = (need.unsqueeze(1) <= SCALES).to(F64).mean(0)
    assert torch.allclose(up["cover"][0, 0], want)
    assert float(up["units"][0]) == 1.0
    # z² at ρ_j: (1 + 4 + 16 / (1 + 3ρ_j)) / 3, and log(1 + 3ρ_j) / 3
    assert torch.allclose(up["z2"][0], (5.0 + 16.0 / (1.0 + 3.0 * RATES)) / 3.0)
    assert torch.allclose(up["logv"][0], torch.log1p(3.0 * RATES) / 3.0)


def test_the_factor_of_a_fleet_whose_sigma_is_pooled_is_recovered() -> None:
    """One fleet σ for units of two noise levels (0.05 and 0.2, half each; the same line):
    stationary in time, so the later rows need the factor the future needs. With the fitted
    σ̂, a unit at s covers P(|z| ≤ 1.96 κ σ̂ / s); the mean over units is 95 % where
    ½ + ½(2Φ(1.96 κ σ̂ / 0.2) − 1) = 0.95 (the quiet units cover ≈ 1), κ* = 1.645 · 0.2 / (1.96 σ̂).
    Tolerance: the grid's step (+4.5 %, the smallest κ_m ≥ κ*) and, per fold, 10 loud units
    × ~100 scored rows, SE of the mean coverage √(0.9 · 0.1 / 1000) / 2 = 0.0047, i.e.
    0.0047 / (φ(1.645) · 1.645 / κ* / 2) ≈ 0.034 in κ; the larger of two folds: ± 3 SE."""
    train, test = _fleet(20, 400, lambda i, t: np.where(i % 2 == 0, 0.05, 0.2) + 0 * t)
    alg = make(degree=1, choose="time", noise="fleet")
    run = run_rounds(alg, train, 8)
    s_hat = math.sqrt(float(run.server["noise_var"]))
    kappa_star = 1.645 * 0.2 / (Z * s_hat)
    kappa = float(run.server["fwd_scale"])
    assert float(run.server["fwd_declined"]) == 0
    assert kappa_star - 0.1 <= kappa <= kappa_star * 1.045 + 0.1, (kappa, kappa_star)
    assert kappa > 1.05  # the model's own σ under-covers the loud units
    cover, _ = _coverage(alg, run.personal, test)
    # 20 units × 200 future rows: the mean coverage's SE ≈ 0.005; the factor's ± 0.1 moves it
    # by ≤ 0.015
    assert 0.925 <= cover <= 0.975
    # before the unit's last calibration time its σ is the model's: κ is for the future only
    std_in = alg.predictive_std_timed(run.personal, train)
    assert torch.allclose(std_in, alg.predictive_std(run.personal, train.x))
    record = alg.export_state(run.server)["selection"]["forward"]["interval"]
    assert record["kappa"] == kappa and "declined" not in record


def test_declined_when_a_planted_drift_breaks_the_later_fold() -> None:
    """Each unit's gain starts to drift at t = 0.75 (rate ±2 per unit time): the earlier
    fold (fit on t < 0.5, scored on [0.5, 0.75)) sees none, so the factor it learns (≈ 1)
    covers the later fold (scored after 0.75) far below 90 %: the fleet cannot trust a
    factor for the future, and states no interval after calibration."""
    rates = np.random.default_rng(7).choice([-2.0, 2.0], 16)
    train, test = _fleet(
        16,
        200,
        lambda i, t: 0.05 + 0 * t,
        gain=lambda i, t: rates[i] * np.clip(t - 0.75, 0.0, None),
    )
    alg = make(degree=1, choose="time", noise="fleet")
    run = run_rounds(alg, train, 8)
    assert float(run.server["fwd_declined"]) == 3
    c1, se, _ = (float(v) for v in run.server["fwd_check"])
    assert c1 < 0.90 - 2 * se
    assert "changes between periods" in forward_reason(run.server)
    record = alg.export_state(run.server)["selection"]["forward"]["interval"]
    assert "declined" in record
    std = alg.predictive_std_timed(run.personal, test)[..., 0]
    assert bool(torch.isnan(std[test.mask > 0]).all())  # no interval on the future
    assert bool(torch.isfinite(alg.predictive_std(run.personal, train.x)).all())
    assert bool(
        torch.isnan(torch.tensor(alg.unit_columns(run.personal, train)["future_scale"])).all()
    )


def test_a_fleet_with_too_few_scored_units_is_declined() -> None:
    terms = fold_terms(*(torch.ones(2, 5, dtype=F64) for _ in range(3)), torch.ones(2, 5))
    total = {k: torch.stack([v, v], 1).sum(0) for k, v in terms.items()}  # 2 units, 2 folds
    out = forward_fit(total, torch.tensor(1.0, dtype=F64))
    assert float(out["fwd_declined"]) == 1 and "fewer than 3" in forward_reason(out)


def _honest_uploads():
    train, _ = _fleet(6, 60, lambda i, t: 0.1 + 0 * t)
    alg = make(degree=1, choose="time")
    run = run_rounds(alg, train, 3)
    from fedcal.core.tree import expand

    down = expand(alg.broadcast(run.server), 6)
    reply = alg.client_update(down, run.states, train).reply
    return alg, flatten(reply)


def test_a_forged_forward_upload_is_refused_and_bounded() -> None:
    alg, sub = _honest_uploads()
    lin = torch.tensor(alg.time_choice.linear_terms)
    assert choice_problems(sub, alg.choice_clip, lin) == {}
    cases = {
        "choice/fwd_cover": (lambda v: v.__setitem__((2, 0, 0, 0), 1e6), "outside what rows"),
        "choice/fwd_z2": (lambda v: v.__setitem__((2, 1, 0), -5.0), "outside what rows"),
        "choice/fwd_units": (lambda v: v.__setitem__((2, 0), 3.0), "outside what rows"),
        "choice/fwd_logv": (lambda v: v.__setitem__((2, 0, 3), math.inf), "not finite"),
        "choice/span": (lambda v: v.__setitem__(2, -1.0), "span"),
    }
    for key, (forge, why) in cases.items():
        bad = {k: v.clone() for k, v in sub.items()}
        forge(bad[key])
        found = choice_problems(bad, alg.choice_clip, lin)
        assert list(found) == [2] and why in found[2], key
    # decreasing coverage in κ (a lie no rows give) is refused too
    bad = {k: v.clone() for k, v in sub.items()}
    bad["choice/fwd_cover"][2, 0, 0] = torch.linspace(1, 0, len(SCALES), dtype=F64)
    bad["choice/fwd_cover_sq"][2, 0, 0] = bad["choice/fwd_cover"][2, 0, 0] ** 2
    assert list(choice_problems(bad, alg.choice_clip, lin)) == [2]
    # without the check (the server clips each unit): a unit claiming 10⁶ moves a fold's
    # mean coverage by at most 1/N, as any honest unit may
    fwd = {k[len("choice/fwd_") :]: v for k, v in sub.items() if k.startswith("choice/fwd_")}
    forged = {k: v.clone() for k, v in fwd.items()}
    forged["cover"][2] = 1e6
    clipped = bound_terms(forged)
    n = float(fwd["units"][:, 0].sum())
    moved = (clipped["cover"].sum(0) - fwd["cover"].sum(0)) / n
    assert float(moved.abs().max()) <= 1.0 / n + 1e-12


def test_without_a_time_column_sigma_is_the_models_bit_for_bit() -> None:
    """A chamber fleet (no time column): a run resolves ``choose = "auto"`` to "off" (no
    forward keys at all); in-process "auto" keeps them, unused. Either way the σ the
    evaluation reads (timed) is predictive_std exactly."""
    train, _ = _fleet(6, 40, lambda i, t: 0.1 + 0 * t)
    chamber = ClientData(train.x, train.y, train.count, train.seeds, train.index)
    for choose in ("off", "auto"):
        alg = make(degree=1, choose=choose)
        run = run_rounds(alg, chamber, 4)
        if choose == "off":
            assert not any(k.startswith("fwd_") for k in [*run.server, *run.personal])
        timed = alg.predictive_std_timed(run.personal, chamber)
        assert torch.equal(timed, alg.predictive_std(run.personal, chamber.x))


@dataclasses.dataclass(frozen=True)
class ForwardForger(FedPrior):
    """Unit FORGER claims its rows are never covered: coverage 2 at κ = 0.5 falling to 0."""

    forge: bool = False

    def client_update(self, down, state, data):
        out = super().client_update(down, state, data)
        if not self.forge or "choice" not in out.reply:
            return out
        c = {k: v.clone() for k, v in out.reply["choice"].items()}
        c["fwd_cover"][FORGER] = torch.linspace(2, 0, len(SCALES), dtype=F64)
        c["fwd_cover_sq"][FORGER] = c["fwd_cover"][FORGER] ** 2
        return ClientResult({**out.reply, "choice": c}, out.state, out.metrics)


def _forged_run(forge: bool):
    base = build(CFG, "fedprior", 1)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    alg = ForwardForger(**fields, forge=forge)
    eng = EngineConfig(rounds=8, seed=0, dtype="float64", aggregation=build_policy(CFG)[0])
    return simulate(alg, prepare(choice_fleet(), dtype="float64"), eng)


def test_a_unit_forging_its_forward_coverage_is_refused_in_a_run() -> None:
    """The engine's consistency check refuses the forger's replies in every round; the
    fleet's factor is then the honest units' (within one grid step of the clean run's)."""
    clean, res = _forged_run(False), _forged_run(True)
    assert not clean.extra["rejections"]
    reasons = {r["reason"] for r in res.extra["rejections"] if r["client_index"] == FORGER}
    assert len(reasons) == 1 and "forward interval uploads outside" in reasons.pop()
    step = float(SCALES[1] / SCALES[0])
    ratio = float(res.server["fwd_scale"]) / float(clean.server["fwd_scale"])
    assert 1 / step - 1e-9 <= ratio <= step + 1e-9


def test_the_chamber_preset_s_frozen_basis_stays_off_under_the_time_choice() -> None:
    """The shipped preset freezes the BIC choice after ``select_patience`` stable rounds
    (fedprior_rounds R1); the time-respecting choice scores every candidate each round, so
    under it nothing is frozen: the run equals the one without a patience, bit for bit (a
    frozen basis once made every field run fail with KeyError 'cand')."""
    train, _ = _fleet(12, 120, lambda i, t: 0.1 + 0 * t)
    runs = [
        run_rounds(make(choose="time", select="bic", select_patience=p), train, 6) for p in (2, 0)
    ]
    assert "cand" in runs[0].server  # the candidates still travel after 6 rounds
    frozen, every = (dict(flatten(r.server)) for r in runs)
    assert frozen.keys() == every.keys()
    for key, value in every.items():
        assert torch.equal(frozen[key], value), key

"""Robust and secure together (issue 36.2): grouped SecAgg+ and the checks on group sums.

* :mod:`fedcal.core.group_check` against hand-computed values: a group holding a unit scaled
  by f leaves the summed GLS identity a gap of (f − 1)·L⁻¹μ, a consistent group none; the
  group distance and its Hotelling cut-off by their formulas.
* In process (the ServerApp's round loop and the sites' real handlers, one sensor per site):
  a clean grouped run equals today's SecAgg+ run (nobody left out); a site scaling its
  statistics ×1.5 (before it masks them) or a flipped unit moves the honest units ≤ 5 %
  and only the attacker's group is left out, where one secure sum lets ×1.5 through; the
  server learns each group's sum (the sum of its sensors' statistics) and nothing finer.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import f as f_dist

from fedcal.apps.flower_server import federation
from fedcal.config import EngineSection, RunConfig
from fedcal.core.group_check import group_distances, group_verdict, mean_law
from fedcal.core.robust import prior_frame
from fedcal.core.tree import flatten
from fedcal.engine.flower.secagg import SecureAggregation, group_of
from fedcal.engine.flower.wire import split_parts, to_numpy
from fedcal_support.flower_hostile import InProcess, node_cfgs
from fedcal_support.prior_attack import flipped, scaling_site

UNITS, GROUPS, ATTACKER, ROUNDS = 12, 4, 3, 3


def _config(robust: str) -> RunConfig:
    return RunConfig(
        engine=EngineSection(rounds=ROUNDS, dtype="float64"),
        method_params={"fedprior": {"orders": [1, 1], "init_noise": 0.1, "robust": robust}},
    )


def _group_sums(m, second, rhs, groups):
    return {
        "mean": torch.stack([m[g].sum(0) for g in groups]),
        "second": torch.stack([second[g].sum(0) for g in groups]),
        "gls_rhs": torch.stack([rhs[g].sum(0) for g in groups]),
    }


def test_summed_identities_catch_a_scaled_unit_and_pass_consistent_sums() -> None:
    # prior N(μ, Σ = ¼I), p = 2, L = ½I; units with posterior (m_i, V_i) and
    # rhs_i = L⁻ᵀL⁻¹(m_i − μ) = 4(m_i − μ) (identity f: L⁻¹(m − μ) = Lᵀ rhs)
    mu = torch.tensor([3.0, -1.0], dtype=torch.float64)
    frame = prior_frame(mu, 0.25 * torch.eye(2, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    m = mu + 0.3 * torch.randn(6, 2, generator=gen, dtype=torch.float64)
    v = torch.eye(2, dtype=torch.float64) * 0.01
    rhs = 4 * (m - mu)
    second = m.unsqueeze(-1) * m.unsqueeze(-2) + v
    groups, counts = [[0, 1], [2, 3], [4, 5]], torch.full((3,), 2.0, dtype=torch.float64)
    f = 1.5

    # a site scaling every statistic by f: S − m mᵀ of its group is no covariance; the
    # smallest eigenvalue of L⁻¹(S_g − M_gM_gᵀ/2)L⁻ᵀ / 2 is reported
    s1 = second.clone()
    s1[0] = f * second[0]
    m1, r1 = m.clone(), rhs.clone()
    m1[0], r1[0] = f * m[0], f * rhs[0]
    sums = _group_sums(m1, s1, r1, groups)
    own = 4 * (sums["second"][0] - sums["mean"][0].outer(sums["mean"][0]) / 2)
    low = float(torch.linalg.eigvalsh(own)[0]) / 2
    verdict = group_verdict(sums, counts, frame, slice(None))
    assert low < 0 and verdict.inconsistent[0] == (
        f"group covariance not positive semi-definite ({low:.3g})"
    )
    assert verdict.inconsistent[1:] == (None, None)
    assert verdict.kept.tolist() == [False, True, True]
    assert verdict.distances.isnan().all()  # two consistent groups: nobody judged

    # a forger who keeps S = m mᵀ + V for its scaled m: the summed GLS identity's gap is
    # e = (f − 1)L⁻¹μ = 0.5·2μ, over n + ‖z‖, z = L⁻¹(M_g − 2μ)
    s2 = second.clone()
    s2[0] = m1[0].outer(m1[0]) + v
    sums = _group_sums(m1, s2, r1, groups)
    z = 2 * (sums["mean"][0] - 2 * mu)
    gap = float((0.5 * 2 * mu).norm() / (2 + z.norm()))
    verdict = group_verdict(sums, counts, frame, slice(None))
    assert verdict.inconsistent == (
        f"posterior mean and GLS right-hand side disagree ({gap:.3g})",
        None,
        None,
    )
    # the honest sums pass, and are then judged (three consistent groups)
    verdict = group_verdict(_group_sums(m, second, rhs, groups), counts, frame, slice(None))
    assert verdict.inconsistent == (None, None, None) and verdict.kept.all()
    assert not verdict.distances.isnan().any()


def test_group_distance_and_cut_off_by_their_formulas() -> None:
    # p = 1: three groups of 2, 3, 5 units; group 0 against the 8 others by hand
    mean = torch.tensor([[4.0], [3.0], [6.0]], dtype=torch.float64)
    second = torch.tensor([[[9.0]], [[5.0]], [[10.0]]], dtype=torch.float64)
    counts = torch.tensor([2.0, 3.0, 5.0], dtype=torch.float64)
    got = group_distances(mean, second, counts)
    centre = 9.0 / 8
    spread = 15.0 / 8 - centre**2
    want = (4.0 / 2 - centre) ** 2 / spread / (1 / 2 + 1 / 8)
    assert float(got[0]) == pytest.approx(want, rel=1e-12)
    # too few others to name a law (N₋g ≤ p + 1, as for units): consistent, not judged
    mu = torch.zeros(5, dtype=torch.float64)
    frame = prior_frame(mu, torch.eye(5, dtype=torch.float64))
    few = {
        "mean": torch.zeros(3, 5, dtype=torch.float64),
        "second": torch.eye(5, dtype=torch.float64).expand(3, 5, 5) * 0.5,
        "gls_rhs": torch.zeros(3, 5, dtype=torch.float64),
    }
    verdict = group_verdict(few, torch.tensor([1.0, 2.0, 3.0]), frame, slice(None))
    assert verdict.kept.all() and verdict.distances.isnan().all()  # N₋g ≤ 5 < p + 2 = 7
    n, p = 20, 3
    scale = p * (n - 1) / (n - p)
    assert mean_law(p, n) == pytest.approx(
        (scale * f_dist.ppf(0.999, p, n - p), scale * f_dist.median(p, n - p))
    )


def test_groups_are_fixed_by_node_ids_and_never_hold_a_single_site() -> None:
    assert group_of([100, 101, 102, 103, 104, 105], 3) == {
        100: 1,
        101: 2,
        102: 0,
        103: 1,
        104: 2,
        105: 0,
    }
    # 5 sites in 3 groups: node 102's group of one is merged into another
    got = group_of([100, 101, 102, 103, 104], 3)
    sizes = pd.Series(got).value_counts()
    assert sizes.min() >= 2 and len(sizes) == 2 and got[100] == got[103]
    # fixed by the federation's sites: a site that drops out changes no other site's group
    # (secure_exchange asks a site left alone in its group to sit the round out)
    with pytest.raises(ValueError, match="secagg-groups"):
        SecureAggregation(groups=1)


def _run(fleet, root, robust, secure, tamper=None):
    from fedcal.engine.flower.loop import run_federation

    fed = federation(_config(robust), "fedprior", seed=0, secure=secure)
    transport = InProcess(node_cfgs(fleet, root), 9, tamper)
    run_federation(fed, transport)
    return fed, transport.wire


def _honest_ratio(fed, clean) -> float:
    a = pd.DataFrame(fed.final_rows()).set_index("client_index")["test_rmse"].drop(ATTACKER)
    b = pd.DataFrame(clean.final_rows()).set_index("client_index")["test_rmse"].drop(ATTACKER)
    return float(a.mean() / b.mean())


def _left_out(fed) -> list[list[int]]:
    return [sorted({r["client"] for r in e.get("screening", [])}) for e in fed.log if "asked" in e]


@pytest.fixture(scope="module")
def toy(make_fleet):
    return make_fleet(num_clients=UNITS, train=24)


@pytest.fixture(scope="module")
def runs(toy, tmp_path_factory):
    pytest.importorskip("flwr")
    root = tmp_path_factory.mktemp("groups")
    grouped = SecureAggregation(groups=GROUPS)
    return {
        "today": _run(toy, root / "today", "off", SecureAggregation()),
        "clean": _run(toy, root / "clean", "full", grouped),
        "x1.5": _run(toy, root / "x15", "full", grouped, scaling_site(ATTACKER, 1.5)),
        "today x1.5": _run(
            toy, root / "t15", "off", SecureAggregation(), scaling_site(ATTACKER, 1.5)
        ),
        "flip": _run(flipped(toy, f"S{ATTACKER:02d}"), root / "flip", "full", grouped),
    }


def test_a_clean_grouped_run_equals_todays_secure_run(runs) -> None:
    today, clean = runs["today"][0], runs["clean"][0]
    assert _left_out(clean) == [[]] * ROUNDS
    assert all(e["aggregation"]["groups"] == GROUPS for e in clean.log if "aggregation" in e)
    a, b = flatten(today.server), flatten(clean.server)
    for k in a:  # every group kept: the M-step reads the one secure sum, bit for bit
        assert torch.equal(a[k], b[k]), k
    assert today.final_rows() == clean.final_rows()


def test_a_hostile_site_moves_the_honest_units_at_most_5_percent(runs) -> None:
    clean = runs["clean"][0]
    group = [i for i in range(UNITS) if (100 + i) % GROUPS == (100 + ATTACKER) % GROUPS]
    assert ATTACKER in group and len(group) == UNITS // GROUPS
    for case, kind in (("x1.5", "inconsistent"), ("flip", "outlier")):
        fed = runs[case][0]
        assert _honest_ratio(fed, clean) == pytest.approx(1.0, abs=0.05), case
        assert _left_out(fed) == [group] * ROUNDS, case  # its group, every round, no other
        reasons = {r["reason"] for e in fed.log for r in e.get("screening", [])}
        assert all(r.startswith(f"secure group {kind}") for r in reasons), reasons
    # the reference: today's one secure sum lets the same site through (the finding)
    assert _honest_ratio(runs["today x1.5"][0], runs["today"][0]) > 1.05


def test_the_server_learns_each_groups_sum_and_nothing_finer(runs, toy, tmp_path) -> None:
    fed, wire = runs["clean"]
    _, plain_wire = _run(toy, tmp_path / "plain", "off", None)
    # the sensors' statistics in round 0 (same starting prior in both runs), by site
    own: dict[int, dict[str, np.ndarray]] = {}
    for t, node, data in plain_wire:
        if t != 0:
            continue
        from flwr.common.serde import recorddict_from_proto
        from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

        proto = RecordDictProto()
        proto.ParseFromString(data)
        parts, _, _ = split_parts(recorddict_from_proto(proto))
        for part in parts.values():
            if "reply" in part:
                own[node] = {k: to_numpy(v).astype(np.float64) for k, v in part["reply"].items()}
    got = fed.secure_sums[0]
    assert len(got.groups) == GROUPS
    for nodes, sums, count in got.groups.values():
        assert len(nodes) >= 2 and count == len(nodes)  # one sensor per site
        for k, v in sums.items():
            exact = np.sum([own[n][k] for n in nodes], axis=0)
            tol = got.bound[k] + 1e-12 * np.abs(exact).max()
            assert np.abs(v - exact).max() <= tol, k
    # what went on the wire in a secure round: no sensor's statistics
    for t, _, data in wire:
        assert b"gls_rhs" not in data or t < 0


def test_a_group_that_loses_a_site_beyond_its_threshold_is_left_out_not_the_round(
    toy, tmp_path
) -> None:
    """Groups of two sites (threshold 2): the reply of sensor 0's site is lost in round 1.
    That group cannot be unmasked; the round goes on with the other groups, the group-mate
    sits it out (as a failed site: its state rolled back), and both are back in round 2
    (before, such a group failed the whole round)."""
    from fedcal.engine.flower.loop import run_federation

    lost_node = 100  # sensor 0's site
    mate = next(n for n in range(101, 100 + UNITS) if n % 6 == lost_node % 6)
    fed = federation(_config("full"), "fedprior", seed=0, secure=SecureAggregation(groups=6))
    lost = lambda t: {lost_node} if t == 1 else set()  # noqa: E731
    run_federation(fed, InProcess(node_cfgs(toy, tmp_path / "g"), 9, lost=lost))
    entry = next(e for e in fed.log if e.get("round") == 1 and "asked" in e)
    gone = {0, mate - 100}
    assert entry["trained"] == [i for i in range(UNITS) if i not in gone]
    assert fed.failed["1"][mate - 100].endswith("its group fell below its threshold")
    assert fed.secure_sums[1].count == UNITS - 2 and len(fed.secure_sums[1].groups) == 5
    later = next(e for e in fed.log if e.get("round") == 2 and "asked" in e)
    assert later["trained"] == list(range(UNITS))  # both back in the next round

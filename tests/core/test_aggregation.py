"""Screening, clipping, robust rules, DP noise and weight caps of core.aggregation, by hand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fedcal.core.aggregation import (
    PLAIN,
    AggregationError,
    AggregationPolicy,
    aggregate,
    check_policy,
    krum_scores,
)
from fedcal.core.algorithm import Algorithm, ClientResult

F64 = torch.float64


@dataclass(frozen=True)
class MeanAlg(Algorithm):
    """The base server update: weighted mean of replies["model"]."""

    name: ClassVar[str] = "toy_mean"

    def client_update(self, down, state, data):  # never called here
        return ClientResult({}, {}, {})


@dataclass(frozen=True)
class SumAlg(MeanAlg):
    name: ClassVar[str] = "toy_sum"
    reply_aggregation: ClassVar[str] = "sum"

    def server_update(self, server, replies, weights):
        return {k: v.sum(0) for k, v in replies.items()}


@dataclass(frozen=True)
class CustomAlg(MeanAlg):
    name: ClassVar[str] = "toy_custom"
    reply_aggregation: ClassVar[str] = "custom"


def rows(*vectors) -> dict:
    return {"model": {"w": torch.tensor(vectors, dtype=F64)}}


SERVER = {"model": {"w": torch.zeros(2, dtype=F64)}}
ONES4 = torch.ones(4, dtype=F64)


def run(alg, replies, policy, weights=None, **kw):
    n = replies["model"]["w"].shape[0] if "model" in replies else replies["stat"].shape[0]
    weights = torch.ones(n, dtype=F64) if weights is None else weights
    server = SERVER if "model" in replies else {"stat": torch.zeros(2, dtype=F64)}
    return aggregate(alg(task=None), server, server, replies, weights, policy, 0, **kw)


def test_plain_policy_is_the_algorithms_own_aggregate_bit_for_bit():
    replies = rows([0.1, 0.2], [0.3, -0.7], [1.1, 0.05])
    new, accepted, _ = run(MeanAlg, replies, PLAIN)
    expected = MeanAlg(task=None).server_update(SERVER, replies, torch.ones(3, dtype=F64))
    assert torch.equal(new["model"]["w"], expected["model"]["w"])
    assert accepted.tolist() == [True, True, True]


def test_non_finite_reply_is_rejected_and_the_rest_averaged():
    new, accepted, m = run(MeanAlg, rows([1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0]), PLAIN)
    assert accepted.tolist() == [True, False, True]
    assert new["model"]["w"].tolist() == [2.0, 3.0]
    assert m["rejected_nonfinite"] == 1.0


def test_all_rejected_keeps_the_server():
    new, accepted, _ = run(MeanAlg, rows([float("inf"), 0.0]), PLAIN)
    assert new is SERVER and accepted.tolist() == [False]


def test_eligible_mask_from_the_engine_rejects_too():
    eligible = torch.tensor([True, False, True])
    new, accepted, _ = run(MeanAlg, rows([1.0, 0], [9.0, 0], [3.0, 0]), PLAIN, eligible=eligible)
    assert accepted.tolist() == [True, False, True] and new["model"]["w"].tolist() == [2.0, 0.0]


def test_norm_outlier_screened_relative_to_the_cohort_median():
    # Norms 1, 1, 2, 50: median 1.5, screen at 10 × 1.5 = 15 → the 50 goes.
    replies = rows([1.0, 0], [0, 1.0], [2.0, 0], [0, 50.0])
    policy = AggregationPolicy(screen_factor=10.0, clip_factor=0.0)
    new, accepted, m = run(MeanAlg, replies, policy)
    assert accepted.tolist() == [True, True, True, False]
    assert m["rejected_norm"] == 1.0
    assert torch.allclose(new["model"]["w"], torch.tensor([1.0, 1 / 3], dtype=F64))


def test_adaptive_clipping_by_hand():
    # Norms 1, 1, 1, 5: median 1, bound 3 × 1 = 3 → the last becomes (0, 3).
    replies = rows([1.0, 0], [1.0, 0], [0, 1.0], [0, 5.0])
    policy = AggregationPolicy(screen_factor=0.0, clip_factor=3.0)
    new, accepted, m = run(MeanAlg, replies, policy)
    assert accepted.all() and m["clipped"] == 1.0 and m["clip_bound"] == 3.0
    assert torch.allclose(new["model"]["w"], torch.tensor([0.5, 1.0], dtype=F64))


def test_clipping_is_relative_to_the_broadcast():
    server = {"model": {"w": torch.tensor([10.0, 10.0], dtype=F64)}}
    # Updates (1, 0), (0, 1), (0, 1), (0, 5) → the last clipped to (0, 3): mean (0.25, 1.25).
    replies = rows([11.0, 10.0], [10.0, 11.0], [10.0, 11.0], [10.0, 15.0])
    policy = AggregationPolicy(screen_factor=0.0, clip_factor=3.0)
    new, _, _ = aggregate(MeanAlg(task=None), server, server, replies, ONES4, policy, 0)
    assert torch.allclose(new["model"]["w"], torch.tensor([10.25, 11.25], dtype=F64))


def test_coordinate_median_even_cohort_takes_the_middle_pair():
    replies = rows([1.0, 10.0], [2.0, -5.0], [100.0, 0.0], [3.0, 1.0])
    policy = AggregationPolicy(rule="median", screen_factor=0.0, clip_factor=0.0)
    new, accepted, _ = run(MeanAlg, replies, policy)
    # Sorted columns: (1, 2, 3, 100) → 2.5; (−5, 0, 1, 10) → 0.5.
    assert accepted.all() and new["model"]["w"].tolist() == [2.5, 0.5]


def test_trimmed_mean_cuts_each_end():
    replies = rows([1.0, 0], [2.0, 0], [3.0, 0], [4.0, 0], [1000.0, 0])
    policy = AggregationPolicy(
        rule="trimmed_mean", trim_fraction=0.2, screen_factor=0.0, clip_factor=0.0
    )
    new, _, _ = run(MeanAlg, replies, policy)
    assert new["model"]["w"].tolist() == [3.0, 0.0]  # mean of 2, 3, 4


def test_median_of_a_sum_algorithm_is_the_robust_sum():
    stats = {"stat": torch.tensor([[1.0, 2.0], [2.0, 2.0], [3.0, 900.0]], dtype=F64)}
    policy = AggregationPolicy(rule="median", screen_factor=0.0, clip_factor=0.0)
    new, _, _ = run(SumAlg, stats, policy)
    assert new["stat"].tolist() == [6.0, 6.0]  # 3 × coordinate median (2, 2)


def test_krum_scores_against_brute_force_and_selection():
    rng = np.random.default_rng(0)
    pts = np.vstack([rng.normal(0, 0.1, (5, 3)), [[8.0, 8.0, 8.0]]])
    f = 1
    scores = krum_scores(torch.tensor(pts), f).numpy()
    n = len(pts)
    for i in range(n):
        d = sorted(((pts[i] - pts[j]) ** 2).sum() for j in range(n) if j != i)
        assert scores[i] == pytest.approx(sum(d[: n - f - 2]))
    replies = {"model": {"w": torch.tensor(pts, dtype=F64)}}
    server = {"model": {"w": torch.zeros(3, dtype=F64)}}
    policy = AggregationPolicy(rule="krum", krum_byzantine=1, screen_factor=0, clip_factor=0)
    new, accepted, m = aggregate(
        MeanAlg(task=None), server, server, replies, torch.ones(n, dtype=F64), policy, 0
    )
    # Left out of the mean, but not rejected: its private state is kept.
    assert accepted.all() and m["krum_dropped"] == 1.0 and m["accepted"] == 5.0
    assert np.allclose(new["model"]["w"].numpy(), pts[:5].mean(0))


def test_weight_cap_bounds_a_declared_row_count():
    replies = rows([1.0, 0], [0, 1.0])
    # A FedAvg-style sample-weighted server; the second client claims 1e9 rows.
    alg = MeanAlg(task=None, sample_weighted=True)
    weights = torch.tensor([10.0, 1e9], dtype=F64)
    cap = torch.tensor([10.0, 30.0], dtype=F64)
    new, _, _ = aggregate(alg, SERVER, SERVER, replies, weights, PLAIN, 0, weight_cap=cap)
    assert torch.allclose(new["model"]["w"], torch.tensor([0.25, 0.75], dtype=F64))


def test_dp_noise_is_seeded_and_has_the_calibrated_scale():
    replies = rows([3.0, 4.0], [0.0, 1.0], [0.0, 0.0])  # norms 5, 1, 0
    policy = AggregationPolicy(dp_noise_multiplier=2.0, dp_clip=1.0)
    a, _, m = aggregate(MeanAlg(task=None), SERVER, SERVER, replies, torch.ones(3), policy, 42)
    b, _, _ = aggregate(MeanAlg(task=None), SERVER, SERVER, replies, torch.ones(3), policy, 42)
    c, _, _ = aggregate(MeanAlg(task=None), SERVER, SERVER, replies, torch.ones(3), policy, 43)
    assert torch.equal(a["model"]["w"], b["model"]["w"])
    assert not torch.equal(a["model"]["w"], c["model"]["w"])
    # Clipped to C = 1: (0.6, 0.8), (0, 1), (0, 0); noise σC·z from the round's generator.
    z = torch.randn(2, generator=torch.Generator().manual_seed(42), dtype=F64)
    expected = (torch.tensor([0.6, 1.8], dtype=F64) + 2.0 * z) / 3
    assert torch.allclose(a["model"]["w"], expected)
    assert m["dp_noise_std"] == 2.0


def test_custom_server_updates_refuse_coordinate_rules_and_dp():
    with pytest.raises(AggregationError, match="toy_custom: rule 'median'"):
        check_policy(CustomAlg(task=None), AggregationPolicy(rule="median"))
    with pytest.raises(AggregationError, match="DP"):
        check_policy(CustomAlg(task=None), AggregationPolicy(dp_noise_multiplier=1, dp_clip=1))
    check_policy(CustomAlg(task=None), AggregationPolicy(rule="krum"))  # allowed


def test_custom_gets_no_clipping():
    replies = rows([1.0, 0], [1.0, 0], [0, 1.0], [0, 5.0])
    policy = AggregationPolicy(screen_factor=0.0, clip_factor=3.0)
    new, _, _ = run(CustomAlg, replies, policy)
    assert torch.allclose(new["model"]["w"], torch.tensor([0.5, 1.5], dtype=F64))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rule": "mode"}, "AggregationPolicy rule: must be one of"),
        ({"clip_factor": 0.5}, "clip_factor"),
        ({"trim_fraction": 0.5}, "trim_fraction"),
        ({"dp_noise_multiplier": 1.0}, "clip bound"),
        ({"dp_noise_multiplier": 1.0, "dp_clip": 1.0, "rule": "median"}, "clipped mean"),
        ({"screen_factor": float("nan")}, "screen_factor"),
    ],
)
def test_policy_validation(kwargs, message):
    with pytest.raises(AggregationError, match=message):
        AggregationPolicy(**kwargs)


def test_a_sum_servers_statistics_are_never_clipped():
    # fedprior broadcasts and receives a leaf of the same name; a sum is never a model delta,
    # and scaling one unit's statistics would corrupt them (screening is what guards sums).
    server = {"stat": torch.tensor([100.0, 100.0], dtype=F64)}
    stats = {"stat": torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 5.0]], dtype=F64)}
    policy = AggregationPolicy(screen_factor=0.0, clip_factor=3.0)
    new, _, metrics = aggregate(SumAlg(task=None), server, server, stats, ONES4, policy, 0)
    assert new["stat"].tolist() == [2.0, 6.0] and "clipped" not in metrics


def test_units_of_other_sizes_are_not_outliers_but_a_poisoned_one_is():
    """Rows 384, 6, 6, 6: Gram sums grow with rows, a posterior mean does not."""
    rows = torch.tensor([384.0, 6.0, 6.0, 6.0], dtype=F64)
    gram = rows.unsqueeze(1) * torch.ones(4, 2, dtype=F64)  # grows with n
    mean = torch.ones(4, 2, dtype=F64)  # does not
    server = {"gram": torch.zeros(2, dtype=F64), "mean": torch.zeros(2, dtype=F64)}
    screen = AggregationPolicy(screen_factor=10.0, clip_factor=0.0)
    honest = {"gram": gram, "mean": mean}
    _, accepted, _ = aggregate(SumAlg(task=None), server, server, honest, rows, screen, 0)
    assert accepted.all()  # 64× the others' Gram sum, but not per row
    poisoned = {"gram": gram, "mean": mean.clone()}
    poisoned["mean"][2] *= 1000.0  # labels ×1000 on a small unit
    _, accepted, _ = aggregate(SumAlg(task=None), server, server, poisoned, rows, screen, 0)
    assert accepted.tolist() == [True, True, False, True]


def test_sum_statistics_are_sized_leaf_by_leaf():
    # A Gram-like leaf 1e9 times larger than the label-dependent leaf: joint norms would
    # hide a ×1000 poisoned right-hand side; per-leaf ratios to the median expose it.
    gram = torch.full((4, 2), 1e9, dtype=F64)
    rhs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1000.0, 0.0]], dtype=F64)
    server = {"gram": torch.zeros(2, dtype=F64), "rhs": torch.zeros(2, dtype=F64)}

    @dataclass(frozen=True)
    class Stats(SumAlg):
        def server_update(self, server, replies, weights):
            return {k: v.sum(0) for k, v in replies.items()}

    replies = {"gram": gram, "rhs": rhs}
    screen = AggregationPolicy(screen_factor=10.0, clip_factor=0.0)
    new, accepted, _ = aggregate(Stats(task=None), server, server, replies, ONES4, screen, 0)
    assert accepted.tolist() == [True, True, True, False]
    assert new["rhs"].tolist() == [2.0, 2.0] and new["gram"].tolist() == [3e9, 3e9]


def test_an_algorithm_may_refuse_rules_that_break_its_statistics():
    from fedcal.algorithms.fedprior import FedPrior

    assert FedPrior.robust_rules == ("mean", "krum")
    with pytest.raises(AggregationError, match="fedprior: rule 'median' is refused"):
        check_policy(FedPrior.__new__(FedPrior), AggregationPolicy(rule="median"))


def update_norms(updates, clients, refs=None):
    """Per-client L2 norm over every leaf, as aggregate computes it (blocks of clients)."""
    from fedcal.core.aggregation import _leaf_squares, _root_sum

    return _root_sum(_leaf_squares(updates, clients, refs).values(), clients)


def test_update_norms_in_blocks_of_clients_equal_the_whole_fleet_at_once():
    from fedcal.core.aggregation import NORM_BLOCK

    gen = torch.Generator().manual_seed(5)
    n = 2 * NORM_BLOCK + 3  # three blocks, the last partial
    updates = {
        "w": torch.randn(n, 16, 8, generator=gen) * torch.rand(n, 1, 1, generator=gen) * 100,
        "b": torch.randn(n, 8, generator=gen),
    }
    updates["w"][7, 2, 3] = float("nan")
    whole = sum(u.reshape(n, -1).double().pow(2).sum(1) for u in updates.values()).sqrt()
    got = update_norms(updates, n)
    assert torch.equal(got[~whole.isnan()], whole[~whole.isnan()])
    assert got.isnan().tolist() == [i == 7 for i in range(n)]  # NaN stays with its client
    # From the replies and their references, a block at a time: the same norms.
    refs = {"w": torch.randn(16, 8, generator=gen)}  # "b" absent: no reference
    replies = {"w": updates["w"] + refs["w"], "b": updates["b"]}
    formed = {"w": replies["w"] - refs["w"], "b": replies["b"]}
    assert torch.equal(
        update_norms(replies, n, refs).nan_to_num(-1), update_norms(formed, n).nan_to_num(-1)
    )


def test_finite_rows_judges_each_client_in_every_block():
    from fedcal.core.aggregation import NORM_BLOCK, finite_rows

    n = 2 * NORM_BLOCK + 5
    tree = {"a": {"w": torch.zeros(n, 3, 4)}, "b": torch.zeros(n), "i": torch.zeros(n, 2).long()}
    bad = [0, NORM_BLOCK - 1, NORM_BLOCK, n - 1]
    tree["a"]["w"][bad[0], 1, 2] = float("nan")
    tree["a"]["w"][bad[1], 0, 0] = float("inf")
    tree["b"][bad[2]] = float("-inf")
    tree["a"]["w"][bad[3], 2, 3] = float("nan")
    assert finite_rows(tree).tolist() == [i not in bad for i in range(n)]


@dataclass(frozen=True)
class ScalarAlg(MeanAlg):
    """A model plus a scalar leaf ``scale`` broadcast and replied: both are averaged."""

    name: ClassVar[str] = "toy_scalar"

    def server_update(self, server, replies, weights):
        return {"model": {"w": replies["model"]["w"].mean(0)}, "scale": replies["scale"].mean(0)}


def test_a_scalar_leaf_is_measured_against_its_broadcast_value():
    """A 0-dim leaf in broadcast and reply: its update is reply − broadcast, not the reply.

    Updates (w; scale − 5): (1, 0; 0), (0, 1; 0), (0, 0; 1), (0, 0; 5) → norms 1, 1, 1, 5,
    median (torch's lower middle) 1. Clip at 3 × 1: the last scale becomes 5 + 5·3/5 = 8,
    so the mean scale is (5 + 5 + 6 + 8) / 4 = 6. Measured as |reply|, the norms would be
    √26, √26, 6, 10 (median √26) and the last client not clipped (mean scale 6.5).
    """
    server = {"model": {"w": torch.zeros(2, dtype=F64)}, "scale": torch.tensor(5.0, dtype=F64)}
    replies = {
        "model": {"w": torch.tensor([[1.0, 0], [0, 1.0], [0, 0], [0, 0]], dtype=F64)},
        "scale": torch.tensor([5.0, 5.0, 6.0, 10.0], dtype=F64),
    }
    for policy in (PLAIN, AggregationPolicy(), AggregationPolicy(rule="krum")):
        new, accepted, m = aggregate(
            ScalarAlg(task=None), server, server, replies, ONES4, policy, 0
        )
        assert accepted.all() and m["median_update_norm"] == 1.0, policy
    new, _, m = aggregate(
        ScalarAlg(task=None), server, server, replies, ONES4, AggregationPolicy(), 0
    )
    assert m["clipped"] == 1.0 and new["scale"].item() == 6.0
    got = update_norms({"scale": replies["scale"]}, 4, {"scale": torch.tensor(5.0, dtype=F64)})
    assert got.tolist() == [0.0, 0.0, 1.0, 5.0]


class NewTensors(TorchDispatchMode):
    """Records the size (numel) of every tensor an op allocates (views and in-place excluded)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("policy", [AggregationPolicy(), PLAIN, AggregationPolicy(clip_factor=1.5)])
def test_the_mean_without_dp_forms_no_fleet_sized_update(policy):
    """Default policy (screen + clip), PLAIN, clip only: nothing of the fleet's size is made,
    except one copy of a leaf in which a client is clipped (its rows rewritten there)."""
    from fedcal.core.aggregation import NORM_BLOCK

    n = 3 * NORM_BLOCK + 10
    gen = torch.Generator().manual_seed(3)
    broadcast = {"model": {"w": torch.randn(8, 8, generator=gen), "b": torch.zeros(8)}}
    replies = {
        "model": {
            "w": broadcast["model"]["w"] + 0.01 * torch.randn(n, 8, 8, generator=gen),
            "b": 0.01 * torch.randn(n, 8, generator=gen),
        }
    }
    block = NORM_BLOCK * 64  # the largest temporary allowed: one block of w's rows
    for clipped in (None, 5):
        if clipped is not None:
            w = replies["model"]["w"].clone()
            w[clipped] = broadcast["model"]["w"] + 5 * (w[clipped] - broadcast["model"]["w"])
            replies = {"model": {**replies["model"], "w": w}}
        probe = NewTensors()
        with probe:
            new, accepted, m = aggregate(
                MeanAlg(task=None), broadcast, broadcast, replies, torch.ones(n), policy, 0
            )
        large = [s for s in probe.sizes if s > block]
        shown = policy.clip_factor > 0 and clipped is not None
        assert accepted.all() and m.get("clipped", 0.0) == float(shown)
        assert large == ([n * 64] if shown else []), (policy, clipped, large)
        # The aggregate is the mean of the replies, the clipped one brought to the bound.
        ref = broadcast["model"]["w"]
        dw, db = replies["model"]["w"] - ref, replies["model"]["b"]
        norms = (dw.double().pow(2).sum((1, 2)) + db.double().pow(2).sum(1)).sqrt()
        factor = torch.ones(n, dtype=F64)
        if shown:
            factor[clipped] = m["clip_bound"] / norms[clipped]
        expected = ref + (dw.double() * factor.reshape(n, 1, 1)).mean(0)
        assert torch.allclose(new["model"]["w"].double(), expected, atol=1e-6)
        assert torch.allclose(new["model"]["b"].double(), (db * factor.reshape(n, 1)).mean(0))


def _sum_round(name: str, train: list[int]):
    """One round of a registered "sum" algorithm on a toy fleet: (alg, server, down, replies,
    counts)."""
    from fedcal.algorithms import REGISTRY
    from fedcal.core.data import client_round_seed
    from fedcal.core.task import Task
    from fedcal.core.tree import expand
    from fedcal.engine.simulation import prepare
    from fedcal.models.mlp import MLP
    from tests.conftest import toy_fleet

    fleet = prepare(toy_fleet(num_clients=len(train), train=train), dtype="float64")
    alg = REGISTRY[name](Task(MLP(hidden=(5, 4))))
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), F64))
    down = alg.broadcast(server)
    n = len(train)
    data = fleet.train.with_seeds(tuple(client_round_seed(0, 0, c) for c in range(n)))
    reply = alg.client_update(expand(down, n), alg.client_init(expand(down, n)), data)
    return alg, server, down, reply.reply, data.count.to(F64)


def _times(replies: dict, client: int, factor: float) -> dict:
    from fedcal.core.tree import flatten, unflatten

    out = {}
    for key, leaf in flatten(replies).items():
        leaf = leaf.clone()
        if leaf.is_floating_point():
            leaf[client] = leaf[client] * factor
        out[key] = leaf
    return unflatten(out)


@pytest.mark.parametrize("name", ["fedpoly", "fedprior"])
def test_mixed_384_and_6_row_fleet_keeps_every_honest_unit_and_rejects_a_x1000_one(name):
    """Issue 20: 4 reference units (384 rows) and 4 new ones (6 rows), real replies.

    fedpoly's 6-row units project to sums of ≈ 1e-9 (7 private terms, 6 points): judged
    against the plain median the reference units were 10⁹ times too large and rejected."""
    train = [384] * 4 + [6] * 4
    alg, server, down, replies, counts = _sum_round(name, train)
    screen = AggregationPolicy()  # the default: screen at 10× the cohort's scale
    record: list = []
    _, accepted, _ = aggregate(alg, server, down, replies, counts, screen, 0, record=record)
    assert accepted.all() and record == []
    for client in (0, 5):  # a reference unit, a new unit
        poisoned = _times(replies, client, 1000.0)
        record = []
        _, accepted, _ = aggregate(alg, server, down, poisoned, counts, screen, 0, record=record)
        if name == "fedpoly" and client == 5:
            # a 6-point unit's fedpoly sums are ≈ 0 (no residual degree of freedom): ×1000
            # leaves them ≈ 0, they move nothing, and nothing is rejected
            assert accepted.all()
            continue
        assert accepted.tolist() == [i != client for i in range(8)], (name, client)
        assert [r["client"] for r in record] == [client]
        assert record[0]["reason"] == "size" and record[0]["threshold"] == 10.0
        # fedpoly's screen judges the unit's fit RMS √(rᵀA⁺r/n) (issue 34.3): A and r both
        # × 1000 move it by √1000 (targets × 1000 would move it by 1000)
        assert record[0]["ratio"] > (0.9 * 1000**0.5 if name == "fedpoly" else 100.0)


def test_the_old_rule_rejected_the_reference_units_of_a_mixed_fleet():
    """The cause, shown: with a single row count (the old plain-median rule) the fedpoly
    reference units are 10⁹ × the median and all rejected; with their counts all pass."""
    alg, server, down, replies, counts = _sum_round("fedpoly", [384] * 4 + [6] * 4)
    screen = AggregationPolicy()
    _, accepted, _ = aggregate(alg, server, down, replies, torch.ones(8, dtype=F64), screen, 0)
    assert accepted.tolist() == [False] * 4 + [True] * 4
    _, accepted, _ = aggregate(alg, server, down, replies, counts, screen, 0)
    assert accepted.all()


def test_a_sensor_with_100x_the_rows_passes_and_a_x1000_sensor_does_not():
    """Planted statistics of 9 sensors; sensor 0 has 100× the rows of the others."""
    rows = torch.tensor([600.0] + [6.0] * 8, dtype=F64)
    rng = np.random.default_rng(0)
    jitter = torch.tensor(rng.uniform(0.8, 1.25, (9, 3)), dtype=F64)
    replies = {
        "gram": rows.unsqueeze(1) * jitter,  # grows with n
        "mean": jitter.flip(0),  # does not (a posterior mean)
        "rss": rows.sqrt().unsqueeze(1) * jitter[:, :1],  # grows slower than n
    }
    server = {k: torch.zeros(v.shape[1:], dtype=F64) for k, v in replies.items()}
    screen = AggregationPolicy(screen_factor=10.0, clip_factor=0.0)
    _, accepted, _ = aggregate(SumAlg(task=None), server, server, replies, rows, screen, 0)
    assert accepted.all()
    for client in (0, 3):
        poisoned = {k: v.clone() for k, v in replies.items()}
        for v in poisoned.values():
            v[client] *= 1000.0
        record: list = []
        _, accepted, _ = aggregate(
            SumAlg(task=None), server, server, poisoned, rows, screen, 0, record=record
        )
        assert accepted.tolist() == [i != client for i in range(9)], client
        assert record[0]["client"] == client and record[0]["ratio"] > 100.0


def test_a_non_finite_rejection_is_recorded_with_its_reason():
    record: list = []
    run(MeanAlg, rows([1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0]), PLAIN, record=record)
    assert record == [
        {"client": 1, "reason": "non-finite reply", "ratio": record[0]["ratio"], "threshold": 0.0}
    ]
    assert np.isnan(record[0]["ratio"])


def test_weighted_median_of_others_against_brute_force():
    from fedcal.core.aggregation import weighted_median_of_others

    rng = np.random.default_rng(1)
    for n in (2, 3, 5, 8):
        values = torch.tensor(rng.integers(0, 6, n).astype(float), dtype=F64)
        weights = torch.tensor(rng.integers(1, 50, n).astype(float), dtype=F64)
        got = weighted_median_of_others(values, weights)
        for i in range(n):
            keep = [j for j in range(n) if j != i]
            v, w = values[keep], weights[keep]
            order = v.argsort(stable=True)
            cum = w[order].cumsum(0)
            expected = v[order][int((cum >= 0.5 * cum[-1]).nonzero()[0])]
            assert got[i] == expected, (n, i)

"""Each aggregation stage on a tiny cohort, against values computed by hand; the chain per policy.

The cohort: 4 clients, a 2-leaf tree. ``model/w`` has a broadcast value (1, 1), so its
update is reply − (1, 1); ``model/b`` has none, so its update is the reply itself.

    client   w           Δw        b    ‖Δ‖
    0        (4, 5)      (3, 4)    0    5
    1        (1, 1)      (0, 0)    2    2
    2        (1, 2)      (0, 1)    0    1
    3        (2, 1)      (1, 0)    0    1

The median norm (torch's lower middle of 1, 1, 2, 5) is 1.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import pytest
import torch

from fedcal.core import stages
from fedcal.core.aggregation import (
    PLAIN,
    AggregationError,
    AggregationPolicy,
    aggregate,
    chain,
)
from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.privacy import Statistic, private_sums
from fedcal.core.stages import Cohort, Round

F64 = torch.float64
BROADCAST = {"model": {"w": torch.tensor([1.0, 1.0], dtype=F64)}}


def replies() -> dict:
    return {
        "model/w": torch.tensor([[4.0, 5.0], [1.0, 1.0], [1.0, 2.0], [2.0, 1.0]], dtype=F64),
        "model/b": torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=F64),
    }


def start(
    flat=None, kind="mean", unscreened=(), weights=None, broadcast=BROADCAST, **kw
) -> tuple[Cohort, Round]:
    flat = replies() if flat is None else flat
    n = len(next(iter(flat.values())))
    weights = torch.ones(n, dtype=F64) if weights is None else weights
    rnd = Round.of(broadcast, flat, kind, unscreened, **kw)
    return Cohort(flat, weights, torch.ones(n, dtype=torch.bool)), rnd


def measured(**kw) -> tuple[Cohort, Round]:
    cohort, rnd = start(**kw)
    return stages.run([stages.reject_nonfinite, stages.measure], cohort, rnd), rnd


def test_the_non_finite_check_rejects_exactly_the_planted_clients_and_says_why():
    flat = replies()
    flat["model/w"][0, 1] = float("inf")
    flat["model/b"][2] = float("nan")
    cohort, rnd = start(flat)
    out = stages.reject_nonfinite(cohort, rnd)
    assert out.accepted.tolist() == [False, True, False, True]
    assert out.metrics == {"rejected_nonfinite": 2.0}
    assert [(r["client"], r["reason"], r["threshold"]) for r in out.rejections] == [
        (0, "non-finite reply", 0.0),
        (2, "non-finite reply", 0.0),
    ]
    assert all(math.isnan(r["ratio"]) for r in out.rejections)
    # A client the engine already rejected (its state) is recorded with the wider reason.
    cohort, rnd = start(state_checked=True)
    cohort = cohort.but(accepted=torch.tensor([True, True, True, False]))
    out = stages.reject_nonfinite(cohort, rnd)
    assert [(r["client"], r["reason"]) for r in out.rejections] == [
        (3, "non-finite reply or state")
    ]


def test_measure_gives_the_norms_of_the_table_and_their_median():
    cohort, _ = measured()
    assert cohort.norms.tolist() == [5.0, 2.0, 1.0, 1.0]
    assert cohort.metrics["median_update_norm"] == 1.0
    assert cohort.squares["model/w"].tolist() == [25.0, 0.0, 1.0, 1.0]
    assert cohort.squares["model/b"].tolist() == [0.0, 4.0, 0.0, 0.0]


def test_screen_rejects_exactly_the_planted_outlier_and_records_its_ratio():
    cohort, rnd = measured()
    out = stages.screen(cohort, rnd, factor=4.0)  # sizes 5, 2, 1, 1 (× the median 1)
    assert out.accepted.tolist() == [False, True, True, True]
    assert out.metrics["rejected_norm"] == 1.0
    assert out.rejections == ({"client": 0, "reason": "size", "ratio": 5.0, "threshold": 4.0},)
    assert stages.screen(cohort, rnd, factor=5.0).accepted.all()  # 5 is not above 5


def test_an_unscreened_leaf_does_not_judge_a_client():
    # model/b unscreened: sizes from Δw alone, 5, 0, 1, 1 over the median 1 (lower middle).
    cohort, rnd = measured(unscreened=("model/b",))
    assert rnd.judged == ("model/w",)
    out = stages.screen(cohort, rnd, factor=1.5)
    assert out.accepted.tolist() == [False, True, True, True]
    assert out.rejections[0]["ratio"] == 5.0


def test_screening_sums_per_leaf_and_per_row_by_hand():
    """Rows 10, 1, 1, 1. Leaf s: norms a = 10, 1, 1, 50 (client 0 has 10× the rows, client 3
    is poisoned); per row b = 1, 1, 1, 50. Leaf t: norms 1, 1, 1, 1; per row 0.1, 1, 1, 1.

    s as it is: a / median(a) = 10, 1, 1, 50; a / rows-weighted median of the others
    = 10/1, 1/10, 1/10, 50/10 → the smaller: 10, 0.1, 0.1, 5. s per row: b / median(b) =
    1, 1, 1, 50 and b / others' = 1, 1, 1, 50. The leaf's size: the smaller of the two,
    1, 0.1, 0.1, 5. t: min(1, ·) of its per-row ratios 0.1, 1, 1, 1 → 0.1, 1, 1, 1. The
    client's size: the larger over leaves, 1, 1, 1, 5."""
    flat = {
        "s": torch.tensor([[10.0, 0.0], [1.0, 0.0], [1.0, 0.0], [50.0, 0.0]], dtype=F64),
        "t": torch.ones(4, 1, dtype=F64),
    }
    rows = torch.tensor([10.0, 1.0, 1.0, 1.0], dtype=F64)
    sizes = stages.statistic_sizes(flat, torch.ones(4, dtype=torch.bool), rows)
    assert sizes.tolist() == [1.0, 1.0, 1.0, 5.0]
    cohort, rnd = start(flat, kind="sum", weights=rows)
    cohort = stages.measure(stages.reject_nonfinite(cohort, rnd), rnd)
    out = stages.screen(cohort, rnd, factor=4.0)
    assert out.accepted.tolist() == [True, True, True, False]
    assert out.rejections == ({"client": 3, "reason": "size", "ratio": 5.0, "threshold": 4.0},)


def test_form_updates_subtracts_the_broadcast_only_from_model_leaves():
    cohort, rnd = measured()
    kept = {k: v.clone() for k, v in cohort.replies.items()}
    out = stages.form_updates(cohort, rnd)
    assert out.updates["model/w"].tolist() == [[3.0, 4.0], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert out.updates["model/b"].tolist() == [0.0, 2.0, 0.0, 0.0]
    assert all(torch.equal(cohort.replies[k], kept[k]) for k in kept)  # never in place


def test_adaptive_clip_scales_to_the_hand_computed_bound():
    """factor 1.5 × median 1 = bound 1.5: client 0 (‖Δ‖ 5) × 0.3, client 1 (2) × 0.75."""
    cohort, rnd = measured()
    out = stages.clip_adaptive(cohort, rnd, factor=1.5)
    assert out.metrics["clip_bound"] == 1.5 and out.metrics["clipped"] == 2.0
    rows, weights = out.rows(rnd)
    assert torch.allclose(rows["model/w"][0], torch.tensor([1.9, 2.2], dtype=F64))
    assert rows["model/b"].tolist() == [0.0, 1.5, 0.0, 0.0]
    clipped = ((rows["model/w"] - 1.0).pow(2).sum(1) + rows["model/b"].pow(2)).sqrt()
    assert torch.allclose(clipped, torch.tensor([1.5, 1.5, 1.0, 1.0], dtype=F64))
    # Rows not clipped are their replies bit for bit; the replies are not written into.
    assert torch.equal(rows["model/w"][1:], replies()["model/w"][1:])
    assert torch.equal(out.replies["model/w"], replies()["model/w"])
    assert weights.tolist() == [1.0] * 4


def test_the_fixed_bound_clips_only_norms_above_it():
    cohort, rnd = measured()
    cohort = stages.form_updates(cohort, rnd)
    out = stages.clip_to_bound(cohort, rnd, bound=2.0)  # 5 → × 0.4; 2 is not above 2
    assert out.clip.tolist() == [True, False, False, False]
    assert torch.allclose(out.updates["model/w"][0], torch.tensor([1.2, 1.6], dtype=F64))
    rows, _ = out.rows(rnd)
    assert torch.allclose(rows["model/w"][0], torch.tensor([2.2, 2.6], dtype=F64))
    assert out.metrics == {**cohort.metrics, "clip_bound": 2.0, "clipped": 1.0}


def krum_cohort() -> tuple[Cohort, Round]:
    """Updates (Δw, b) at the corners of the unit square and one at (10, 10)."""
    flat = {
        "model/w": torch.tensor([[1.0], [2.0], [1.0], [2.0], [11.0]], dtype=F64),
        "model/b": torch.tensor([0.0, 0.0, 1.0, 1.0, 10.0], dtype=F64),
    }
    bc = {"model": {"w": torch.tensor([1.0], dtype=F64)}}
    rnd = Round.of(bc, flat)
    cohort = Cohort(flat, torch.ones(5, dtype=F64), torch.ones(5, dtype=torch.bool))
    return stages.form_updates(stages.measure(cohort, rnd), rnd), rnd


def test_krum_scores_and_selection_by_hand():
    """f = 1, n = 5: s(i) sums the n − f − 2 = 2 nearest squared distances. A corner: 1 + 1
    = 2; the far point: (9² + 9²) + (9² + 10²) = 162 + 181 = 343. Multi-Krum keeps n − f = 4."""
    cohort, rnd = krum_cohort()
    flat = torch.cat([cohort.updates["model/w"], cohort.updates["model/b"][:, None]], 1)
    assert stages.krum_scores(flat, 1).tolist() == [2.0, 2.0, 2.0, 2.0, 343.0]
    out = stages.krum(cohort, rnd, byzantine=1, select=0)
    assert out.used.tolist() == [True, True, True, True, False]
    assert out.accepted.all() and out.metrics["krum_dropped"] == 1.0  # dropped, not rejected
    two = stages.krum(cohort, rnd, byzantine=1, select=2)  # ties: the lower index first
    assert two.used.tolist() == [True, True, False, False, False]
    rows, weights = out.rows(rnd)
    assert rows["model/b"].tolist() == [0.0, 0.0, 1.0, 1.0] and len(weights) == 4


def test_coordinate_median_and_trimmed_mean_by_hand():
    cohort, rnd = krum_cohort()
    # Median of Δw 0, 1, 0, 1, 10 → 1 (w = 2); of b 0, 0, 1, 1, 10 → 1.
    out = stages.coordinate(cohort, rnd, rule="median", trim=0.0)
    rows, _ = out.rows(rnd)
    assert rows["model/w"].tolist() == [[2.0]] * 5 and rows["model/b"].tolist() == [1.0] * 5
    # Trimmed 20 %: one cut at each end → Δw mean(0, 1, 1) = 2/3; b mean(0, 1, 1) = 2/3.
    out = stages.coordinate(cohort, rnd, rule="trimmed_mean", trim=0.2)
    rows, _ = out.rows(rnd)
    assert torch.allclose(rows["model/w"], torch.full((5, 1), 1 + 2 / 3, dtype=F64))
    assert torch.allclose(rows["model/b"], torch.full((5,), 2 / 3, dtype=F64))
    # Over the used clients only: client 4 rejected → even cohort, the middle pair's mean.
    out = stages.coordinate(
        cohort.but(accepted=torch.tensor([True] * 4 + [False])), rnd, rule="median", trim=0.0
    )
    rows, _ = out.rows(rnd)
    assert rows["model/w"].tolist() == [[1.5]] * 4 and rows["model/b"].tolist() == [0.5] * 4


def test_gaussian_noise_has_the_declared_scale_over_many_seeded_draws():
    """σ = 2, C = 0.5: noise std σC = 1 on the sum; the noisy mean of k = 4 zero updates is
    z/4. Leaves of 2000 and 1 coordinates, 20 rounds: 40,020 draws of 4 × (row − ref). Their
    sample std is 1 within 0.03 (its standard error is 1/√80040 ≈ 0.0035: 8.5 of them; a
    scale off by 5 % fails) and their mean 0 within 0.03."""
    flat = {
        "model/w": torch.ones(4, 2000, dtype=F64),  # Δw = 0 (the broadcast is 1)
        "model/b": torch.zeros(4, dtype=F64),
    }
    draws = []
    for seed in range(20):
        cohort, rnd = start(flat, seed=seed, broadcast={"model": {"w": torch.ones(2000)}})
        cohort = stages.form_updates(stages.measure(cohort, rnd), rnd)
        out = stages.gaussian_noise(cohort, rnd, multiplier=2.0, bound=0.5)
        rows, weights = out.rows(rnd)
        draws.append(torch.cat([4 * (rows["model/w"][0] - 1.0), 4 * rows["model/b"][:1]]))
        assert torch.equal(rows["model/w"][0], rows["model/w"][3])  # replicated
    z = torch.cat(draws)
    assert abs(float(z.std()) - 1.0) < 0.03 and abs(float(z.mean())) < 0.03
    assert out.metrics["dp_noise_std"] == 1.0 and weights.tolist() == [1.0] * 4
    # Seeded: the same round draws the same noise, another round other noise.
    again = stages.gaussian_noise(cohort, rnd, multiplier=2.0, bound=0.5)
    assert torch.equal(again.rows(rnd)[0]["model/w"], rows["model/w"])
    other = stages.gaussian_noise(
        cohort, dataclasses.replace(rnd, seed=7), multiplier=2.0, bound=0.5
    )
    assert not torch.equal(other.rows(rnd)[0]["model/w"], rows["model/w"])


def test_private_statistics_replicates_the_private_sums():
    """Statistics s (3, 2) and t (3, 1), bound 1 each. Without noise: s clipped to (0.6, 0.8),
    (0, 1), (0, 0) → sum (0.6, 1.8); t (2, 0.5, −3) clipped to (1, 0.5, −1) → sum 0.5; each
    row holds the sum / 3. With noise: exactly private_sums with the round's generator."""
    flat = {
        "s": torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]], dtype=F64),
        "t": torch.tensor([[2.0], [0.5], [-3.0]], dtype=F64),
    }
    declared = {"s": Statistic(bound=1.0), "t": Statistic(bound=1.0)}
    cohort, rnd = start(flat, kind="sum", seed=3)
    cohort = stages.form_updates(stages.measure(cohort, rnd), rnd)
    out = stages.private_statistics(cohort, rnd, lambda down: declared, 0.0, 1.0)
    rows, _ = out.rows(rnd)
    assert torch.allclose(rows["s"], torch.tensor([[0.2, 0.6]] * 3, dtype=F64))
    assert torch.allclose(rows["t"], torch.full((3, 1), 0.5 / 3, dtype=F64))
    noisy = stages.private_statistics(cohort, rnd, lambda down: declared, 1.5, 2.0)
    sums, metrics = private_sums(flat, declared, 1.5, torch.Generator().manual_seed(3), 2.0)
    rows, _ = noisy.rows(rnd)
    assert all(torch.equal(rows[k], (sums[k] / 3).expand(3, *sums[k].shape)) for k in flat)
    assert noisy.metrics["dp_noise_std"] == 3.0 and metrics.items() <= noisy.metrics.items()


@dataclass(frozen=True)
class Mean(Algorithm):
    name: ClassVar[str] = "toy_mean"

    def client_update(self, down, state, data):  # never called here
        return ClientResult({}, {}, {})


@dataclass(frozen=True)
class Sums(Mean):
    name: ClassVar[str] = "toy_sum"
    reply_aggregation: ClassVar[str] = "sum"


@dataclass(frozen=True)
class Declares(Sums):
    name: ClassVar[str] = "toy_declared"

    def dp_statistics(self, down):
        return {}


@dataclass(frozen=True)
class Custom(Mean):
    name: ClassVar[str] = "toy_custom"
    reply_aggregation: ClassVar[str] = "custom"


DP = {"dp_noise_multiplier": 1.0, "dp_clip": 1.0}


@pytest.mark.parametrize(
    "alg, policy, names",
    [
        (Mean, PLAIN, ()),
        (Mean, AggregationPolicy(), ("screen", "clip")),
        (Sums, AggregationPolicy(), ("screen",)),  # statistics are never clipped
        (Custom, AggregationPolicy(rule="krum"), ("screen", "form_updates", "krum")),
        (Mean, AggregationPolicy(rule="median"), ("screen", "form_updates", "clip", "median")),
        (Mean, AggregationPolicy(**DP), ("form_updates", "clip", "gaussian_noise")),
        (Sums, AggregationPolicy(**DP), ("form_updates", "clip", "gaussian_noise")),
        (Declares, AggregationPolicy(**DP), ("form_updates", "private_statistics")),
    ],
)
def test_the_chain_of_each_policy(alg, policy, names):
    got = tuple(s.name for s in chain(policy, alg(task=None)))
    assert got == ("reject_nonfinite", "measure", *names)


def test_a_refused_policy_builds_no_chain():
    with pytest.raises(AggregationError, match="toy_custom: rule 'median'"):
        chain(AggregationPolicy(rule="median"), Custom(task=None))


def test_the_whole_chain_by_hand():
    """Screen 4, clip 1.5 on the table: client 0 (size 5) out; over 1, 2, 3 the median norm
    is 1, client 1 (2) × 0.75 → b = 1.5. Mean: w = ((1, 1) + (1, 2) + (2, 1)) / 3, b = 0.5."""
    flat = replies()
    tree = {"model": {"w": flat["model/w"], "b": flat["model/b"]}}
    policy = AggregationPolicy(screen_factor=4.0, clip_factor=1.5)
    record: list = []
    new, accepted, m = aggregate(
        Mean(task=None), BROADCAST, BROADCAST, tree, torch.ones(4), policy, 0, record=record
    )
    assert accepted.tolist() == [False, True, True, True]
    assert torch.allclose(new["model"]["w"], torch.tensor([4 / 3, 4 / 3], dtype=F64))
    assert torch.allclose(new["model"]["b"], torch.tensor(0.5, dtype=F64))
    assert m == {
        "rejected_nonfinite": 0.0,
        "rejected_norm": 1.0,
        "median_update_norm": 1.0,
        "clip_bound": 1.5,
        "clipped": 1.0,
        "accepted": 3.0,
    }
    assert [r["client"] for r in record] == [0]
    assert torch.equal(tree["model"]["w"], replies()["model/w"])  # nothing written into


def test_stages_compose_as_partials():
    """A stage is a plain function: a partial with its setting slots into a chain."""
    cohort, rnd = start()
    steps = [stages.reject_nonfinite, stages.measure, partial(stages.screen, factor=4.0)]
    assert stages.run(steps, cohort, rnd).accepted.tolist() == [False, True, True, True]

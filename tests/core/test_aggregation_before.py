"""aggregate's outputs equal those of the code before the default policy's fast path.

``aggregate_before`` (bottom of this file) is a frozen copy of ``core.aggregation.aggregate``
and the helpers it changed (``_updates``, ``update_norms``, ``relative_sizes``) at commit
7be0e50, before "mean" rules without DP stopped forming the fleet's updates. Real replies
of registered algorithms (one round on a toy fleet, float64 and float32), with an outlier,
a clipped client, a non-finite client, a client the engine rejects, capped weights, go
through both under every kind of policy; new server trees, ``accepted`` and the metrics
must be equal (``torch.equal``; NaN where NaN). The old code measured a 0-dim leaf with a
reference as |reply|; no algorithm here has one (see test_aggregation.py for that fix).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import Tensor

from fedcal.algorithms import REGISTRY
from fedcal.core.aggregation import (
    PLAIN,
    AggregationPolicy,
    aggregate,
    check_policy,
    coordinate_rule,
    finite_rows,
    krum_scores,
)
from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import client_round_seed
from fedcal.core.task import Task
from fedcal.core.tree import Tree, expand, flatten, unflatten
from fedcal.engine.simulation import prepare
from fedcal.models.mlp import MLP

CLIENTS = 7
# mean (full, partial and mixed with unreferenced leaves), custom, sum (screened per leaf,
# with unscreened leaves and per-statistic DP), and one without floating replies.
ALGORITHMS = [
    "fedavg",
    "fedgmi",
    "fedrep",
    "layerchoice",
    "fedkd",
    "aflcsem",
    "fedprior",
    "fedpoly",
    "local",
]
POLICIES = {
    "default": AggregationPolicy(),
    "plain": PLAIN,
    "screen_only": AggregationPolicy(clip_factor=0.0),
    "clip_only": AggregationPolicy(screen_factor=0.0),
    "tight": AggregationPolicy(screen_factor=2.0, clip_factor=1.2),
    "krum": AggregationPolicy(rule="krum"),
    "krum_plain": AggregationPolicy(rule="krum", screen_factor=0.0, clip_factor=0.0),
    "median": AggregationPolicy(rule="median"),
    "trimmed_mean": AggregationPolicy(rule="trimmed_mean", trim_fraction=0.2, clip_factor=1.5),
    "dp": AggregationPolicy(dp_noise_multiplier=1.0, dp_clip=0.05),
}
# (scale factors of a client's update, non-finite clients, clients the engine rejects, cap)
SCENARIOS = {
    "honest": ({}, (), (), False),
    "outlier": ({2: 300.0}, (), (), False),
    "clipped": ({4: 6.0}, (), (), False),
    "outlier_and_clipped": ({2: 300.0, 5: 6.0}, (), (), False),
    "non_finite": ({}, (3,), (), False),
    "ineligible_and_clipped": ({1: 6.0}, (), (0, 6), False),
    "capped_weights": ({4: 6.0}, (), (), True),
    "all_non_finite": ({}, tuple(range(CLIENTS)), (), False),
}


@functools.cache
def one_round(name: str, dtype: str, make_fleet) -> tuple:
    """(algorithm, server, broadcast, replies, counts) after one round of 7 toy sensors."""
    fleet = prepare(make_fleet(num_clients=CLIENTS, train=[11, 6, 9, 14, 8, 12, 7]), dtype=dtype)
    # fedprior's own checks and outlier weights (issue 21, tests/core/test_robust.py) are a
    # deliberate change of its M-step: "off" is the aggregation compared here.
    extra = {"robust": "off"} if name == "fedprior" else {}
    alg = REGISTRY[name](Task(MLP(hidden=(5, 4))), local_epochs=1, batch_size=4, **extra)
    params = alg.task.model.init(torch.Generator().manual_seed(0), getattr(torch, dtype))
    server = alg.server_init(params)
    down = alg.broadcast(server)
    seeds = tuple(client_round_seed(0, 0, c) for c in range(CLIENTS))
    data = fleet.train.with_seeds(seeds)
    reply = alg.client_update(expand(down, CLIENTS), alg.client_init(expand(down, CLIENTS)), data)
    return alg, server, down, reply.reply, data.count


def perturbed(alg, down: Tree, replies: Tree, scale: dict, nan: tuple) -> Tree:
    """Client c's update (reply − broadcast, or the reply) × scale[c]; NaN in each of ``nan``."""
    ref = flatten(down) if getattr(alg, "reply_aggregation", "mean") != "sum" else {}
    out = {}
    for key, leaf in flatten(replies).items():
        leaf = leaf.clone()
        if leaf.is_floating_point():
            base = ref.get(key)
            base = base if base is not None and base.shape == leaf.shape[1:] else None
            for c, f in scale.items():
                leaf[c] = leaf[c] * f if base is None else base + f * (leaf[c] - base)
            for c in nan:
                leaf[(c,) + (0,) * (leaf.dim() - 1)] = float("nan")
        out[key] = leaf
    return unflatten(out)


def same(a, b) -> bool:
    """Equal values, dtypes and shapes (NaN equal to NaN), or equal floats."""
    if isinstance(a, Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    return a == b or (a != a and b != b)


def outcome(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as error:  # the same refusal either way
        return type(error), str(error)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ALGORITHMS)
def test_aggregate_equals_the_code_before(name, policy, dtype, make_fleet):
    alg, server, down, replies, counts = one_round(name, dtype, make_fleet)
    rules = POLICIES[policy]
    try:
        check_policy(alg, rules)
        refusal = None
    except ValueError as error:  # a refused pair: both codes must refuse it, the same way
        refusal = (type(error), str(error))
    if getattr(alg, "reply_aggregation", "mean") == "sum" and rules.screen_factor > 0:
        # Screening of summed statistics changed on purpose (issue 20, item 3): with unequal
        # row counts a client is judged against the median over clients and over rows
        # (statistic_sizes), so honest data-rich units are no longer rejected. With equal
        # counts the rule is the old one exactly: those cases are compared here; the new
        # rule's behaviour is tested in test_aggregation.py.
        counts = torch.full_like(counts, 9)
    exercised = {"clipped": 0.0, "rejected_norm": 0.0}
    for scenario, (scale, nan, ineligible, cap) in SCENARIOS.items():
        tree = perturbed(alg, down, replies, scale, nan)
        kept = {k: v.clone() for k, v in flatten(tree).items()}
        eligible = torch.ones(CLIENTS, dtype=torch.bool)
        eligible[list(ineligible)] = False
        kw = {"eligible": eligible if ineligible else None}
        if cap:
            kw["weight_cap"] = torch.full((CLIENTS,), 9.0, dtype=torch.float64)
        args = (alg, server, down, tree, counts, rules, 11)
        new, before = outcome(aggregate, *args, **kw), outcome(aggregate_before, *args, **kw)
        where = f"{name} {policy} {dtype} {scenario}"
        assert type(new) is type(before), (where, new, before)
        if not isinstance(new[0], dict):
            assert new == before, where  # the same exception
            assert refusal is None or new == refusal, where
            continue
        assert refusal is None, (where, "accepted a refused policy")
        (tree_new, acc_new, m_new), (tree_old, acc_old, m_old) = new, before
        f_new, f_old = flatten(tree_new), flatten(tree_old)
        assert f_new.keys() == f_old.keys(), where
        for k in f_old:
            assert same(f_new[k], f_old[k]), (where, k)
        assert torch.equal(acc_new, acc_old), where
        assert m_new.keys() == m_old.keys(), where
        for k in m_old:
            assert same(m_new[k], m_old[k]), (where, k, m_new[k], m_old[k])
        # aggregate never writes into the replies it was given
        assert all(
            torch.equal(v.nan_to_num(7.0), kept[k].nan_to_num(7.0))
            for k, v in flatten(tree).items()
        ), where
        for key in exercised:
            exercised[key] += m_old.get(key, 0.0)
    # The scenarios reach the paths they name: some client clipped, some screened out.
    if refusal is None and policy == "default" and name not in ("local",):
        assert exercised["rejected_norm"] > 0, name
        if getattr(alg, "reply_aggregation", "mean") == "mean":
            assert exercised["clipped"] > 0, name


@dataclass(frozen=True)
class Unscreened(Algorithm):
    """A mean of ``model`` whose ``aux/`` replies do not judge a client (as fedprior's cand/)."""

    name: ClassVar[str] = "toy_unscreened"
    unscreened_replies: ClassVar[tuple[str, ...]] = ("aux/",)

    def client_update(self, down, state, data):  # never called here
        return ClientResult({}, {}, {})

    def server_update(self, server, replies, weights):
        return {"model": {"w": replies["model"]["w"].mean(0)}, "aux": replies["aux"]["v"].mean(0)}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_unscreened_leaves_of_a_mean_equal_the_code_before(policy):
    """Client 1's unscreened leaf is 1000× the others' (kept); client 4's model 300× (out)."""
    gen = torch.Generator().manual_seed(2)
    server = {"model": {"w": torch.randn(3, 2, generator=gen, dtype=torch.float64)}}
    w = server["model"]["w"] + 0.1 * torch.randn(CLIENTS, 3, 2, generator=gen, dtype=torch.float64)
    aux = {"v": torch.randn(CLIENTS, 4, generator=gen, dtype=torch.float64)}
    aux["v"][1] *= 1000.0
    w[4] = server["model"]["w"] + 300 * (w[4] - server["model"]["w"])
    w[6] = server["model"]["w"] + 4 * (w[6] - server["model"]["w"])
    replies = {"model": {"w": w}, "aux": aux}
    counts = torch.arange(1.0, CLIENTS + 1, dtype=torch.float64)
    args = (Unscreened(task=None), server, server, replies, counts, POLICIES[policy], 5)
    new, before = aggregate(*args), aggregate_before(*args)
    assert torch.equal(new[1], before[1]) and new[2].keys() == before[2].keys()
    assert all(same(new[2][k], before[2][k]) for k in before[2])
    f_new, f_old = flatten(new[0]), flatten(before[0])
    assert f_new.keys() == f_old.keys() and all(same(f_new[k], f_old[k]) for k in f_old)
    if policy == "default":
        assert new[1].tolist() == [i != 4 for i in range(CLIENTS)]


# ---- the code before (commit 7be0e50), frozen: only the oracle of the test above --------

_NORM_BLOCK = 256


def _updates_before(
    broadcast: Tree, replies: Tree, kind: str = "mean", formed: bool = True
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    down = flatten(broadcast) if kind != "sum" else {}
    up = flatten(replies)
    updates, refs = {}, {}
    for key, reply in up.items():
        if not reply.is_floating_point():
            continue
        ref = down.get(key)
        if ref is not None and tuple(ref.shape) == tuple(reply.shape[1:]):
            refs[key] = ref.to(reply.dtype)
            updates[key] = reply - refs[key] if formed else reply
        else:
            refs[key] = torch.zeros((), dtype=reply.dtype)
            updates[key] = reply
    return updates, refs


def _update_norms_before(
    updates: dict[str, Tensor], clients: int, refs: dict[str, Tensor] | None = None
) -> Tensor:
    norms = torch.zeros(clients, dtype=torch.float64)
    for key, u in updates.items():
        ref = None if refs is None or refs[key].dim() == 0 else refs[key]
        squares = [
            (b if ref is None else b - ref).reshape(len(b), -1).to(torch.float64).pow(2).sum(1)
            for b in _client_blocks_before(u, clients)
        ]
        norms = norms + (torch.cat(squares) if squares else norms)
    return norms.sqrt()


def _client_blocks_before(t: Tensor, clients: int) -> Iterator[Tensor]:
    rows = t.reshape(clients, *t.shape[1:])
    for i in range(0, clients, _NORM_BLOCK):
        yield rows[i : i + _NORM_BLOCK]


def _relative_sizes_before(
    updates: dict[str, Tensor], accepted: Tensor, kind: str, rows: Tensor | None = None
) -> Tensor:
    n = int(accepted.shape[0])
    if kind != "sum":
        norms = _update_norms_before(updates, n)
        median = norms[accepted].median()
        return norms / median if median > 0 else torch.zeros_like(norms)
    per_row = None if rows is None else rows.to(torch.float64).clamp_min(1.0)
    ratio = torch.zeros(n, dtype=torch.float64)
    for u in updates.values():
        norms = u.reshape(n, -1).to(torch.float64).norm(dim=1)
        median = norms[accepted].median()
        if median <= 0:
            continue
        leaf = norms / median
        if per_row is not None:
            scaled = norms / per_row
            scaled_median = scaled[accepted].median()
            if scaled_median > 0:
                leaf = torch.minimum(leaf, scaled / scaled_median)
        ratio = torch.maximum(ratio, leaf)
    return ratio


def aggregate_before(
    algorithm,
    server: Tree,
    broadcast: Tree,
    replies: Tree,
    weights: Tensor,
    policy: AggregationPolicy,
    round_seed: int,
    *,
    eligible: Tensor | None = None,
    weight_cap: Tensor | None = None,
) -> tuple[Tree, Tensor, dict[str, float]]:
    check_policy(algorithm, policy)
    kind = getattr(algorithm, "reply_aggregation", "mean")
    # The plain mean needs the updates only for their norms: those are formed a block of
    # clients at a time, never for the whole fleet at once (17 KB per sensor, seed MLP).
    plain = not (policy.dp or policy.screen_factor > 0 or policy.clip_factor > 0)
    plain = plain and policy.rule == "mean"
    updates, refs = _updates_before(broadcast, replies, kind, formed=not plain)
    replied = updates if plain else {}
    if plain:
        updates = {}
    n = int(weights.shape[0])
    weights = weights.to(torch.float64)
    if weight_cap is not None:
        weights = torch.minimum(weights, weight_cap.to(torch.float64))
    accepted = torch.ones(n, dtype=torch.bool) if eligible is None else eligible.clone()
    finite = finite_rows(replies)
    if finite.numel():
        accepted = accepted & finite
    nonfinite = int((~accepted).sum())
    norms = _update_norms_before(replied, n, refs) if plain else _update_norms_before(updates, n)
    metrics: dict[str, float] = {"rejected_nonfinite": float(nonfinite)}
    median = norms[accepted].median() if accepted.any() else torch.tensor(float("nan"))
    # Leaves an algorithm declares unscreened (``unscreened_replies``, path prefixes) do not
    # judge a client in screening or Krum; they are still aggregated (or rejected) with it.
    exempt = tuple(getattr(algorithm, "unscreened_replies", ()))
    judged = {k: u for k, u in updates.items() if not k.startswith(exempt)}
    if policy.screen_factor > 0 and not policy.dp and accepted.any() and judged:
        sizes = _relative_sizes_before(judged, accepted, kind, weights)
        outlier = accepted & (sizes > policy.screen_factor)
        accepted = accepted & ~outlier
        metrics["rejected_norm"] = float(outlier.sum())
    else:
        metrics["rejected_norm"] = 0.0
    metrics["median_update_norm"] = float(median)
    if not accepted.any() or not refs:
        metrics["accepted"] = float(accepted.sum())
        if not accepted.any():
            return server, accepted, metrics  # nothing trustworthy arrived: keep the model
        idx = accepted.nonzero()[:, 0]
        sub = {k: v.index_select(0, idx) for k, v in flatten(replies).items()}
        return (
            algorithm.server_update(server, unflatten(sub), weights.index_select(0, idx)),
            accepted,
            metrics,
        )

    # Clipping: a per-client factor min(1, bound / ‖Δ_i‖) on every update leaf; rows that
    # are not clipped keep their reply bit for bit.
    processed = flatten(replies)
    # Summed statistics with declared per-statistic bounds (fedprior) are clipped, noised
    # and projected statistic by statistic (core.privacy.private_sums), not here.
    declares = getattr(algorithm, "dp_statistics", None) is not None
    per_statistic = policy.dp and kind == "sum" and declares
    clip = None
    if policy.dp and not per_statistic:
        bound = torch.tensor(policy.dp_clip, dtype=torch.float64)
        clip = accepted & (norms > bound)
        factor = torch.where(clip, bound / norms.clamp_min(1e-300), torch.ones_like(norms))
        metrics["clip_bound"] = float(bound)
    elif policy.clip_factor > 0 and kind == "mean":
        # Statistics are not clipped: scaling a unit's Gram sum and its second moments by
        # one factor is no bounded contribution but a corrupted one (screening covers them).
        size = _relative_sizes_before(updates, accepted, kind)
        clip = accepted & (size > policy.clip_factor)
        factor = torch.where(clip, policy.clip_factor / size, torch.ones_like(size))
        metrics["clip_bound"] = float(policy.clip_factor * norms[accepted].median())
    # No client clipped: every factor is 1, so the updates and replies stay as they are
    # (the same numbers, without two fleet-sized copies).
    if clip is not None and bool(clip.any()):
        for key, u in updates.items():
            shape = (n, *([1] * (u.dim() - 1)))
            updates[key] = u * factor.to(u.dtype).reshape(shape)
            processed[key] = torch.where(
                clip.reshape(shape), (updates[key] + refs[key]).to(u.dtype), processed[key]
            )
    if clip is not None:
        metrics["clipped"] = float(clip.sum())

    used = accepted
    if policy.rule == "krum":
        idx = accepted.nonzero()[:, 0]
        parts = [
            u.index_select(0, idx).reshape(len(idx), -1).double()
            for k, u in updates.items()
            if k in judged
        ]
        if kind == "sum":  # statistics in different units: each leaf by its median norm
            parts = [p / p.norm(dim=1).median().clamp_min(1e-300) for p in parts]
        flat = torch.cat(parts, 1)
        scores = krum_scores(flat, policy.krum_byzantine)
        m = policy.krum_select or max(1, len(idx) - policy.krum_byzantine)
        keep = idx[scores.argsort(stable=True)[: min(m, len(idx))]]
        selected = torch.zeros(n, dtype=torch.bool)
        selected[keep] = True
        metrics["krum_dropped"] = float((accepted & ~selected).sum())
        # Not selected is not rejected: the client keeps its private progress (an honest
        # but atypical sensor would otherwise be frozen round after round).
        used = selected

    idx = used.nonzero()[:, 0]
    k = len(idx)
    if per_statistic:
        from fedcal.core.privacy import private_sums

        gen = torch.Generator().manual_seed(int(round_seed) % (2**63))
        chosen = {key: u.index_select(0, idx) for key, u in updates.items()}
        sums, dp_metrics = private_sums(
            chosen,
            algorithm.dp_statistics(broadcast),
            policy.dp_noise_multiplier,
            gen,
            scale=policy.dp_clip,
        )
        metrics.update(dp_metrics)
        metrics["dp_noise_std"] = float(policy.dp_noise_multiplier * policy.dp_clip)
        for key, u in updates.items():  # the private sum replicated: k rows that sum to it
            processed[key] = (sums[key] / k).to(u.dtype).expand(u.shape).clone()
    elif policy.rule in ("median", "trimmed_mean") or policy.dp:
        chosen = {key: u.index_select(0, idx) for key, u in updates.items()}
        if policy.dp:
            # DP-FedAvg: (Σ clipped Δ_i + N(0, σ²C²·I)) / k with uniform weights.
            gen = torch.Generator().manual_seed(int(round_seed) % (2**63))
            std = policy.dp_noise_multiplier * policy.dp_clip
            estimate = {}
            for key, u in chosen.items():
                noise = torch.randn(u.shape[1:], generator=gen, dtype=torch.float64)
                estimate[key] = (u.sum(0) + (std * noise).to(u.dtype)) / k
            weights = torch.ones_like(weights)
            metrics["dp_noise_std"] = float(std)
        else:
            estimate = coordinate_rule(chosen, policy.rule, policy.trim_fraction)
        # The estimate replicated over the accepted clients: their mean is the estimate,
        # their sum k × the estimate (see the module docstring).
        for key, u in updates.items():
            processed[key] = (estimate[key] + refs[key]).to(u.dtype).expand(u.shape).clone()

    # Every client used: the replies themselves, not a copy (fleet-sized at 10,000 clients).
    sub = processed if k == n else {key: v.index_select(0, idx) for key, v in processed.items()}
    metrics["accepted"] = float(k)
    new_server = algorithm.server_update(server, unflatten(sub), weights.index_select(0, idx))
    return new_server, accepted, metrics

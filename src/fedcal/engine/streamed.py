"""A ``"sum"`` round whose replies are summed chunk by chunk, never assembled (issue 25.1).

The assembled round (:func:`fedcal.core.aggregation.aggregate`) stacks every client's reply
before the chain runs: at 100,000 fedprior units that is 1.5 GB with one basis. An algorithm
whose ``server_update`` needs its replies only as sums says so with ``server_update_sums``
(returning None when a setting needs per-unit replies); then, under a policy whose stages
read only small per-client numbers (the guards, size screening, the consistency check; no
Krum, coordinate rule or DP), a round is:

1. per chunk of clients (:func:`fedcal.engine.chunks.spans`): the chunk's client update;
   each client's finite flag, update norm ‖Δ_i‖ and judged leaves' norms ‖Δ_il‖ (the numbers
   :func:`~fedcal.core.stages.measure` and :func:`~fedcal.core.stages.screen` read), the
   algorithm's consistency reasons (per client, independent of the others); the rows of the
   clients that are finite and consistent added to float64 running sums; the new states
   and client metrics assembled (small: one row per client);
2. the chain's decisions from those numbers, in the assembled order: non-finite, size
   (:func:`~fedcal.core.stages.statistic_sizes` of the norms: the same ratios, since a
   one-element row's norm is its absolute value), inconsistent;
3. the algorithm's M-step weights w_i (``outlier_weights``, fedprior's ``robust = "full"``)
   from the per-client leaves it names (``outlier_inputs``, kept per client in pass 1:
   fedprior's m_i and S_i), over the used clients, and reported as the assembled path
   reports them;
4. the few clients whose weight is not 1 — screened out (0: they were summed, their size
   needing the whole cohort) or down-weighted (w_i) — have their replies recomputed
   (``client_update`` on them alone: a client's reply does not depend on its cohort,
   tested to the bit) and Σ (w_i − 1)·reply_i added to the sums;
5. the leaves the algorithm picks from one client rather than sums (``picked_leaves``:
   fedprior's calibrated-interval probe, an arg-min over the units): the client
   ``pick_reply`` names from the per-client keys kept in pass 1 (``pick_inputs``), over
   the used clients in client order, has its reply recomputed and those leaves replace
   the sums (zeros when it names none);
6. ``server_update_sums(server, sums, count)``, count = Σ w_i over the used clients.

A round in which a sample of the clients sends more (:class:`SamplesClients`: fedprior's
candidate bases on about 2,000 units' own draws, fedprior_rounds R1) runs its pass 1 in two
groups: the clients outside the sample under the broadcast without the sample's part, whose
replies hold no such leaves (not zeros: at 100,000 units those were 25 GB a round written,
checked and summed), then the sampled clients under the whole broadcast, in chunks of as
many reply bytes as the others' chunks. A leaf that only the sample's replies hold is
summed over the sample; every per-client number is the one the client computed, so the
decisions are the one-group round's. The round's upload is then counted client by client
(``upload``).

The sums are in chunk order, not the assembled path's canonical order: equal within
rounding (tested ≤ 1e-10 relative). A subtracted client leaves a rounding error relative
to its own size (a reply 10⁶× the others' costs ~10⁻¹⁰ of the total).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from fedcal.core.aggregation import AggregationPolicy, _columns, _record_downweighted
from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.hooks import BindsConsistency, StreamsSums
from fedcal.core.stages import Round, finite_rows, statistic_sizes, view_sizes
from fedcal.core.tree import Tree, expand, flatten, gather, num_bytes, unflatten
from fedcal.engine import chunks

STREAM_ABOVE = 512 * 2**20
"""Bytes of assembled replies above which an eligible round is streamed (the engine's bound)."""


@runtime_checkable
class SamplesClients(Protocol):
    """A round in which a sample of the clients replies with more leaves (module doc):
    ``sampled_clients(down, data)`` -> (clients,) bool, the clients that reply in full this
    round, or None (every client the same reply); ``unsampled_broadcast(down)``: what the
    others are sent (their replies hold no leaf the full replies do not, and fewer)."""

    def sampled_clients(self, down: Tree, data: ClientData) -> Tensor | None: ...

    def unsampled_broadcast(self, down: Tree) -> Tree: ...


def eligible(algorithm: Algorithm, policy: AggregationPolicy) -> str | None:
    """None when this round can be streamed; else why not, in one line."""
    if algorithm.reply_aggregation != "sum" or not isinstance(algorithm, StreamsSums):
        return f"{algorithm.name}: its server update needs each client's reply"
    if policy.rule != "mean" or policy.dp:
        return f"{algorithm.name}: rule {policy.rule!r} / DP read each client's coordinates"
    return algorithm.streaming_refused()


def reply_bytes(algorithm: Algorithm, down: Tree, states: Tree, data: ClientData) -> int:
    """Bytes of one client's reply (the first client's update, computed alone)."""
    one = torch.arange(1)
    out = algorithm.client_update(expand(down, 1), gather(states, one), data.select(one))
    return num_bytes(out.reply, per_client_axis=True)


def _view_norms(view: dict[str, Tensor], k: int) -> dict[str, Tensor]:
    """Each view leaf's per-client norm (k,) float64 (a view holds no model leaf)."""
    return {key: v.reshape(k, -1).to(torch.float64).norm(dim=1) for key, v in view.items()}


def _norms(flat: dict[str, Tensor], keys: tuple[str, ...], n: int) -> dict[str, Tensor]:
    return {k: flat[k].reshape(n, -1).to(torch.float64).norm(dim=1) for k in keys}


@dataclass
class _Pass:
    """What the first pass over the chunks keeps (module doc, step 1)."""

    n: int
    sums: dict[str, Tensor]  # float64 running sums of the kept rows (a leaf: of its group's)
    finite: Tensor  # (n,) each client's reply (and state) finite
    total: Tensor  # (n,) each client's update norm over the floating leaves
    small: chunks.Assembly  # new states and client metrics
    judged_norms: dict[str, Tensor] = field(default_factory=dict)  # the size screen's input
    reasons: dict[int, str] = field(default_factory=dict)  # the consistency check's
    inputs: dict[str, Tensor] = field(default_factory=dict)  # the M-step weight's leaves
    keys: dict[str, Tensor] = field(default_factory=dict)  # the leaves pick_reply reads
    first_reply: dict[str, Tensor] | None = None
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # each leaf's reply dtype
    bytes_up: int = 0  # the clients' replies, each counted
    checked: bool = False  # the algorithm checks consistency (a rejected_inconsistent column)
    reason: str = "non-finite reply"

    @classmethod
    def empty(cls, n: int) -> _Pass:
        finite = torch.ones(n, dtype=torch.bool)
        return cls(n, {}, finite, torch.zeros(n, dtype=torch.float64), chunks.Assembly(n))


@chunks.torch_on_one_thread()
def streamed_round(
    algorithm: Algorithm,
    server: Tree,
    down: Tree,
    states: Tree,
    data: ClientData,
    weights: Tensor,
    policy: AggregationPolicy,
    chunk_size: int,
    record: list[dict] | None = None,
    upload: list[int] | None = None,
    workers: int = 1,
) -> tuple[ClientResult, Tree, Tensor, dict[str, float]]:
    """One round streamed (module doc): ``(result, new_server, accepted, metrics)``.

    ``result`` holds the cohort's new states and client metrics, and the first client's
    reply as the reply. ``weights``: the clients' declared rows. Metrics and ``record`` as
    :func:`fedcal.core.aggregation.aggregate`; ``upload`` gets the round's bytes up, each
    client's reply counted (a sample's replies are larger than the others'). ``workers``:
    the threads computing pass 1's chunks; torch runs on one thread meanwhile, so the
    numbers are the same for any ``workers`` and torch thread count."""
    n = data.num_clients
    weights = weights.to(torch.float64)
    check = _consistency_check(algorithm, server)
    acc = _first_pass(algorithm, check, down, states, data, weights, chunk_size, workers)
    trees = acc.small.trees()
    result = ClientResult(unflatten(acc.first_reply), trees["state"], trees["metrics"])
    accepted, records, metrics, outlier = _decisions(acc, algorithm, policy, weights)
    if upload is not None:
        upload.append(acc.bytes_up)
    # Screened-out clients were summed (their size needed the whole cohort): weight 0. Clients
    # the algorithm's M-step down-weights (its outlier weights, from the kept inputs): w_i.
    factor = torch.ones(n, dtype=torch.float64)
    factor[outlier & ~torch.tensor([i in acc.reasons for i in range(n)])] = 0.0
    metrics = _columns(metrics)
    if not accepted.any():
        if record is not None:
            record.extend(records)
        return result, server, accepted, {**metrics, "accepted": 0.0}
    metrics["accepted"] = float(accepted.sum())
    used = accepted.nonzero()[:, 0]
    count = torch.tensor(float(len(used)), dtype=torch.float64)
    if acc.inputs:
        rows = acc.inputs  # every client used (most rounds): the kept leaves, not a copy
        if len(used) < n:
            rows = {key: v.index_select(0, used) for key, v in acc.inputs.items()}
        robust = algorithm.outlier_weights(server, unflatten(rows))
        if robust is not None and bool((robust.weights != 1).any()):
            factor[used] = robust.weights.to(torch.float64)
            count = robust.weights.to(torch.float64).sum()
        if record is not None:
            record.extend(records)
            records = []
        _record_downweighted(algorithm, server, rows, accepted, metrics, record, robust)
    _reweight(acc.sums, algorithm, factor, down, states, data)
    if algorithm.picked_leaves:  # one used client's leaves, not their sum (step 5)
        _pick(acc.sums, algorithm, acc.keys, used, down, states, data)
    if record is not None:
        record.extend(records)
    totals = unflatten({key: v.to(acc.dtypes[key]) for key, v in acc.sums.items()})
    return result, algorithm.server_update_sums(server, totals, count), accepted, metrics


def _consistency_check(algorithm: Algorithm, server: Tree) -> Callable[..., dict] | None:
    """The consistency check bound to this round's server (its prior whitened once), if the
    algorithm has one."""
    if algorithm.inconsistent_replies is None:
        return None
    if isinstance(algorithm, BindsConsistency):
        return algorithm.consistency_check(server)
    return partial(algorithm.inconsistent_replies, server)


def _first_pass(
    algorithm: Algorithm,
    check: Callable[..., dict] | None,
    down: Tree,
    states: Tree,
    data: ClientData,
    weights: Tensor,
    chunk_size: int,
    workers: int,
) -> _Pass:
    """Step 1: every chunk's client update, measured, checked and summed (a sample's group
    first, when the algorithm samples: :func:`_groups`), on ``workers`` threads
    (:func:`fedcal.engine.chunks.in_order`)."""
    n = data.num_clients
    acc = _Pass.empty(n)
    rounds: dict[frozenset, Round] = {}
    for group, sent in _groups(algorithm, down, data):
        size = chunk_size
        if group is not None and acc.bytes_up:  # the sample: chunks of the same bytes
            one = group[:1]
            full = reply_bytes(algorithm, sent, gather(states, one), data.select(one))
            size = max(1, chunk_size * acc.bytes_up // max(1, n - len(group)) // max(1, full))
        spans = chunks.spans(n if group is None else len(group), size)
        every = (span if group is None else group.index_select(0, span) for span in spans)

        def measured(rows: Tensor, sent: Tree = sent) -> _Chunk:
            out = algorithm.client_update(
                expand(sent, len(rows)), gather(states, rows), data.select(rows)
            )
            return _measure(algorithm, out, rows, weights, sent, check, rounds)

        for part in chunks.in_order(measured, every, workers):
            _absorb_chunk(acc, algorithm, part)
    return acc


def _groups(algorithm: Algorithm, down: Tree, data: ClientData) -> list[tuple[Tensor | None, Tree]]:
    """The clients of pass 1 and what each group is sent: ``[(None, down)]`` (every client,
    in order), or the clients outside the sample under the algorithm's
    ``unsampled_broadcast``, then the sampled ones under ``down`` (:class:`SamplesClients`;
    both non-empty), the latter in chunks of as many reply bytes as the former's."""
    if not isinstance(algorithm, SamplesClients):
        return [(None, down)]
    sampled = algorithm.sampled_clients(down, data)
    if sampled is None or bool(sampled.all()) or not bool(sampled.any()):
        return [(None, down)]
    rest = algorithm.unsampled_broadcast(down)
    return [((~sampled).nonzero()[:, 0], rest), (sampled.nonzero()[:, 0], down)]


@dataclass
class _Chunk:
    """One chunk's replies measured (every number of step 1 that reads only this chunk)."""

    rows: Tensor
    out: ClientResult
    flat: dict[str, Tensor]
    ok: Tensor  # each client's reply (and state) finite
    stateful: bool  # the clients keep a state (checked for finiteness too)
    total: Tensor  # each client's update norm over the floating leaves
    judged: dict[str, Tensor]  # the size screen's per-client norms
    bad: dict[int, str] | None  # the consistency check's reasons (chunk positions)
    sums: dict[str, Tensor]  # float64 sums of the kept clients' leaves
    bytes_up: int


def _measure(
    algorithm: Algorithm,
    out: ClientResult,
    rows: Tensor,
    weights: Tensor,
    down: Tree,
    check: Callable[..., dict] | None,
    rounds: dict[frozenset, Round],
) -> _Chunk:
    """One chunk's finite flags, norms, consistency and sums (:class:`_Chunk`); ``rounds``:
    the :class:`Round` of each reply structure, formed once (a sample's replies hold more)."""
    k = len(rows)
    flat = flatten(out.reply)
    shape = frozenset(flat)
    if shape not in rounds:  # (a pure function of the structure: a race forms it twice)
        rounds[shape] = Round.of(down, flat, "sum", algorithm.unscreened_replies)
    rnd = rounds[shape]
    ok, state_ok = finite_rows(out.reply), finite_rows(out.state)
    ok = ok & state_ok if state_ok.numel() else ok  # a stateless client: its reply only
    sq = _norms(flat, rnd.floating, k)
    total = torch.stack(list(sq.values())).square().sum(0).sqrt()
    # the size screen's input: the algorithm's scale-free view (issue 34.3) or the leaves
    view = algorithm.screen_view
    parts = _view_norms(view(flat, weights[rows], down), k) if view is not None else sq
    judged = {key: parts[key] for key in (parts if view is not None else rnd.judged)}
    keep = ok.clone()
    bad = check(out.reply, weights[rows], ok) if check is not None else None
    for j in bad or {}:
        keep[j] = False
    whole = bool(keep.all())  # most chunks: every row summed, no masked copy
    sums = {
        key: (v if whole and v.is_contiguous() else v[keep]).to(torch.float64).sum(0)
        for key, v in flat.items()
    }
    size = num_bytes(out.reply, per_client_axis=True) * k
    return _Chunk(rows, out, flat, ok, bool(state_ok.numel()), total, judged, bad, sums, size)


def _absorb_chunk(acc: _Pass, algorithm: Algorithm, part: _Chunk) -> None:
    """One measured chunk into the pass, in chunk order: finite flags, norms, reasons, sums,
    the kept per-client leaves."""
    n, rows, flat, k = acc.n, part.rows, part.flat, len(part.rows)
    if acc.first_reply is None:
        acc.first_reply = {key: v[:1].clone() for key, v in flat.items()}
    acc.dtypes.update((key, v.dtype) for key, v in flat.items())
    acc.bytes_up += part.bytes_up
    acc.reason = "non-finite reply or state" if part.stateful else "non-finite reply"
    acc.finite[rows] = part.ok
    acc.total[rows] = part.total
    for key, v in part.judged.items():
        acc.judged_norms.setdefault(key, torch.zeros(n, dtype=torch.float64))
        acc.judged_norms[key][rows] = v
    acc.checked = acc.checked or part.bad is not None
    for j, why in (part.bad or {}).items():
        acc.reasons[int(rows[j])] = why
    for key, v in part.sums.items():
        acc.sums[key] = acc.sums[key] + v if key in acc.sums else v
    contiguous = int(rows[-1]) - int(rows[0]) == k - 1  # (spans of one group: in order)
    out = part.out
    acc.small.add(
        {"state": out.state, "metrics": out.metrics}, int(rows[0]) if contiguous else rows
    )
    for key in algorithm.outlier_inputs:  # the M-step weights' inputs
        acc.inputs.setdefault(key, flat[key].new_empty((n, *flat[key].shape[1:])))
        acc.inputs[key][rows] = flat[key]
    for key in algorithm.pick_inputs:
        acc.keys.setdefault(key, flat[key].new_empty((n, *flat[key].shape[1:])))
        acc.keys[key][rows] = flat[key]


def _decisions(
    acc: _Pass, algorithm: Algorithm, policy: AggregationPolicy, weights: Tensor
) -> tuple[Tensor, list[dict], dict[str, float], Tensor]:
    """Step 2: the chain's decisions, in the assembled path's order (core.aggregation.chain):
    ``(accepted, records, metrics, size outliers)``."""
    accepted = acc.finite.clone()
    records = [
        {"client": i, "reason": acc.reason, "ratio": float("nan"), "threshold": 0.0}
        for i in (~accepted).nonzero()[:, 0].tolist()
    ]
    metrics = {"rejected_nonfinite": float((~accepted).sum())}
    any_ok = bool(accepted.any())
    metrics["median_update_norm"] = float(acc.total[accepted].median()) if any_ok else float("nan")
    outlier = torch.zeros(acc.n, dtype=torch.bool)
    if policy.screen_factor > 0:
        if any_ok and acc.judged_norms:
            one = {key: v.unsqueeze(1) for key, v in acc.judged_norms.items()}
            if algorithm.screen_view is not None:  # a view's leaves are sized as views are
                sizes = view_sizes(one, accepted, weights, {})
            else:
                sizes = statistic_sizes(one, accepted, weights)
            outlier = accepted & (sizes > policy.screen_factor)
            records += [
                {
                    "client": i,
                    "reason": "size",
                    "ratio": float(sizes[i]),
                    "threshold": float(policy.screen_factor),
                }
                for i in outlier.nonzero()[:, 0].tolist()
            ]
        metrics["rejected_norm"] = float(outlier.sum())
        accepted &= ~outlier
    late = sorted(i for i in acc.reasons if bool(accepted[i]))
    if acc.checked:
        for i in late:
            accepted[i] = False
            records.append(
                {"client": i, "reason": acc.reasons[i], "ratio": float("nan"), "threshold": 0.0}
            )
        metrics["rejected_inconsistent"] = float(len(late))
    return accepted, records, metrics, outlier


def _reweight(
    sums: dict[str, Tensor],
    algorithm: Algorithm,
    factor: Tensor,
    down: Tree,
    states: Tree,
    data: ClientData,
) -> None:
    """Step 4: Σ (w_i − 1)·reply_i over the few clients whose weight is not 1, their replies
    recomputed, added to the sums."""
    fix = (factor != 1).nonzero()[:, 0]
    if not len(fix):
        return
    again = algorithm.client_update(expand(down, len(fix)), gather(states, fix), data.select(fix))
    w = factor[fix] - 1.0
    for key, v in flatten(again.reply).items():
        v = v.to(torch.float64)
        sums[key] = sums[key] + (v * w.reshape(-1, *[1] * (v.dim() - 1))).sum(0)


def _pick(
    sums: dict[str, Tensor],
    algorithm: Algorithm,
    keys: dict[str, Tensor],
    used: Tensor,
    down: Tree,
    states: Tree,
    data: ClientData,
) -> None:
    """Step 5: the picked leaves from the one used client ``pick_reply`` names (its reply
    recomputed), zeros when it names none."""
    j = algorithm.pick_reply(unflatten({key: v.index_select(0, used) for key, v in keys.items()}))
    one = None if j is None else used[j : j + 1]
    if one is not None:
        one = flatten(
            algorithm.client_update(expand(down, 1), gather(states, one), data.select(one)).reply
        )
    for key in algorithm.picked_leaves:
        sums[key] = torch.zeros_like(sums[key]) if one is None else one[key][0].to(torch.float64)

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

The sums are in chunk order, not the assembled path's canonical order: equal within
rounding (tested ≤ 1e-10 relative). A subtracted client leaves a rounding error relative
to its own size (a reply 10⁶× the others' costs ~10⁻¹⁰ of the total).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from fedcal.core.aggregation import AggregationPolicy, _columns, _record_downweighted
from fedcal.core.algorithm import Algorithm, ClientResult
from fedcal.core.data import ClientData
from fedcal.core.stages import Round, finite_rows, statistic_sizes, view_sizes
from fedcal.core.tree import Tree, expand, flatten, gather, num_bytes, unflatten
from fedcal.engine import chunks

STREAM_ABOVE = 512 * 2**20
"""Bytes of assembled replies above which an eligible round is streamed (the engine's bound)."""


def eligible(algorithm: Algorithm, policy: AggregationPolicy) -> str | None:
    """None when this round can be streamed; else why not, in one line."""
    if algorithm.reply_aggregation != "sum" or algorithm.server_update_sums is None:
        return f"{algorithm.name}: its server update needs each client's reply"
    if policy.rule != "mean" or policy.dp:
        return f"{algorithm.name}: rule {policy.rule!r} / DP read each client's coordinates"
    refused = algorithm.streaming_refused
    return None if refused is None else refused()


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
) -> tuple[ClientResult, Tree, Tensor, dict[str, float]]:
    """One round streamed (module doc): ``(result, new_server, accepted, metrics)``.

    ``result`` holds the cohort's new states and client metrics, and the first client's
    reply as the reply (its size is the round's bytes up per client). ``weights``: the
    clients' declared rows. Metrics and ``record`` as :func:`fedcal.core.aggregation.aggregate`.
    """
    n = data.num_clients
    weights = weights.to(torch.float64)
    sums: dict[str, Tensor] = {}
    finite = torch.ones(n, dtype=torch.bool)
    total = torch.zeros(n, dtype=torch.float64)
    judged_norms: dict[str, Tensor] = {}
    reasons: dict[int, str] = {}
    inputs: dict[str, Tensor] = {}  # per client, the leaves its M-step weight is computed from
    keys: dict[str, Tensor] = {}  # per client, the leaves pick_reply chooses from
    small = chunks.Assembly(n)
    first_reply: Tree | None = None
    rnd: Round | None = None
    check = None  # the consistency check bound to this round's server (its prior whitened once)
    if algorithm.inconsistent_replies is not None:
        bind = algorithm.consistency_check
        check = partial(algorithm.inconsistent_replies, server) if bind is None else bind(server)
    checked = False  # the algorithm checks consistency (else no rejected_inconsistent column)
    for rows in chunks.spans(n, chunk_size):
        start, k = int(rows[0]), len(rows)
        out = algorithm.client_update(expand(down, k), gather(states, rows), data.select(rows))
        flat = flatten(out.reply)
        if rnd is None:
            rnd = Round.of(down, flat, "sum", algorithm.unscreened_replies)
            first_reply = {key: v[:1].clone() for key, v in flat.items()}
        ok, state_ok = finite_rows(out.reply), finite_rows(out.state)
        ok = ok & state_ok if state_ok.numel() else ok  # a stateless client: its reply only
        reason = "non-finite reply or state" if state_ok.numel() else "non-finite reply"
        finite[start : start + k] = ok
        sq = _norms(flat, rnd.floating, k)
        total[start : start + k] = torch.stack(list(sq.values())).square().sum(0).sqrt()
        # the size screen's input: the algorithm's scale-free view (issue 34.3) or the leaves
        view = algorithm.screen_view
        parts = _view_norms(view(flat, weights[rows], down), k) if view is not None else sq
        for key in parts if view is not None else rnd.judged:
            judged_norms.setdefault(key, torch.zeros(n, dtype=torch.float64))
            judged_norms[key][start : start + k] = parts[key]
        keep = ok.clone()
        if check is not None:
            bad = check(out.reply, weights[rows], ok)
            checked = checked or bad is not None
            for j, why in (bad or {}).items():
                reasons[start + j] = why
                keep[j] = False
        whole = bool(keep.all())  # most chunks: every row summed, no masked copy
        for key, v in flat.items():
            part = (v if whole and v.is_contiguous() else v[keep]).to(torch.float64).sum(0)
            sums[key] = sums[key] + part if key in sums else part
        small.add({"state": out.state, "metrics": out.metrics}, start)
        for key in algorithm.outlier_inputs:  # the M-step weights' inputs
            inputs.setdefault(key, flat[key].new_empty((n, *flat[key].shape[1:])))
            inputs[key][start : start + k] = flat[key]
        for key in algorithm.pick_inputs:
            keys.setdefault(key, flat[key].new_empty((n, *flat[key].shape[1:])))
            keys[key][start : start + k] = flat[key]
        del out, flat
    trees = small.trees()
    result = ClientResult(unflatten(first_reply), trees["state"], trees["metrics"])

    # The chain's decisions, in the assembled path's order (core.aggregation.chain).
    accepted = finite.clone()
    records = [
        {
            "client": i,
            "reason": reason,
            "ratio": float("nan"),
            "threshold": 0.0,
        }
        for i in (~accepted).nonzero()[:, 0].tolist()
    ]
    metrics = {"rejected_nonfinite": float((~accepted).sum())}
    any_ok = bool(accepted.any())
    metrics["median_update_norm"] = float(total[accepted].median()) if any_ok else float("nan")
    outlier = torch.zeros(n, dtype=torch.bool)
    if policy.screen_factor > 0:
        if any_ok and judged_norms:
            one = {key: v.unsqueeze(1) for key, v in judged_norms.items()}
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
    late = sorted(i for i in reasons if bool(accepted[i]))
    if checked:
        for i in late:
            accepted[i] = False
            records.append(
                {"client": i, "reason": reasons[i], "ratio": float("nan"), "threshold": 0.0}
            )
        metrics["rejected_inconsistent"] = float(len(late))
    # Screened-out clients were summed (their size needed the whole cohort): weight 0. Clients
    # the algorithm's M-step down-weights (its outlier weights, from the kept inputs): w_i.
    factor = torch.ones(n, dtype=torch.float64)
    factor[outlier & ~torch.tensor([i in reasons for i in range(n)])] = 0.0
    metrics = _columns(metrics)
    if not accepted.any():
        if record is not None:
            record.extend(records)
        return result, server, accepted, {**metrics, "accepted": 0.0}
    metrics["accepted"] = float(accepted.sum())
    used = accepted.nonzero()[:, 0]
    count = torch.tensor(float(len(used)), dtype=torch.float64)
    if inputs:
        rows = {key: v.index_select(0, used) for key, v in inputs.items()}
        robust = algorithm.outlier_weights(server, unflatten(rows))
        if robust is not None and bool((robust.weights != 1).any()):
            factor[used] = robust.weights.to(torch.float64)
            count = robust.weights.to(torch.float64).sum()
        if record is not None:
            record.extend(records)
            records = []
        _record_downweighted(algorithm, server, rows, accepted, metrics, record, robust)
    fix = (factor != 1).nonzero()[:, 0]
    if len(fix):  # Σ (w_i − 1)·reply_i over these few clients, their replies recomputed
        again = algorithm.client_update(
            expand(down, len(fix)), gather(states, fix), data.select(fix)
        )
        w = factor[fix] - 1.0
        for key, v in flatten(again.reply).items():
            v = v.to(torch.float64)
            sums[key] = sums[key] + (v * w.reshape(-1, *[1] * (v.dim() - 1))).sum(0)
    if algorithm.picked_leaves:  # one used client's leaves, not their sum (step 5)
        j = algorithm.pick_reply(
            unflatten({key: v.index_select(0, used) for key, v in keys.items()})
        )
        one = None if j is None else used[j : j + 1]
        if one is not None:
            one = flatten(
                algorithm.client_update(
                    expand(down, 1), gather(states, one), data.select(one)
                ).reply
            )
        for key in algorithm.picked_leaves:
            sums[key] = (
                torch.zeros_like(sums[key]) if one is None else one[key][0].to(torch.float64)
            )
    if record is not None:
        record.extend(records)
    dtypes = {key: v.dtype for key, v in first_reply.items()}
    totals = unflatten({key: v.to(dtypes[key]) for key, v in sums.items()})
    return result, algorithm.server_update_sums(server, totals, count), accepted, metrics

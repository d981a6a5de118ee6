"""The measurements the aggregation's stages share (:mod:`fedcal.core.stages`): floating
leaves and their references, per-client squared norms taken a block of clients at a time,
finite rows, the size ratios the screen reads (statistics and scale-free views), Krum's
scores, the coordinate rules, clipping rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from fedcal.core.tree import Tree, flatten, per_client

NORM_BLOCK = 256  # clients whose temporaries (float64 squares, |x| of isfinite) exist at once


def references(
    broadcast: Tree, replies: dict[str, Tensor], kind: str = "mean"
) -> tuple[tuple[str, ...], dict[str, Tensor]]:
    """The floating reply leaves' paths and the broadcast value of those that have one.

    A leaf with a reference (same path and shape in the broadcast) is a model: its
    update is reply − ref. A leaf absent from ``refs`` is relative to zero: its update
    is the reply itself (a 0-dim broadcast leaf is a reference like any other). A
    ``"sum"`` server adds its replies up: they are contributions, never model states,
    so every leaf is relative to zero even when the broadcast has a leaf of the same
    name (e.g. fedprior's ``support``).
    """
    down = flatten(broadcast) if kind != "sum" else {}
    floating, refs = [], {}
    for key, reply in replies.items():
        if not reply.is_floating_point():
            continue
        floating.append(key)
        ref = down.get(key)
        if ref is not None and tuple(ref.shape) == tuple(reply.shape[1:]):
            refs[key] = ref.to(reply.dtype)
    return tuple(floating), refs


def leaf_squares(
    updates: dict[str, Tensor], clients: int, refs: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """Per leaf, each client's Σ of squared update coordinates, (clients,) float64.

    Computed ``NORM_BLOCK`` clients at a time (each client's sum is its own row's):
    a float64 copy of a whole fleet's updates would be ~70 KB per sensor for the
    seed's MLP. Given ``refs``, ``updates`` are the replies and a leaf's update is
    reply − ref (a leaf absent from ``refs`` is its own update), formed a block at a
    time instead of for the fleet (:func:`references`). NaN and ±inf propagate.
    """
    refs = refs or {}
    out = {}
    for key, u in updates.items():
        ref = refs.get(key)
        squares = [
            (b if ref is None else b - ref).reshape(len(b), -1).to(torch.float64).pow(2).sum(1)
            for b in _client_blocks(u, clients)
        ]
        out[key] = torch.cat(squares) if squares else torch.zeros(clients, dtype=torch.float64)
    return out


def root_sum(squares: Iterable[Tensor], clients: int) -> Tensor:
    """‖Δ_i‖ = √(Σ_l Σ (Δ_il)²): the leaves' squares added in order (same numbers every time)."""
    total = torch.zeros(clients, dtype=torch.float64)
    for s in squares:
        total = total + s
    return total.sqrt()


def finite_rows(tree: Tree) -> Tensor:
    """(clients,) bool: every floating leaf of a client tree is finite for that client."""
    flat = [t for t in flatten(tree).values() if t.is_floating_point()]
    if not flat:
        return torch.ones(0, dtype=torch.bool)
    n = flat[0].shape[0]
    ok = torch.ones(n, dtype=torch.bool)
    for t in flat:
        # A block of clients at a time: isfinite makes float temporaries (|x|) as large
        # as its input, ~35 KB per sensor for the seed's MLP over a whole fleet.
        blocks = [finite_each(b.reshape(len(b), -1)) for b in _client_blocks(t, n)]
        ok = ok & torch.cat(blocks or [ok])
    return ok


def finite_each(rows: Tensor) -> Tensor:
    """(clients,) bool: every entry of each row of ``rows`` (clients, k) is finite. A row
    whose sum is finite has no NaN or ±inf (either makes the sum NaN or ±inf), so only the
    rows whose sum is not (a non-finite entry, or an overflow of finite ones) are read entry
    by entry: the same verdicts as isfinite(rows).all(1), at one pass without a (clients, k)
    temporary (issue 36.1: a tenth of a 100,000-unit round)."""
    ok = torch.isfinite(rows.sum(1))
    doubt = (~ok).nonzero()[:, 0]
    if len(doubt):
        ok[doubt] = torch.isfinite(rows.index_select(0, doubt)).all(1)
    return ok


def _client_blocks(t: Tensor, clients: int) -> Iterator[Tensor]:
    """``t``'s rows ``NORM_BLOCK`` clients at a time (leading clients axis)."""
    rows = t.reshape(clients, *t.shape[1:])
    for i in range(0, clients, NORM_BLOCK):
        yield rows[i : i + NORM_BLOCK]


def statistic_sizes(
    updates: dict[str, Tensor], accepted: Tensor, rows: Tensor | None = None
) -> Tensor:
    """Each client's summed statistics' size relative to the accepted cohort's, (clients,).

    (A model update is one vector, sized by :func:`relative` of its norm.) A ``"sum"``
    reply is a set of statistics in different units (a Gram matrix may be 10⁹ times its
    right-hand side, and a poisoned label moves only the latter): the size is the largest
    per-leaf ratio, max_l r_il, so no leaf hides behind another.

    Statistics also grow with a client's rows n_i (``rows``, the declared counts): a unit
    calibrated with 384 points is not an outlier among units with 6. Per leaf, with
    a_il = ‖Δ_il‖ (as it is) and b_il = a_il / n_i (per row)::

        r_il = min( a_il / ref_i(a_l), b_il / ref_i(b_l) ),
        ref_i(v) = the scale of v among the others: client i must exceed both the
                   median over the clients and the median over the *other* clients'
                   rows (each other client's value weighted by its n_j,
                   :func:`weighted_median_of_others`),

    so neither the leaves that grow with n (Gram sums) nor those that do not (a posterior
    mean) flag an honest unit of another size, while a poisoned target grows both. The
    rows-weighted median keeps data-rich units from being judged against units whose
    statistics carry no information (fedpoly's 6-point units project to ≈ 0 sums: the
    plain median was ≈ 1e-9 and all 20 reference units of a mixed fleet were rejected in
    every round); leaving client i out of its own scale keeps a client that holds most of
    the rows from setting the scale it is judged by. A client is missed only if the others
    are corrupt too (half of the units, or half of the others' rows). Without ``rows``, or
    when every client has the same count, this is the plain median ratio of before. A
    scale ≤ 0 does not judge.
    """
    n = int(accepted.shape[0])
    counts = None if rows is None else rows.to(torch.float64).clamp_min(1.0)
    uniform = counts is None or bool((counts[accepted] == counts[accepted][0]).all())
    ratio = torch.zeros(n, dtype=torch.float64)
    for u in updates.values():
        norms = u.reshape(n, -1).to(torch.float64).norm(dim=1)
        if uniform:
            median = norms[accepted].median()
            if median > 0:
                ratio = torch.maximum(ratio, norms / median)
            continue
        leaf = torch.minimum(
            _scaled_ratio(norms, accepted, counts), _scaled_ratio(norms / counts, accepted, counts)
        )
        ratio = torch.maximum(ratio, torch.where(torch.isinf(leaf), 0.0, leaf))
    return ratio


def view_sizes(
    view: dict[str, Tensor], accepted: Tensor, rows: Tensor, refs: dict[str, Tensor]
) -> Tensor:
    """Each client's size over an algorithm's screen view (``Algorithm.screen_view``), (clients,).

    Per leaf (a model leaf as its update, reply − ref), a_il its norm: a scale-free leaf
    is sized r_il = a_il / ref_i(a_l), with ref_i as in :func:`statistic_sizes` (the
    smaller ratio to the plain median and to the other clients' rows-weighted median) but
    no per-row branch — dividing a quantity that does not grow with n_i by n_i would let a
    data-rich client pass a ×(its rows / the others') corruption; a leaf named ``sum/…``
    (a sum over the client's rows, e.g. a residual sum) is sized as :func:`statistic_sizes`
    sizes one, raw or per row. size_i = max_l r_il; a scale ≤ 0 does not judge.
    """
    n = int(accepted.shape[0])
    counts = rows.to(torch.float64).clamp_min(1.0)
    ratio = torch.zeros(n, dtype=torch.float64)
    for key, v in view.items():
        u = v - refs[key] if key in refs else v
        norms = u.reshape(n, -1).to(torch.float64).norm(dim=1)
        leaf = _scaled_ratio(norms, accepted, counts)
        if key.startswith("sum/"):
            leaf = torch.minimum(leaf, _scaled_ratio(norms / counts, accepted, counts))
        ratio = torch.maximum(ratio, torch.where(torch.isinf(leaf), 0.0, leaf))
    return ratio


def weighted_median_of_others(values: Tensor, weights: Tensor) -> Tensor:
    """For each i, the lower weighted median of the values of every j ≠ i, (clients,).

    The smallest value whose cumulative weight (i left out) reaches half of the others'
    total. O(n log n): one sort and two binary searches per client. NaN for a single client.
    """
    n = values.shape[0]
    if n < 2:
        return torch.full_like(values, float("nan"))
    order = values.argsort(stable=True)
    v, w = values[order], weights[order]
    cum = w.cumsum(0)
    half = 0.5 * (cum[-1] - w)  # half of the others' total, per sorted position
    pos = torch.arange(n)
    # Before i's position the cumulative weights are the others' already; after it they
    # are cum − w_i, i.e. the first j > pos with cum_j ≥ half + w_i.
    before = torch.searchsorted(cum, half)
    after = torch.searchsorted(cum, half + w).clamp_max(n - 1)
    sorted_median = torch.where(before < pos, v[before.clamp_max(n - 1)], v[after])
    out = torch.empty_like(values)
    out[order] = sorted_median
    return out


def _scaled_ratio(values: Tensor, accepted: Tensor, counts: Tensor) -> Tensor:
    """values / scale as in :func:`statistic_sizes`: the ratio to the accepted clients' plain
    median and to the others' rows-weighted median, whichever is smaller (inf: no scale)."""
    out = torch.full_like(values, float("inf"))
    median = values[accepted].median()
    if median > 0:
        out = values / median
    others = torch.full_like(values, float("nan"))
    others[accepted] = weighted_median_of_others(values[accepted], counts[accepted])
    by_rows = torch.where(others > 0, values / others, float("inf"))
    return torch.minimum(out, by_rows)


def relative(norms: Tensor, accepted: Tensor) -> Tensor:
    """‖Δ_i‖ / median_j ‖Δ_j‖ over the accepted clients (all 0 when that median is 0)."""
    median = norms[accepted].median()
    return norms / median if median > 0 else torch.zeros_like(norms)


def krum_scores(flat: Tensor, byzantine: int) -> Tensor:
    """Krum's s(i) = Σ of squared distances to the n − f − 2 nearest other updates."""
    n = flat.shape[0]
    dist = torch.cdist(flat, flat).pow(2)
    dist = dist + torch.diag(torch.full((n,), float("inf"), dtype=flat.dtype))
    k = max(1, min(n - 1, n - byzantine - 2))
    return dist.topk(k, dim=1, largest=False).values.sum(1)


def coordinate_rule(updates: dict[str, Tensor], rule: str, trim: float) -> dict[str, Tensor]:
    """Coordinate-wise median or trimmed mean over the clients axis (no clients axis left)."""
    out = {}
    for key, u in updates.items():
        if rule == "median":
            # Mean of the two middle values for an even cohort (torch.median takes the lower).
            s = u.sort(0).values
            n = s.shape[0]
            out[key] = 0.5 * (s[(n - 1) // 2] + s[n // 2])
        else:
            n = u.shape[0]
            cut = int(trim * n)
            out[key] = u.sort(0).values[cut : n - cut].mean(0)
    return out


def clip_rows(
    reply: Tensor, ref: Tensor | None, factor: Tensor, clip: Tensor, keep: Tensor | None
) -> Tensor:
    """``reply``'s rows ``keep`` (all if None), clipped rows as ref + factor·(reply − ref).

    One new tensor (the copy the aggregate is given): the clipped rows are computed
    alone and written into it; every other row is its reply, bit for bit.
    """
    out = reply.clone() if keep is None else reply.index_select(0, keep)
    kept_clip = clip if keep is None else clip.index_select(0, keep)
    at = kept_clip.nonzero()[:, 0]  # rows of ``out``
    rows = at if keep is None else keep.index_select(0, at)  # the same rows, as clients
    part = reply.index_select(0, rows)
    scale = per_client(factor.index_select(0, rows).to(reply.dtype), part)
    out[at] = part * scale if ref is None else (part - ref) * scale + ref
    return out

"""Server-side aggregation with screening, clipping, robust rules and client-level DP.

One entry point, :func:`aggregate`, used by the simulator and the Flower server
alike. A round's replies (stacked ``(clients, ...)``) go through, in order:

1. **Screening.** A client whose reply (or, when the engine says so, whose new
   private state) holds a non-finite value is rejected. So is one whose update
   norm exceeds ``screen_factor`` × the median norm of the finite replies: a
   robust, scale-free test (Byzantine-robust FL commonly measures updates
   against the cohort median, e.g. Blanchard et al. 2017; Yin et al. 2018).
   For summed statistics the size is the largest per-leaf ratio, judged as it is and
   per declared row and against the median over clients and over rows
   (:func:`statistic_sizes`): leaves in different units cannot hide each other, and
   an honest unit with 100× the rows of the others is not an outlier.
2. **Update clipping** (adaptive): each update is scaled to at most
   ``clip_factor`` × the median update norm of the accepted clients
   (centred clipping as in Karimireddy et al. 2021, with the median as the
   reference scale; one factor per client, so summed statistics stay
   consistent). With DP the bound is the fixed ``dp_clip`` instead.
3. **The rule**: the algorithm's own weighted mean/sum (``mean``), the
   coordinate-wise median or trimmed mean (Yin et al. 2018), or Multi-Krum
   selection (Blanchard et al. 2017, eq. of the score s(i)).
4. **Client-level DP** (McMahan et al. 2018, DP-FedAvg): the clipped updates are
   summed, Gaussian noise N(0, σ²C²) is added from a generator seeded by the
   round, and the noisy average replaces every accepted reply. A ``"sum"``
   algorithm that declares its statistics (``dp_statistics(broadcast)``) is
   instead clipped, noised and projected to valid sums statistic by statistic
   (:func:`fedcal.core.privacy.private_sums`; C then scales the declared bounds).
5. The algorithm's own ``server_update`` over the accepted (processed) replies.

**The update of a reply.** A reply leaf whose path exists in the broadcast with
the same shape (e.g. ``model/…``) is a model: its update is ``reply − broadcast``.
Any other floating leaf (sufficient statistics, predictions, losses), and every
leaf of a ``"sum"`` server update, is the client's contribution relative to
zero: its update is the leaf itself, so clipping scales a statistics reply as a
whole — it down-weights that client consistently (e.g. Gram matrix and
right-hand side together). Integer leaves are never modified.

**Memory.** Each client's update norm is computed once per round, a block of
clients at a time from its reply and the broadcast, and serves the median,
screening and clipping. With the rule ``"mean"`` and no DP (the default policy,
and PLAIN) the fleet's updates are never formed; a clipped client's rows are
rewritten in one copy of each leaf, the other rows being their replies bit for bit.
Multi-Krum, the coordinate-wise rules and DP form them (they need coordinates).

**Where a coordinate-wise rule applies.** ``Algorithm.reply_aggregation`` says
what ``server_update`` does with the replies: ``"mean"`` (a weighted mean of
replies, possibly followed by server-side steps on that mean) or ``"sum"``
(a sum, e.g. sufficient statistics). For both, a robust estimate *replicated
over the accepted clients* yields exactly the robust mean (or the robust mean
times the cohort size, i.e. a robust sum). ``"custom"`` server updates
(clustering, pooled data, cost controllers) get only screening and Multi-Krum
selection; clipping, the median, the trimmed mean and DP are refused for them
with a message (:func:`check_policy`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from fedcal.core.schema import MAX_CLIENTS, Float, Int, checked
from fedcal.core.tree import Tree, flatten, per_client, unflatten

Rule = Literal["mean", "median", "trimmed_mean", "krum"]
ReplyAggregation = Literal["mean", "sum", "custom"]


class AggregationError(ValueError):
    """A policy that cannot apply to an algorithm (raised before any training)."""


@checked(error=AggregationError)
class AggregationRules:
    """How the server screens, clips and combines replies: the configuration's ``[aggregation]``.

    ``screen_factor`` / ``clip_factor``: multiples of the cohort's median update
    norm (0 turns the step off). ``trim_fraction``: share of clients cut at each
    end per coordinate. ``krum_byzantine`` (f) and ``krum_select`` (m, 0 = n − f).
    Typed and range-checked (:func:`fedcal.core.schema.checked`): a bad value is a
    one-line :class:`AggregationError`.
    """

    rule: Rule = "mean"
    screen_factor: Float = Field(default=10.0, ge=0.0, le=1e6)
    clip_factor: Float = Field(default=3.0, ge=0.0, le=1e6)
    trim_fraction: Float = Field(default=0.1, ge=0.0, lt=0.5)
    krum_byzantine: Int = Field(default=1, ge=0, le=MAX_CLIENTS)
    krum_select: Int = Field(default=0, ge=0, le=MAX_CLIENTS)

    @model_validator(mode="after")
    def _multiples(self) -> AggregationRules:
        # a factor is a multiple of the median norm: at or below 1 it would cut typical clients
        if 0 < self.screen_factor <= 1:
            raise ValueError(
                f"screen_factor: must be > 1 (a multiple of the median norm) or 0 (off), "
                f"got {self.screen_factor!r}"
            )
        if 0 < self.clip_factor < 1:
            raise ValueError(
                f"clip_factor: must be >= 1 (a multiple of the median norm) or 0 (off), "
                f"got {self.clip_factor!r}"
            )
        return self


@checked(error=AggregationError)
class AggregationPolicy(AggregationRules):
    """The server's rules (:class:`AggregationRules`) and client-level DP (see the module doc).

    ``dp_noise_multiplier`` σ > 0 switches on client-level DP with fixed clip
    ``dp_clip`` C; the noise std on the sum is σ·C.
    """

    dp_noise_multiplier: Float = Field(default=0.0, ge=0.0)
    dp_clip: Float = Field(default=0.0, ge=0.0, le=1e6)

    @model_validator(mode="after")
    def _privacy(self) -> AggregationPolicy:
        if self.dp:
            if self.dp_clip <= 0:
                raise ValueError("privacy: a noise multiplier needs a clip bound > 0")
            if self.rule != "mean":
                raise ValueError(
                    f"privacy: DP noise is calibrated for the clipped mean, not rule {self.rule!r}"
                )
        return self

    @property
    def dp(self) -> bool:
        return self.dp_noise_multiplier > 0


PLAIN = AggregationPolicy(screen_factor=0.0, clip_factor=0.0)
"""Only non-finite replies are rejected; otherwise exactly the algorithm's own aggregate."""


def check_policy(algorithm, policy: AggregationPolicy) -> None:
    """Refuse a policy the algorithm's ``server_update`` cannot honour (one-line reason)."""
    kind = getattr(algorithm, "reply_aggregation", "mean")
    name = getattr(algorithm, "name", type(algorithm).__name__)
    allowed = getattr(algorithm, "robust_rules", ("mean", "median", "trimmed_mean", "krum"))
    if policy.rule not in allowed:
        raise AggregationError(
            f"{name}: rule {policy.rule!r} is refused for this method (it accepts "
            f"{', '.join(allowed)}; see its reply_aggregation note)"
        )
    if kind != "custom":
        return
    if policy.rule in ("median", "trimmed_mean"):
        raise AggregationError(
            f"{name}: rule {policy.rule!r} needs a server update that is a mean or sum of "
            "replies; this one is custom (use 'mean' or 'krum')"
        )
    if policy.dp:
        raise AggregationError(f"{name}: client-level DP needs a mean/sum server update")


def _references(
    broadcast: Tree, replies: Tree, kind: str = "mean"
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The floating reply leaves (clients, ...) and the broadcast value of those that have one.

    A leaf with a reference (same path and shape in the broadcast) is a model: its
    update is reply − ref. A leaf absent from ``refs`` is relative to zero: its update
    is the reply itself (a 0-dim broadcast leaf is a reference like any other). A
    ``"sum"`` server adds its replies up: they are contributions, never model states,
    so every leaf is relative to zero even when the broadcast has a leaf of the same
    name (e.g. fedprior's ``support``).
    """
    down = flatten(broadcast) if kind != "sum" else {}
    replied, refs = {}, {}
    for key, reply in flatten(replies).items():
        if not reply.is_floating_point():
            continue
        replied[key] = reply
        ref = down.get(key)
        if ref is not None and tuple(ref.shape) == tuple(reply.shape[1:]):
            refs[key] = ref.to(reply.dtype)
    return replied, refs


def _formed_updates(replied: dict[str, Tensor], refs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every client's update at once (a fleet-sized copy of each model leaf).

    Only the rules that need the updates' coordinates form them: Multi-Krum (pairwise
    distances), the coordinate-wise median / trimmed mean and DP (noisy sums of the
    clipped updates). A ``"mean"`` rule without DP needs only their norms.
    """
    return {key: r - refs[key] if key in refs else r for key, r in replied.items()}


NORM_BLOCK = 256  # clients whose temporaries (float64 squares, |x| of isfinite) exist at once


def _leaf_squares(
    updates: dict[str, Tensor], clients: int, refs: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """Per leaf, each client's Σ of squared update coordinates, (clients,) float64.

    Computed ``NORM_BLOCK`` clients at a time (each client's sum is its own row's):
    a float64 copy of a whole fleet's updates would be ~70 KB per sensor for the
    seed's MLP. Given ``refs``, ``updates`` are the replies and a leaf's update is
    reply − ref (a leaf absent from ``refs`` is its own update), formed a block at a
    time instead of for the fleet (:func:`_references`). NaN and ±inf propagate.
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


def _root_sum(squares: Iterable[Tensor], clients: int) -> Tensor:
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
        blocks = [torch.isfinite(b.reshape(len(b), -1)).all(1) for b in _client_blocks(t, n)]
        ok = ok & torch.cat(blocks or [ok])
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

    (A model update is one vector, sized by :func:`_relative` of its norm.) A ``"sum"``
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


def _relative(norms: Tensor, accepted: Tensor) -> Tensor:
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


def aggregate(
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
    record: list[dict] | None = None,
) -> tuple[Tree, Tensor, dict[str, float]]:
    """Screen, clip, combine (and noise) a round's replies; return the new server.

    ``weights`` are the clients' training-row counts; ``weight_cap`` (e.g. the
    counts declared at the handshake) caps them. ``eligible`` (clients,) marks
    clients the engine already rejects (e.g. a non-finite new private state).
    Returns ``(new_server, accepted, metrics)``: ``accepted`` (clients,) bool, the
    clients that passed screening — the engine keeps the previous private state
    of the others (Multi-Krum's unselected clients are accepted but left out of
    the aggregate) — and round metrics (rejections, the median norm, the clip
    bound, σ). Given ``record``, one entry per rejected client is appended to it:
    ``{"client": its position in the cohort, "reason": "non-finite reply" | "size",
    "ratio": its measured size (:func:`statistic_sizes` or the median-norm ratio),
    "threshold": screen_factor}``, the reason a user is shown. Memory: see the module
    docstring.
    """
    check_policy(algorithm, policy)
    kind = getattr(algorithm, "reply_aggregation", "mean")
    replied, refs = _references(broadcast, replies, kind)
    n = int(weights.shape[0])
    weights = weights.to(torch.float64)
    if weight_cap is not None:
        weights = torch.minimum(weights, weight_cap.to(torch.float64))
    accepted = torch.ones(n, dtype=torch.bool) if eligible is None else eligible.clone()
    finite = finite_rows(replies)
    if finite.numel():
        accepted = accepted & finite
    nonfinite = int((~accepted).sum())
    if record is not None:
        reason = "non-finite reply" if eligible is None else "non-finite reply or state"
        for i in (~accepted).nonzero()[:, 0].tolist():
            record.append({"client": i, "reason": reason, "ratio": float("nan"), "threshold": 0.0})
    squares = _leaf_squares(replied, n, refs)  # (clients,) per leaf: the round's only pass
    norms = _root_sum(squares.values(), n)
    metrics: dict[str, float] = {"rejected_nonfinite": float(nonfinite)}
    median = norms[accepted].median() if accepted.any() else torch.tensor(float("nan"))
    # Leaves an algorithm declares unscreened (``unscreened_replies``, path prefixes) do not
    # judge a client in screening or Krum; they are still aggregated (or rejected) with it.
    exempt = tuple(getattr(algorithm, "unscreened_replies", ()))
    judged = [key for key in replied if not key.startswith(exempt)]
    if policy.screen_factor > 0 and not policy.dp and accepted.any() and judged:
        if kind == "sum":
            # Per-leaf ratios (statistics in different units), a whole leaf at a time; a sum's
            # replies are its updates, so nothing is formed (statistics are small per unit).
            sizes = statistic_sizes({k: replied[k] for k in judged}, accepted, weights)
        else:
            sizes = _relative(_root_sum((squares[k] for k in judged), n), accepted)
        outlier = accepted & (sizes > policy.screen_factor)
        accepted = accepted & ~outlier
        if record is not None:
            for i in outlier.nonzero()[:, 0].tolist():
                record.append(
                    {
                        "client": i,
                        "reason": "size",
                        "ratio": float(sizes[i]),
                        "threshold": float(policy.screen_factor),
                    }
                )
        metrics["rejected_norm"] = float(outlier.sum())
    else:
        metrics["rejected_norm"] = 0.0
    # ---- issue 21: the algorithm's own consistency check of each upload that passed the
    # size screen (fedprior's statistics against their declared rows, core/robust.py);
    # None: the algorithm checks nothing (fedprior with robust = "off").
    check = getattr(algorithm, "inconsistent_replies", None)
    bad = check(server, replies, weights, accepted) if check is not None else None
    if bad is not None:
        for i, why in sorted(bad.items()):
            accepted[i] = False
            if record is not None:
                record.append({"client": i, "reason": why, "ratio": float("nan"), "threshold": 0.0})
        metrics["rejected_inconsistent"] = float(len(bad))
    # ----
    metrics["median_update_norm"] = float(median)
    if not accepted.any() or not replied:
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
        size = _relative(norms, accepted)
        clip = accepted & (size > policy.clip_factor)
        factor = torch.where(clip, policy.clip_factor / size, torch.ones_like(size))
        metrics["clip_bound"] = float(policy.clip_factor * norms[accepted].median())
    clipped = clip is not None and bool(clip.any())
    if clip is not None:
        metrics["clipped"] = float(clip.sum())
    # Krum's distances, the coordinate rules and DP's sums need every update's coordinates:
    # explicit choices that pay a fleet-sized copy; the mean without DP never forms them.
    updates = _formed_updates(replied, refs) if policy.rule != "mean" or policy.dp else {}
    if clipped:
        for key, u in updates.items():
            updates[key] = u * per_client(factor.to(u.dtype), u)

    used = accepted
    if policy.rule == "krum":
        idx = accepted.nonzero()[:, 0]
        parts = [updates[k].index_select(0, idx).reshape(len(idx), -1).double() for k in judged]
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
    rewritten = False  # every update leaf replaced by the rule's estimate
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
        rewritten = True
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
            value = estimate[key] + refs[key] if key in refs else estimate[key]
            processed[key] = value.to(u.dtype).expand(u.shape).clone()
        rewritten = True

    # Every client used: the replies themselves, not a copy (fleet-sized at 10,000 clients);
    # a leaf with clipped rows is copied once, its clipped rows rewritten in that copy.
    rows = None if k == n else idx
    sub = {}
    for key, v in processed.items():
        if clipped and not rewritten and key in replied:
            sub[key] = _clip_rows(v, refs.get(key), factor, clip, rows)
        else:
            sub[key] = v if rows is None else v.index_select(0, rows)
    metrics["accepted"] = float(k)
    new_server = algorithm.server_update(server, unflatten(sub), weights.index_select(0, idx))
    # ---- issue 21: clients the algorithm's M-step down-weighted (fedprior, core/robust.py),
    # reported like a rejection once their weight is below one half.
    weigh = getattr(algorithm, "outlier_weights", None)
    robust = weigh(server, unflatten(sub)) if weigh is not None else None
    if robust is not None:
        low = (robust.weights < 0.5).nonzero()[:, 0].tolist()
        metrics["downweighted"] = float(len(low))
        for j in low if record is not None else ():
            record.append(
                {
                    "client": int(idx[j]),
                    "reason": (
                        f"prior outlier: distance {float(robust.distances[j]):.3g} > cut-off "
                        f"{robust.cutoff:.3g}, M-step weight {float(robust.weights[j]):.2g}"
                    ),
                    "ratio": float(robust.distances[j]),
                    "threshold": robust.cutoff,
                }
            )
    # ----
    return new_server, accepted, metrics


def _clip_rows(
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

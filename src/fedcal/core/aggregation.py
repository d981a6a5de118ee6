"""Server-side aggregation: a policy, and the chain of stages it composes.

One entry point, :func:`aggregate`, used by the simulator and the Flower server
alike. :func:`chain` builds the round's stages from the :class:`AggregationPolicy`
(the configuration's ``[aggregation]`` and ``[privacy]``), as Optax chains gradient
transforms; each is a small pure function of :mod:`fedcal.core.stages`. A round's
replies (stacked ``(clients, ...)``) go through, in order:

1. **Guards** (every round): a client whose reply (or, when the engine says so,
   whose new private state) holds a non-finite value is rejected; every client's
   update norm is measured once.
2. **Screening**: a client whose update norm exceeds ``screen_factor`` × the median
   norm of the finite replies is rejected: a robust, scale-free test (Blanchard et
   al. 2017; Yin et al. 2018). Summed statistics are sized leaf by leaf, as they are
   and per declared row, against the median over clients and over rows
   (:func:`statistic_sizes`).
3. **Clipping**: each update scaled to at most ``clip_factor`` × the accepted
   clients' median norm (centred clipping, Karimireddy et al. 2021; one factor per
   client); with DP, to the fixed ``dp_clip`` instead.
4. **The rule**: the algorithm's own weighted mean/sum (``mean``), the coordinate-wise
   median or trimmed mean (Yin et al. 2018), or Multi-Krum selection (Blanchard et
   al. 2017, the score s(i)).
5. **Client-level DP** (McMahan et al. 2018, DP-FedAvg): Gaussian noise N(0, σ²C²)
   on the sum of the clipped updates, from a generator seeded by the round; a
   ``"sum"`` algorithm that declares its statistics (``dp_statistics``) is clipped,
   noised and projected statistic by statistic (:func:`fedcal.core.privacy.private_sums`).
6. The algorithm's own ``server_update`` over the used (processed) replies.

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
Multi-Krum, the coordinate-wise rules and DP form them (the ``form_updates`` stage).

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

from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from fedcal.core import stages
from fedcal.core.hooks import DeclaresStatistics, WeighsOutliers
from fedcal.core.measures import (
    NORM_BLOCK,
    coordinate_rule,
    finite_rows,
    krum_scores,
    leaf_squares,
    root_sum,
    statistic_sizes,
    weighted_median_of_others,
)
from fedcal.core.schema import MAX_CLIENTS, Float, Int, checked
from fedcal.core.stages import Cohort, Round, Stage
from fedcal.core.tree import Tree, flatten, unflatten

if TYPE_CHECKING:
    from fedcal.core.algorithm import Algorithm

__all__ = [  # with the stages' shared measurements, importable from here as before
    "NORM_BLOCK",
    "PLAIN",
    "AggregationError",
    "AggregationPolicy",
    "AggregationRules",
    "aggregate",
    "chain",
    "check_policy",
    "coordinate_rule",
    "finite_rows",
    "krum_scores",
    "policy_stages",
    "statistic_sizes",
    "weighted_median_of_others",
]
_leaf_squares, _root_sum = leaf_squares, root_sum  # their names before (tests)

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
    # Adaptive clipping of declared statistics (core.privacy.AdaptiveClip): target quantile
    # γ (0: bounds as declared), geometric steps per round, rate η, the counts' multiplier.
    dp_quantile: Float = Field(default=0.0, ge=0.0, lt=1.0)
    dp_quantile_steps: int = Field(default=12, ge=1, le=100)
    dp_quantile_rate: Float = Field(default=2.0, gt=0.0, le=100.0)
    dp_count_multiplier: Float = Field(default=0.0, ge=0.0)
    # The DP noise's secret seed, mixed with each round's (None: the round's seed alone,
    # reproducible by anyone who knows the run's seed; fedcal.build draws one per run).
    dp_noise_secret: int | None = Field(default=None, ge=0)

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


def check_policy(algorithm: Algorithm, policy: AggregationPolicy) -> None:
    """Refuse a policy the algorithm's ``server_update`` cannot honour (one-line reason)."""
    kind, name, allowed = algorithm.reply_aggregation, algorithm.name, algorithm.robust_rules
    if policy.rule not in allowed:
        raise AggregationError(
            f"{name}: rule {policy.rule!r} is refused for this method (it accepts "
            f"{', '.join(allowed)}; see its reply_aggregation note)"
        )
    if policy.dp_quantile > 0 and (kind != "sum" or not isinstance(algorithm, DeclaresStatistics)):
        raise AggregationError(
            f"{name}: [privacy] quantile (adaptive clipping) adapts declared statistics' "
            "bounds (fedprior); set quantile = 0 and a fixed clip"
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


GUARDS = (Stage("reject_nonfinite", stages.reject_nonfinite), Stage("measure", stages.measure))
"""The stages every round runs first, whatever the policy (PLAIN too)."""


def policy_stages(policy: AggregationPolicy, algorithm: Algorithm) -> list[Stage]:
    """The policy's stages for this algorithm, in order: screen → clip → rule → noise.

    Screening before clipping (a rejected client must not set the clip's median, and an
    outlier clipped first would look typical and never be rejected); the rule on the
    clipped updates; DP noise last, on the sum of what the rule keeps (its sensitivity
    is the clip bound). Stages that
    cannot apply are left out: DP replaces screening and the adaptive clip by its fixed
    bound; only a ``"mean"`` server is clipped adaptively; a ``"sum"`` server that declares
    its statistics (``dp_statistics``) is clipped and noised statistic by statistic.
    """
    kind = algorithm.reply_aggregation
    per_statistic = policy.dp and kind == "sum" and isinstance(algorithm, DeclaresStatistics)
    out = []
    if policy.screen_factor > 0 and not policy.dp:
        out.append(Stage("screen", partial(stages.screen, factor=policy.screen_factor)))
    if policy.rule != "mean" or policy.dp:  # they need coordinates: an explicit fleet copy
        out.append(Stage("form_updates", stages.form_updates, per_client=False))
    if policy.dp and not per_statistic:
        out.append(Stage("clip", partial(stages.clip_to_bound, bound=policy.dp_clip)))
    elif policy.clip_factor > 0 and kind == "mean":
        # Statistics are not clipped: scaling a unit's Gram sum and its second moments by
        # one factor is no bounded contribution but a corrupted one (screening covers them).
        out.append(Stage("clip", partial(stages.clip_adaptive, factor=policy.clip_factor)))
    if policy.rule == "krum":
        rule = partial(stages.krum, byzantine=policy.krum_byzantine, select=policy.krum_select)
        out.append(Stage("krum", rule))
    elif policy.rule in ("median", "trimmed_mean"):
        rule = partial(stages.coordinate, rule=policy.rule, trim=policy.trim_fraction)
        out.append(Stage(policy.rule, rule))
    if per_statistic:
        noise = partial(
            stages.private_statistics,
            statistics=algorithm.dp_statistics,
            multiplier=policy.dp_noise_multiplier,
            scale=policy.dp_clip,
            adaptive=_adaptive_clip(policy),
            secret=policy.dp_noise_secret,
        )
        out.append(Stage("private_statistics", noise))
    elif policy.dp:
        noise = partial(
            stages.gaussian_noise,
            multiplier=policy.dp_noise_multiplier,
            bound=policy.dp_clip,
            secret=policy.dp_noise_secret,
        )
        out.append(Stage("gaussian_noise", noise, per_client=False))
    return out


def _adaptive_clip(policy: AggregationPolicy):
    """The policy's adaptive clipping of declared statistics, or None (bounds as declared)."""
    if policy.dp_quantile <= 0:
        return None
    from fedcal.core.privacy import AdaptiveClip

    return AdaptiveClip(
        quantile=policy.dp_quantile,
        count_multiplier=policy.dp_count_multiplier,
        steps=policy.dp_quantile_steps,
        rate=policy.dp_quantile_rate,
    )


def chain(policy: AggregationPolicy, algorithm: Algorithm) -> tuple[Stage, ...]:
    """The whole chain a round's replies go through (checked against the algorithm first)."""
    check_policy(algorithm, policy)
    return (*GUARDS, *policy_stages(policy, algorithm))


def _columns(metrics: dict[str, float]) -> dict[str, float]:
    """The round's metrics in their fixed order (aggregation.csv's columns); screening off
    rejects nobody (``rejected_norm`` 0)."""
    head = {
        "rejected_nonfinite": metrics["rejected_nonfinite"],
        "rejected_norm": metrics.get("rejected_norm", 0.0),
        "median_update_norm": metrics["median_update_norm"],
    }
    return {**head, **{k: v for k, v in metrics.items() if k not in head}}


def aggregate(
    algorithm: Algorithm,
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

    The policy's chain (:func:`chain`) over the cohort, then the algorithm's
    ``server_update`` over the used clients' (processed) replies. ``weights`` are the
    clients' training-row counts; ``weight_cap`` (e.g. the counts declared at the
    handshake) caps them. ``eligible`` (clients,) marks clients the engine already
    rejects (e.g. a non-finite new private state). Returns ``(new_server, accepted,
    metrics)``: ``accepted`` (clients,) bool, the clients that passed screening — the
    engine keeps the previous private state of the others (Multi-Krum's unselected
    clients are accepted but left out of the aggregate) — and round metrics
    (rejections, the median norm, the clip bound, σ). Given ``record``, one entry per
    rejected client is appended to it: ``{"client": its position in the cohort,
    "reason": "non-finite reply" | "size", "ratio": its measured size
    (:func:`statistic_sizes` or the median-norm ratio), "threshold": screen_factor}``,
    the reason a user is shown. Memory: see the module docstring.
    """
    steps = chain(policy, algorithm)
    if algorithm.inconsistent_replies is not None:  # after the size screen (or the guards)
        names = [s.name for s in steps]
        at = names.index("screen") + 1 if "screen" in names else len(GUARDS)
        check = partial(algorithm.inconsistent_replies, server)
        consistency = Stage("consistency", partial(stages.reject_inconsistent, check=check))
        steps = (*steps[:at], consistency, *steps[at:])
    flat = flatten(replies)
    # Leaves an algorithm declares unscreened (``unscreened_replies``, path prefixes) do not
    # judge a client in screening or Krum; they are still aggregated (or rejected) with it.
    rnd = Round.of(
        broadcast,
        flat,
        algorithm.reply_aggregation,
        algorithm.unscreened_replies,
        round_seed,
        state_checked=eligible is not None,
        view=algorithm.screen_view,
    )
    n = int(weights.shape[0])
    weights = weights.to(torch.float64)
    if weight_cap is not None:
        weights = torch.minimum(weights, weight_cap.to(torch.float64))
    accepted = torch.ones(n, dtype=torch.bool) if eligible is None else eligible.clone()
    cohort = stages.run(steps, Cohort(flat, weights, accepted), rnd)
    if record is not None:
        record.extend(cohort.rejections)
    metrics = _columns(cohort.metrics)
    if not cohort.accepted.any():
        return server, cohort.accepted, {**metrics, "accepted": 0.0}  # keep the model
    rows, used_weights = cohort.rows(rnd)
    metrics["accepted"] = float(len(used_weights))
    new_server = algorithm.server_update(server, unflatten(rows), used_weights)
    if isinstance(algorithm, WeighsOutliers):
        _record_downweighted(algorithm, server, rows, cohort.used, metrics, record)
    return new_server, cohort.accepted, metrics


#: How a down-weighting's record begins (its reason): the unit was aggregated, with a weight
#: below one half, not rejected (:func:`is_downweighting`; reports say "down-weighted").
DOWNWEIGHTED = "prior outlier"


def is_downweighting(reason: object) -> bool:
    """Whether a record's ``reason`` is a down-weighting (:data:`DOWNWEIGHTED`), not a
    rejection: its reply entered the aggregate with its M-step weight."""
    return str(reason).startswith(DOWNWEIGHTED)


def _record_downweighted(
    algorithm: Algorithm,
    server: Tree,
    rows: dict[str, Tensor],
    used: Tensor,
    metrics: dict[str, float],
    record: list[dict] | None,
    robust: Any = None,
) -> None:
    """Report the used clients the algorithm's M-step weighted below one half (issue 21,
    fedprior's outlier weights, :mod:`fedcal.core.robust`) like a rejection, with the
    distance and cut-off as its reason; they are still aggregated with that weight.
    ``robust``: those weights if already computed (else computed here)."""
    if robust is None:
        robust = algorithm.outlier_weights(server, unflatten(rows))
    if robust is None:
        return
    idx = used.nonzero()[:, 0]
    low = (robust.weights < 0.5).nonzero()[:, 0].tolist()
    metrics["downweighted"] = float(len(low))
    for j in low if record is not None else ():
        record.append(
            {
                "client": int(idx[j]),
                "reason": (
                    f"{DOWNWEIGHTED}: distance {float(robust.distances[j]):.3g} > cut-off "
                    f"{robust.cutoff:.3g}, M-step weight {float(robust.weights[j]):.2g}"
                ),
                "ratio": float(robust.distances[j]),
                "threshold": robust.cutoff,
            }
        )

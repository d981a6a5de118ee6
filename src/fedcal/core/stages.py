"""The server's aggregation stages: small pure functions over one round's cohort.

:func:`fedcal.core.aggregation.aggregate` composes them per policy, as Optax
composes gradient transforms (:func:`fedcal.core.aggregation.chain`). Every stage
has one signature, ``stage(cohort, round) -> cohort``: a :class:`Cohort` (the
replies stacked ``(clients, ...)``, the weights, who is accepted and used, the
metrics and rejections so far) in, a new one out; :class:`Round` holds what the
stage may read but not change (the broadcast, which leaves are models, the seed).
A stage never writes into the tensors it is given.

The stages, in the order a chain runs them:

* :func:`reject_nonfinite` and :func:`measure` (every round): a client with a
  non-finite reply leaf is rejected; each client's update norm ‖Δ_i‖ is computed
  once, a block of clients at a time.
* :func:`screen`: a client whose size exceeds ``factor`` × the cohort's scale is
  rejected (:func:`statistic_sizes` for summed statistics).
* :func:`form_updates`: every client's update Δ_i, a fleet-sized copy, for the
  stages that need coordinates (Krum, the coordinate rules, DP).
* :func:`clip_adaptive` / :func:`clip_to_bound`: one factor min(1, bound/‖Δ_i‖) per
  client. On the replies it is pending until the rows are taken (:meth:`Cohort.rows`),
  so a clipped leaf is copied once.
* :func:`krum` / :func:`coordinate`: the robust rule (Multi-Krum selection, the
  coordinate-wise median or trimmed mean replicated over the used clients).
* :func:`gaussian_noise` / :func:`private_statistics`: client-level DP on the sum.

A stage that reads each client's reply (not only the cohort's sum) says so
(:attr:`Stage.per_client`): under secure aggregation the server sees only sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from fedcal.core.measures import (
    clip_rows,
    coordinate_rule,
    finite_rows,
    krum_scores,
    leaf_squares,
    references,
    relative,
    root_sum,
    statistic_sizes,
    view_sizes,
)
from fedcal.core.tree import Tree, per_client, unflatten

if TYPE_CHECKING:
    from fedcal.core.privacy import AdaptiveClip


@dataclass(frozen=True)
class Round:
    """What every stage of a round may read: fixed before the first stage runs.

    ``floating``: the floating reply leaves (integer leaves are never modified);
    ``refs``: the broadcast value of the model leaves among them (update = reply − ref;
    a leaf absent is relative to zero, see :func:`references`); ``judged``: the leaves
    that judge a client in screening and Krum (``Algorithm.unscreened_replies`` left
    out); ``kind``: ``Algorithm.reply_aggregation``; ``seed``: the round's noise seed;
    ``state_checked``: the engine also rejected clients with a non-finite new state;
    ``view``: ``Algorithm.screen_view``, the scale-free quantities the size screen judges
    instead of the judged leaves (None: the leaves themselves).
    """

    kind: str
    floating: tuple[str, ...]
    refs: dict[str, Tensor]
    judged: tuple[str, ...]
    broadcast: Tree
    seed: int
    state_checked: bool = False
    view: Callable[[dict[str, Tensor], Tensor, Tree], dict[str, Tensor]] | None = None

    @classmethod
    def of(
        cls,
        broadcast: Tree,
        replies: dict[str, Tensor],
        kind: str = "mean",
        unscreened: tuple[str, ...] = (),
        seed: int = 0,
        state_checked: bool = False,
        view: Callable[[dict[str, Tensor], Tensor, Tree], dict[str, Tensor]] | None = None,
    ) -> Round:
        """The round of these (flat) replies; ``unscreened``: path prefixes not judged."""
        floating, refs = references(broadcast, replies, kind)
        judged = tuple(key for key in floating if not key.startswith(tuple(unscreened)))
        return cls(kind, floating, refs, judged, broadcast, seed, state_checked, view)


@dataclass(frozen=True)
class Cohort:
    """One round's replies on their way to the server update (what the stages pass on).

    ``replies``: flat ``{path: (clients, ...)}``, every leaf; ``weights``: (clients,)
    float64; ``accepted``: passed the checks so far (the engine keeps the previous
    private state of the others); ``selected``: Krum's choice among them (None: all
    accepted are used); ``norms`` / ``squares``: ‖Δ_i‖ and each leaf's Σ Δ² (after
    :func:`measure`); ``updates``: the formed Δ_i of the floating leaves (after
    :func:`form_updates`, clipped with them); ``factor`` / ``clip``: the clip pending
    on the replies' ``clip`` rows; ``rewritten``: the replies already hold the rule's
    estimate (the pending clip is in it). ``metrics`` and ``rejections`` accumulate.
    """

    replies: dict[str, Tensor]
    weights: Tensor
    accepted: Tensor
    selected: Tensor | None = None
    norms: Tensor | None = None
    squares: dict[str, Tensor] | None = None
    updates: dict[str, Tensor] | None = None
    factor: Tensor | None = None
    clip: Tensor | None = None
    rewritten: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    rejections: tuple[dict, ...] = ()

    @property
    def used(self) -> Tensor:
        """(clients,) bool: the clients whose replies enter the server update."""
        return self.accepted if self.selected is None else self.selected

    def but(self, metrics: dict[str, float] | None = None, **changes) -> Cohort:
        """A copy with ``changes`` and ``metrics`` added to the metrics (never in place)."""
        return dataclasses.replace(self, metrics={**self.metrics, **(metrics or {})}, **changes)

    def rows(self, rnd: Round) -> tuple[dict[str, Tensor], Tensor]:
        """The used clients' replies (pending clip applied) and weights: the server's input.

        Every client used: the replies themselves, not a copy (fleet-sized at 10,000
        clients); a leaf with clipped rows is copied once, those rows rewritten in it.
        """
        idx = self.used.nonzero()[:, 0]
        keep = None if len(idx) == len(self.accepted) else idx
        pending = self.clip is not None and bool(self.clip.any()) and not self.rewritten
        out = {}
        for key, v in self.replies.items():
            if pending and key in rnd.floating:
                out[key] = clip_rows(v, rnd.refs.get(key), self.factor, self.clip, keep)
            else:
                out[key] = v if keep is None else v.index_select(0, keep)
        return out, self.weights.index_select(0, idx)


@dataclass(frozen=True)
class Stage:
    """A named step of the chain: ``apply(cohort, round) -> cohort``.

    ``per_client``: it reads each client's reply, not only the cohort's sum (so it
    cannot run where the server sees only sums, e.g. under secure aggregation).
    """

    name: str
    apply: Callable[[Cohort, Round], Cohort]
    per_client: bool = True

    def __call__(self, cohort: Cohort, rnd: Round) -> Cohort:
        return self.apply(cohort, rnd)


def run(stages: Iterable[Stage], cohort: Cohort, rnd: Round) -> Cohort:
    """The stages applied in order (each to the cohort the previous one returned)."""
    for stage in stages:
        cohort = stage(cohort, rnd)
    return cohort


def _idle(cohort: Cohort, rnd: Round) -> bool:
    """Nothing for a clip or rule stage to do: no accepted client, or no floating leaf."""
    return not rnd.floating or not bool(cohort.accepted.any())


# ---- the stages ----------------------------------------------------------------------------


def reject_nonfinite(cohort: Cohort, rnd: Round) -> Cohort:
    """Reject a client any of whose floating reply values is NaN or ±inf (the first check).

    Rejections (and clients the engine already rejected) are recorded with the reason
    ``"non-finite reply"`` (``"… or state"`` when the engine checked the states too).
    """
    finite = finite_rows(cohort.replies)
    accepted = cohort.accepted & finite if finite.numel() else cohort.accepted
    reason = "non-finite reply or state" if rnd.state_checked else "non-finite reply"
    records = tuple(
        {"client": i, "reason": reason, "ratio": float("nan"), "threshold": 0.0}
        for i in (~accepted).nonzero()[:, 0].tolist()
    )
    return cohort.but(
        {"rejected_nonfinite": float((~accepted).sum())},
        accepted=accepted,
        rejections=cohort.rejections + records,
    )


def measure(cohort: Cohort, rnd: Round) -> Cohort:
    """‖Δ_i‖ = √(Σ_l Σ (Δ_il)²) of every client, and their median over the accepted.

    The round's only pass over the replies for norms (:func:`leaf_squares`, a block of
    clients at a time): screening and clipping reuse them. The median is reported as
    ``median_update_norm`` (NaN when no client is accepted).
    """
    n = len(cohort.accepted)
    squares = leaf_squares({k: cohort.replies[k] for k in rnd.floating}, n, rnd.refs)
    norms = root_sum(squares.values(), n)
    accepted = cohort.accepted
    median = norms[accepted].median() if accepted.any() else torch.tensor(float("nan"))
    return cohort.but({"median_update_norm": float(median)}, norms=norms, squares=squares)


def screen(cohort: Cohort, rnd: Round, factor: float) -> Cohort:
    """Reject a client whose size exceeds ``factor`` × the accepted cohort's scale.

    A model update's size is ‖Δ_i‖ over the judged leaves against their median (Blanchard
    et al. 2017; Yin et al. 2018), as it is and per declared row, against the others'
    rows-weighted median too, whichever is smaller (:func:`statistic_sizes`: local training
    takes steps ∝ rows, so a data-rich unit's update is larger by its information, not by
    a lie; issue 34.3); with equal rows, the plain median ratio. Summed statistics are sized
    leaf by leaf the same way (``weights`` are the rows). Each rejection is
    recorded as ``{"client", "reason": "size", "ratio": its size, "threshold": factor}``.
    With ``rnd.view`` the screen sizes the algorithm's scale-free quantities instead
    (issue 20 item 3: leaves that grow with a unit's inputs or rows would reject honest
    units of another kind), leaf by leaf (:func:`view_sizes`).
    """
    accepted = cohort.accepted
    if not accepted.any() or not rnd.judged:
        return cohort.but({"rejected_norm": 0.0})
    n = len(accepted)
    if rnd.view is not None:
        view = rnd.view({k: cohort.replies[k] for k in rnd.floating}, cohort.weights, rnd.broadcast)
        sizes = view_sizes(view, accepted, cohort.weights, rnd.refs)
    elif rnd.kind == "sum":
        # Per-leaf ratios (statistics in different units), a whole leaf at a time; a sum's
        # replies are its updates, so nothing is formed (statistics are small per unit).
        judged = {k: cohort.replies[k] for k in rnd.judged}
        sizes = statistic_sizes(judged, accepted, cohort.weights)
    else:  # a model update: local training takes steps ∝ rows, so also judged per row
        norms = root_sum((cohort.squares[k] for k in rnd.judged), n)
        sizes = statistic_sizes({"update": norms.unsqueeze(1)}, accepted, cohort.weights)
    outlier = accepted & (sizes > factor)
    records = tuple(
        {"client": i, "reason": "size", "ratio": float(sizes[i]), "threshold": float(factor)}
        for i in outlier.nonzero()[:, 0].tolist()
    )
    return cohort.but(
        {"rejected_norm": float(outlier.sum())},
        accepted=accepted & ~outlier,
        rejections=cohort.rejections + records,
    )


def reject_inconsistent(
    cohort: Cohort, rnd: Round, check: Callable[[Tree, Tensor, Tensor], dict[int, str] | None]
) -> Cohort:
    """Reject the accepted clients whose upload the algorithm finds inconsistent (issue 21).

    ``check(replies, weights, accepted)`` is the algorithm's ``inconsistent_replies`` bound
    to the server state (e.g. fedprior's statistics against their declared rows and the
    broadcast prior, :mod:`fedcal.core.robust`): ``{client: reason}``, or None when the
    algorithm checks nothing. Each rejection is recorded with its reason.
    """
    bad = check(unflatten(cohort.replies), cohort.weights, cohort.accepted)
    if bad is None:
        return cohort
    accepted = cohort.accepted.clone()
    records = []
    for i, why in sorted(bad.items()):
        accepted[i] = False
        records.append({"client": i, "reason": why, "ratio": float("nan"), "threshold": 0.0})
    return cohort.but(
        {"rejected_inconsistent": float(len(bad))},
        accepted=accepted,
        rejections=cohort.rejections + tuple(records),
    )


def form_updates(cohort: Cohort, rnd: Round) -> Cohort:
    """Every client's update Δ_i = reply − ref (or the reply): a fleet-sized copy per leaf.

    Only the stages that need coordinates ask for it: Krum (pairwise distances), the
    coordinate rules and DP (noisy sums of the clipped updates). Linear in the replies.
    """
    if _idle(cohort, rnd):
        return cohort
    updates = {}
    for key in rnd.floating:
        reply = cohort.replies[key]
        updates[key] = reply - rnd.refs[key] if key in rnd.refs else reply
    return cohort.but(updates=updates)


def clip_adaptive(cohort: Cohort, rnd: Round, factor: float) -> Cohort:
    """Scale each update to at most ``factor`` × the accepted clients' median ‖Δ‖.

    Centred clipping (Karimireddy et al. 2021) with the median as the reference scale;
    one factor per client, min(1, factor / (‖Δ_i‖ / median)). Reports the bound
    (``clip_bound``) and how many were clipped.
    """
    if _idle(cohort, rnd):
        return cohort
    size = relative(cohort.norms, cohort.accepted)
    clip = cohort.accepted & (size > factor)
    scale = torch.where(clip, factor / size, torch.ones_like(size))
    bound = float(factor * cohort.norms[cohort.accepted].median())
    return _clipped(cohort, clip, scale, bound)


def clip_to_bound(cohort: Cohort, rnd: Round, bound: float) -> Cohort:
    """Scale each update to at most the fixed L2 ``bound`` C (DP-FedAvg, McMahan et al. 2018)."""
    if _idle(cohort, rnd):
        return cohort
    c = torch.tensor(bound, dtype=torch.float64)
    norms = cohort.norms
    clip = cohort.accepted & (norms > c)
    scale = torch.where(clip, c / norms.clamp_min(1e-300), torch.ones_like(norms))
    return _clipped(cohort, clip, scale, float(c))


def _clipped(cohort: Cohort, clip: Tensor, factor: Tensor, bound: float) -> Cohort:
    """The formed updates scaled now; the replies' scaling pending (:meth:`Cohort.rows`)."""
    updates = cohort.updates
    if updates is not None and bool(clip.any()):
        updates = {k: u * per_client(factor.to(u.dtype), u) for k, u in updates.items()}
    metrics = {"clip_bound": bound, "clipped": float(clip.sum())}
    return cohort.but(metrics, updates=updates, factor=factor, clip=clip)


def krum(cohort: Cohort, rnd: Round, byzantine: int, select: int) -> Cohort:
    """Multi-Krum (Blanchard et al. 2017): use the m accepted clients of lowest score s(i).

    s(i) over the judged leaves of the formed updates (:func:`krum_scores`; for summed
    statistics each leaf divided by its median norm, as they are in different units).
    m = ``select`` or n − f. Not selected is not rejected: the client keeps its private
    progress (an honest but atypical sensor would otherwise be frozen round after round).
    """
    if _idle(cohort, rnd):
        return cohort
    accepted = cohort.accepted
    idx = accepted.nonzero()[:, 0]
    updates = cohort.updates
    parts = [updates[k].index_select(0, idx).reshape(len(idx), -1).double() for k in rnd.judged]
    if rnd.kind == "sum":  # statistics in different units: each leaf by its median norm
        parts = [p / p.norm(dim=1).median().clamp_min(1e-300) for p in parts]
    scores = krum_scores(torch.cat(parts, 1), byzantine)
    m = select or max(1, len(idx) - byzantine)
    keep = idx[scores.argsort(stable=True)[: min(m, len(idx))]]
    selected = torch.zeros(len(accepted), dtype=torch.bool)
    selected[keep] = True
    return cohort.but({"krum_dropped": float((accepted & ~selected).sum())}, selected=selected)


def coordinate(cohort: Cohort, rnd: Round, rule: str, trim: float) -> Cohort:
    """The coordinate-wise median or trimmed mean (Yin et al. 2018) of the used updates.

    Replicated over the cohort: the used clients' mean is the estimate, their sum k ×
    the estimate (a robust mean or sum, see :mod:`fedcal.core.aggregation`).
    """
    if _idle(cohort, rnd):
        return cohort
    chosen = _chosen(cohort)
    return _replicated(cohort, rnd, coordinate_rule(chosen, rule, trim))


def _noise_generator(rnd: Round, secret: int | None) -> torch.Generator:
    """The DP noise's generator: the round's seed, mixed with the run's ``secret`` if any
    (without one, anyone who knows the run's seed can redraw the noise)."""
    seed = int(rnd.seed) % (2**63)
    if secret is not None:
        mixed = np.random.SeedSequence([int(secret), seed]).generate_state(1, dtype=np.uint64)
        seed = int(mixed[0]) >> 1
    return torch.Generator().manual_seed(seed)


def gaussian_noise(
    cohort: Cohort, rnd: Round, multiplier: float, bound: float, secret: int | None = None
) -> Cohort:
    """DP-FedAvg (McMahan et al. 2018): (Σ clipped Δ_i + N(0, σ²C²·I)) / k, uniform weights.

    The noise is drawn leaf by leaf from a generator seeded by the round; the noisy
    mean replaces every used reply (replicated) and the weights become uniform.
    """
    if _idle(cohort, rnd):
        return cohort
    chosen, k = _chosen(cohort), int(cohort.used.sum())
    gen = _noise_generator(rnd, secret)
    std = multiplier * bound
    estimate = {}
    for key, u in chosen.items():
        noise = torch.randn(u.shape[1:], generator=gen, dtype=torch.float64)
        estimate[key] = (u.sum(0) + (std * noise).to(u.dtype)) / k
    out = _replicated(cohort, rnd, estimate)
    return out.but({"dp_noise_std": float(std)}, weights=torch.ones_like(cohort.weights))


def private_statistics(
    cohort: Cohort,
    rnd: Round,
    statistics: Callable[[Tree], dict],
    multiplier: float,
    scale: float,
    adaptive: AdaptiveClip | None = None,
    secret: int | None = None,
) -> Cohort:
    """Declared summed statistics clipped, noised and projected one by one (DP).

    :func:`fedcal.core.privacy.private_sums` with the algorithm's declaration
    (``dp_statistics(broadcast)``: core.hooks.DeclaresStatistics); ``scale`` (the policy's C)
    scales the declared bounds; ``adaptive`` (a ``privacy.AdaptiveClip``) adapts them to a private
    quantile of the clients' norms first. The private sum replaces the used replies.
    """
    from fedcal.core.privacy import private_sums

    if _idle(cohort, rnd):
        return cohort
    chosen, k = _chosen(cohort), int(cohort.used.sum())
    gen = _noise_generator(rnd, secret)
    declared = statistics(rnd.broadcast)
    sums, dp_metrics = private_sums(chosen, declared, multiplier, gen, scale, adaptive)
    replies = dict(cohort.replies)
    for key, u in cohort.updates.items():
        replies[key] = (sums[key] / k).to(u.dtype).expand(u.shape).clone()
    metrics = {**dp_metrics, "dp_noise_std": float(multiplier * scale)}
    return cohort.but(metrics, replies=replies, rewritten=True)


def _chosen(cohort: Cohort) -> dict[str, Tensor]:
    """The used clients' formed updates (k, ...)."""
    idx = cohort.used.nonzero()[:, 0]
    return {key: u.index_select(0, idx) for key, u in cohort.updates.items()}


def _replicated(cohort: Cohort, rnd: Round, estimate: dict[str, Tensor]) -> Cohort:
    """Every floating reply replaced by the estimate (+ its reference), one row per client."""
    replies = dict(cohort.replies)
    for key, u in cohort.updates.items():
        value = estimate[key] + rnd.refs[key] if key in rnd.refs else estimate[key]
        replies[key] = value.to(u.dtype).expand(u.shape).clone()
    return cohort.but(replies=replies, rewritten=True)

"""The server's side of SecAgg+ (:mod:`~fedcal.engine.flower.secagg`): a round's train
messages through steps 1–4 among the sites that train, relayed over the round loop's
transport; the server learns only the unmasked sum
(:class:`~fedcal.engine.flower.secagg.SecureSum`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedcal.engine.flower.kinds import REFUSED, Kind, Stage
from fedcal.engine.flower.secagg import (
    SECAGG,
    Layout,
    SecureAggregation,
    SecureAggregationError,
    SecureSum,
    _pair_key,
    decode,
    group_of,
    neighbours,
    pair_mask,
    prg,
    quantization_bound,
    threshold_of,
)

if TYPE_CHECKING:
    from flwr.app import RecordDict


def _relay(transport, stage_msgs, t):
    """One protocol step over the round loop's transport (a query message per site)."""
    return transport.exchange(stage_msgs, SECAGG, t)


def _message(values: dict) -> RecordDict:
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({SECAGG: ConfigRecord(values)})


@dataclass
class _Protocol:
    """One round's SecAgg+ among the training sites: the ring, thresholds, failures so far."""

    t: int
    ring: dict[int, list[int]]  # site → its neighbours
    thr: dict[int, int]  # site → shares needed to rebuild its secrets
    failures: dict[int, str] = field(default_factory=dict)
    group: dict[int, int] = field(default_factory=dict)  # site → its group (secagg-groups)

    def alive(self, live: set[int], step: str) -> set[int]:
        """The sites of ``live`` that go on: every one still has its threshold of live
        neighbours. In a grouped run a group where one has not is left out of the round
        (its live sites failed), the others go on; else (or when no group is left) the
        round fails."""
        short = [n for n in sorted(live) if len(set(self.ring[n]) & live) < self.thr[n]]
        if not short:
            return live
        lost = {self.group[n] for n in short} if self.group else set()
        keep = {n for n in live if self.group and self.group[n] not in lost}
        if not self.group or not keep:
            n = short[0]
            raise SecureAggregationError(
                f"round {self.t}: secure aggregation {step}: site {n} has "
                f"{len(set(self.ring[n]) & live)} live neighbours, threshold {self.thr[n]}; "
                f"failed: {self.failures}"
            )
        for n in sorted(live - keep):
            self.failures[n] = f"secure aggregation {step}: its group fell below its threshold"
        return keep


def secure_exchange(
    settings: SecureAggregation,
    layout: Layout,
    transport,
    contents: Mapping[int, RecordDict],
    t: int,
    members: list[int] | None = None,
) -> tuple[dict[int, RecordDict], dict[int, str], SecureSum]:
    """Round ``t``'s train messages through SecAgg+ (steps 1–4) among the sites that train.

    Returns the replies (per-sensor parts without statistics), the failures (a site
    that failed a step sits the round out), and the unmasked :class:`SecureSum`.
    With ``secagg-groups``, the groups are those of ``members`` (every site of the
    federation; default the training ones), fixed for the run: a site left alone in its
    group this round (the others offline) is not asked to train, since its group's sum
    would be its own statistics.
    """
    from fedcal.engine.flower.kinds import CONTROL

    training = sorted(n for n, c in contents.items() if list(c[CONTROL]["train"]))
    fixed = group_of(sorted(set(members or []) | set(training)), settings.groups)
    alone = (
        {n for n in training if sum(fixed[m] == fixed[n] for m in training) < 2}
        if settings.groups >= 2
        else set()
    )
    contents = {n: c for n, c in contents.items() if n not in alone}
    training = [n for n in training if n not in alone]
    if len(training) < 2:
        raise SecureAggregationError(
            f"round {t}: secure aggregation needs at least 2 sites training, got {len(training)}"
        )
    group = {n: fixed[n] for n in training}
    ring: dict[int, list[int]] = {}
    for g in sorted(set(group.values())):  # the masks cancel within each group's sum
        ring.update(neighbours([n for n in training if group[n] == g], settings.shares))
    thr = {n: threshold_of(settings, len(ring[n])) for n in training}
    run = _Protocol(t, ring, thr, group=group if settings.groups >= 2 else {})
    run.failures.update({n: "secure aggregation: alone in its group this round" for n in alone})
    pks = _setup(run, transport, training)
    u2, inbox = _share_keys(run, transport, pks)
    replies, masked, included = _collect(run, transport, contents, training, u2, inbox, layout)
    u2 = {n for n in u2 if group[n] in {group[m] for m in masked}}  # groups left out: gone
    totals = _unmask(run, transport, u2, masked, pks, layout, group)
    with np.errstate(over="ignore"):
        total = np.zeros(layout.size, dtype=np.uint64)
        for v in totals.values():
            total = total + v
    sums, count, clipped = decode(layout, total)
    for rep in replies.values():  # the protocol's records are not the run's business
        for key in (SECAGG, f"{SECAGG}-masked"):
            if key in rep:
                del rep[key]
    outcome = SecureSum(
        sums,
        count,
        clipped,
        included,
        sorted(u2 - set(masked)),
        quantization_bound(layout, count),
        sum(int(y.nbytes) for y in masked.values()),
    )
    if settings.groups >= 2:
        outcome.groups = {
            g: (sorted(n for n in masked if group[n] == g), *decode(layout, v)[:2])
            for g, v in sorted(totals.items())
        }
    return replies, run.failures, outcome


def _setup(run: _Protocol, transport, training: list[int]) -> dict[int, tuple[bytes, bytes]]:
    """Step 1, setup: each site's two public keys."""
    t, ring, thr = run.t, run.ring, run.thr
    msgs = {
        n: _message({"stage": Stage.SETUP, "round": t, "threshold": thr[n], "neighbours": ring[n]})
        for n in training
    }
    replies, failed = _relay(transport, msgs, t)
    run.failures.update({n: f"secure aggregation setup: {why}" for n, why in failed.items()})
    pks = {n: (bytes(r[SECAGG]["pk1"]), bytes(r[SECAGG]["pk2"])) for n, r in replies.items()}
    live = run.alive(set(pks), Stage.SETUP)
    return {n: k for n, k in pks.items() if n in live}


def _share_keys(
    run: _Protocol, transport, pks: dict[int, tuple[bytes, bytes]]
) -> tuple[set[int], dict[int, tuple[list[int], list[bytes]]]]:
    """Step 2, share keys: each site's encrypted shares for its neighbours; the sites that
    answered and, per site, the ciphertexts addressed to it (by source)."""
    t, ring, u1 = run.t, run.ring, set(pks)
    msgs = {}
    for n in sorted(u1):
        ids = [m for m in ring[n] if m in u1]
        msgs[n] = _message(
            {
                "stage": Stage.SHARE,
                "round": t,
                "ids": ids,
                "pk1": [pks[m][0] for m in ids],
                "pk2": [pks[m][1] for m in ids],
            }
        )
    replies, failed = _relay(transport, msgs, t)
    run.failures.update({n: f"secure aggregation share-keys: {why}" for n, why in failed.items()})
    u2 = run.alive(set(replies), "share-keys")
    inbox: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in u2}
    for src, rep in replies.items():
        if src not in u2:
            continue
        for dst, ctxt in zip(rep[SECAGG]["dsts"], rep[SECAGG]["ctxts"], strict=True):
            if int(dst) in u2 and int(dst) in ring[src]:
                inbox[int(dst)][0].append(src)
                inbox[int(dst)][1].append(bytes(ctxt))
    return u2, inbox


def _collect(
    run: _Protocol,
    transport,
    contents: Mapping[int, RecordDict],
    training: list[int],
    u2: set[int],
    inbox: dict[int, tuple[list[int], list[bytes]]],
    layout: Layout,
) -> tuple[dict[int, RecordDict], dict[int, np.ndarray], dict[int, list[int]]]:
    """Step 3, collect: the train message with the ciphertexts addressed to each site; the
    replies, each site's masked vector and the sensors in it."""
    from flwr.app import ConfigRecord, RecordDict

    t = run.t
    msgs = {n: c for n, c in contents.items() if n not in training}
    for n in sorted(u2):
        rec = {"stage": Stage.COLLECT, "round": t, "srcs": inbox[n][0], "ctxts": inbox[n][1]}
        rec["layout"] = layout.to_json()
        msgs[n] = RecordDict({**dict(contents[n].items()), SECAGG: ConfigRecord(rec)})
    for n in training:
        if n not in u2 and n not in run.failures:
            run.failures[n] = "secure aggregation: left out before its key shares"
    replies, failed = transport.exchange(msgs, Kind.TRAIN, t)
    run.failures.update(failed)
    masked: dict[int, np.ndarray] = {}
    included: dict[int, list[int]] = {}
    for n in sorted(u2):
        rep = replies.get(n)
        if rep is None or REFUSED in rep:
            continue
        y, inc, why = _masked_vector(rep, layout)
        if why is not None:
            run.failures[n] = why
            replies.pop(n)
            continue
        masked[n], included[n] = y, inc
    live = run.alive(set(masked), Stage.COLLECT)
    for n in set(masked) - live:  # its group was left out: its reply is not the round's
        del masked[n], included[n]
        replies.pop(n, None)
    return replies, masked, included


def _masked_vector(rep: RecordDict, layout: Layout) -> tuple[np.ndarray, list[int], str | None]:
    """A site's masked vector and the sensors in it, or why its reply has none usable."""
    from fedcal.engine.flower.wire import to_numpy

    try:
        y = to_numpy(rep[f"{SECAGG}-masked"]["y"])
        inc = [int(i) for i in rep[SECAGG]["included"]]
    except KeyError:
        return None, [], "secure aggregation: reply without a masked vector"
    if y.dtype != np.uint64 or y.shape != (layout.size,):
        why = f"secure aggregation: masked vector {y.dtype}{y.shape}, not uint64({layout.size},)"
        return None, [], why
    return y, inc, None


def _unmask(
    run: _Protocol,
    transport,
    u2: set[int],
    masked: dict[int, np.ndarray],
    pks: dict[int, tuple[bytes, bytes]],
    layout: Layout,
    group: Mapping[int, int],
) -> dict[int, np.ndarray]:
    """Step 4, unmask: shares of active sites' seeds and of dropped sites' sk1; per group of
    sites, the sum of its masked vectors with every mask removed (a site failing this step
    is named only if its secret cannot be rebuilt)."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares

    t, ring, thr, u3 = run.t, run.ring, run.thr, set(masked)
    msgs = {}
    for n in sorted(u3):
        near = [m for m in ring[n] if m in u2]
        active = [m for m in near if m in u3]
        dead = [m for m in near if m not in u3]
        msgs[n] = _message({"stage": Stage.UNMASK, "round": t, "active": active, "dead": dead})
    answers, failed = _relay(transport, msgs, t)
    shares: dict[int, list[bytes]] = {n: [] for n in u2}
    for rep in answers.values():
        for owner, share in zip(rep[SECAGG]["ids"], rep[SECAGG]["shares"], strict=True):
            if int(owner) in shares:
                shares[int(owner)].append(bytes(share))
    with np.errstate(over="ignore"):
        totals = {g: np.zeros(layout.size, dtype=np.uint64) for g in sorted(set(group.values()))}
        for n, y in masked.items():
            totals[group[n]] = totals[group[n]] + y
        for n in sorted(u2):
            total = totals[group[n]]
            if len(shares[n]) < thr[n]:
                raise SecureAggregationError(
                    f"round {t}: secure aggregation unmask: {len(shares[n])} shares of site {n}'s "
                    f"secret, threshold {thr[n]}; failed: {failed}"
                )
            secret = combine_shares(shares[n])
            if n in u3:  # an active site: remove its self-mask
                total = total - prg(secret, layout.size)
            else:  # a dropped site: remove the pairwise masks its live neighbours added
                for m in ring[n]:
                    if m in u3 and m != n:
                        total = total - pair_mask(m, n, _pair_key(secret, pks[m][0]), layout.size)
            totals[group[n]] = total
    return {g: v for g, v in totals.items() if any(group[n] == g for n in masked)}

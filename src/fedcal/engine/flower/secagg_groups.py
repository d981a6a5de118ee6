"""Robust and secure together (issue 36.2): a secure round's groups judged from their sums.

With ``secagg-groups`` G ≥ 2 (:class:`~fedcal.engine.flower.secagg.SecureAggregation`) the
sites are split into G fixed groups of at least two (:func:`~fedcal.engine.flower.secagg.group_of`)
and each group's statistics are summed securely on their own: the server learns G sums, not
one, and never a site's. fedprior's robust M-step (``robust`` ≠ "off") then checks the
identities each group's sums must obey and, with three or more consistent groups, judges each
one's posterior moments against the others' (:func:`fedcal.core.group_check.group_verdict`,
in the chosen basis's coordinates); a group that fails is left out, with its units, and
the M-step reads the kept groups' sums. When every group is kept the sum is the one secure
sum of every site, bit for bit (no false rejection costs a clean run anything).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedcal.core.group_check import GroupVerdict, group_verdict
from fedcal.core.robust import prior_frame
from fedcal.core.tree import Tree
from fedcal.engine.flower.secagg import SecureSum

#: The leaves the groups are judged by: fedprior's posterior means, second moments and GLS
#: right-hand sides.
MOMENTS = ("mean", "second", "gls_rhs")


def judged(algorithm: Any, server: Tree, out: SecureSum) -> GroupVerdict | None:
    """The verdict on each group of ``out`` (in sorted group order), or None when nothing is
    judged: one sum, ``robust = "off"``, or an upload without posterior moments."""
    if len(out.groups) < 2 or getattr(algorithm, "robust", "off") == "off":
        return None
    if any(k not in out.sums for k in MOMENTS) or "mu" not in server:
        return None
    order = sorted(out.groups)
    sums = {
        k: torch.stack([torch.from_numpy(np.asarray(out.groups[g][1][k])) for g in order])
        for k in MOMENTS
    }
    counts = torch.tensor([float(out.groups[g][2]) for g in order], dtype=torch.float64)
    used = torch.nonzero(server["mask"])[:, 0] if "mask" in server else slice(None)
    frame = prior_frame(server["mu"], server["sigma"])
    return group_verdict(sums, counts, frame, used)


def kept_sums(
    out: SecureSum, verdict: GroupVerdict | None
) -> tuple[dict[str, np.ndarray], list[int], list[dict[str, Any]]]:
    """(the sums the M-step reads, the sites left out, a record per left-out group's site:
    group, reason, ratio, threshold). Every group kept: the one secure sum itself."""
    if verdict is None or bool(verdict.kept.all()):
        return out.sums, [], []
    order = sorted(out.groups)
    kept = [g for g, ok in zip(order, verdict.kept.tolist(), strict=True) if ok]
    sums = {k: np.zeros_like(v) for k, v in out.sums.items()}
    for g in kept:
        for k, v in out.groups[g][1].items():
            sums[k] = np.asarray(sums[k] + v)
    left, record = [], []
    for j, g in enumerate(order):
        why = verdict.reason(j)
        if why is None:
            continue
        ratio, limit = float(verdict.distances[j]), float(verdict.cutoffs[j])
        for n in out.groups[g][0]:
            left.append(n)
            record.append(
                {"site": n, "group": g, "reason": why, "ratio": ratio, "threshold": limit}
            )
    return sums, sorted(left), record


def judge_groups(
    algorithm: Any, server: Tree, out: SecureSum, entry: dict[str, Any]
) -> tuple[dict[str, np.ndarray], list[int]]:
    """(the sums the M-step reads, the sensors left out with their group) of a secure
    round, its verdicts recorded in the round's log ``entry``: the groups (``secure``), a
    ``screening`` row per sensor left out, and, for a robust algorithm, the aggregation's
    ``groups``, ``groups_left_out`` and ``unjudged`` (:func:`group_metrics`)."""
    verdict = judged(algorithm, server, out)
    sums, left_sites, record = kept_sums(out, verdict)
    left = sorted(i for n in left_sites for i in out.included.get(n, []))
    if verdict is not None:
        entry["secure"]["groups"] = {
            str(g): {"sites": nodes, "sensors": count}
            for g, (nodes, _, count) in out.groups.items()
        }
    if record:
        entry["screening"] = [
            {**r, "client": i} for r in record for i in out.included.get(r["site"], [])
        ]
        entry["screened"] = left
    if getattr(algorithm, "robust", "off") != "off":
        entry["aggregation"] = group_metrics(out, verdict)
    return sums, left


def group_metrics(out: SecureSum, verdict: GroupVerdict | None) -> dict[str, float]:
    """A robust secure round's record: its groups, those left out, and ``unjudged`` when
    no group could be judged against the others (fewer than 3 consistent groups: only the
    summed identities were checked, or with one sum nothing; said, not silent)."""
    row = {"groups": float(max(1, len(out.groups)))}
    if verdict is not None:
        row["groups_left_out"] = float((~verdict.kept).sum())
    if verdict is None or bool(verdict.distances.isnan().all()):
        row["unjudged"] = 1.0
    return row

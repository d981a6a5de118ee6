"""A round's replies on the server side of the Flower adapter, checked and folded in: each
site's reply split into its sensors' parts, each part checked against what an honest client
sends (:mod:`~fedcal.engine.flower.validation`), the evaluation rows read, the uploads
stacked in client-index order and aggregated by the simulator's own step, or a secure run's
unmasked sum made the server's update. :class:`~fedcal.engine.flower.server.Federation`
keeps the run's state and calls these in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedcal.engine.flower.wire import split_parts

if TYPE_CHECKING:
    from flwr.app import RecordDict

    from fedcal.core.algorithm import Algorithm
    from fedcal.core.tree import Tree
    from fedcal.engine.flower.secagg import SecureSum


def aggregate(
    algorithm: Algorithm,
    server: Tree,
    replies: Tree,
    weights,
    policy,
    round_seed: int,
    eligible=None,
    record: list | None = None,
) -> tuple[Tree, object, dict]:
    """The one step where (validated) replies stacked ``(clients, …)`` become the next server.

    The simulator's own step (:func:`fedcal.core.aggregation.aggregate`): screening,
    clipping, the robust rule and DP noise of the run's ``[aggregation]`` /
    ``[privacy]`` policy, then the algorithm's ``server_update``, with the capped
    row counts as weights and the simulator's seed for the noise — so a Flower
    run equals the simulator's. ``eligible``: clients whose new private state is
    finite (the simulator rejects the others). ``record`` receives each rejection's
    reason (see the core function). Returns ``(server, accepted, metrics)``.
    """
    from fedcal.core.aggregation import aggregate as aggregate_replies

    down = algorithm.broadcast(server)
    return aggregate_replies(
        algorithm,
        server,
        down,
        replies,
        weights,
        policy,
        round_seed,
        eligible=eligible,
        record=record,
    )


def stack_padded(trees: list[Mapping]) -> Tree:
    """Stack one tree per client into a client tree, zero-padding ragged leaves.

    A leaf whose shape depends on the client's row count (``centralized``
    uploads its rows) is padded with zeros to the largest reply, as
    :class:`fedcal.core.data.ClientData` pads rows; the row count travels
    with it, so the padding is never read as data.
    """
    import torch

    from fedcal.core.tree import tree_map

    def pad_and_stack(*leaves):
        shape = [max(sizes) for sizes in zip(*(t.shape for t in leaves), strict=True)]
        padded = []
        for t in leaves:
            if list(t.shape) != shape:
                out = t.new_zeros(shape)
                out[tuple(slice(0, n) for n in t.shape)] = t
                t = out
            padded.append(t)
        return torch.stack(padded)

    return tree_map(pad_and_stack, trees[0], *trees[1:])


def site_parts(
    replies: Mapping[int, RecordDict],
    failures: Mapping[int, str],
    sites: Mapping[int, list[int]],
    members: Mapping[int, Any],
    rejected: dict[int, str],
) -> dict[int, RecordDict]:
    """Client index → its part of its site's reply; a sensor without a usable one (the whole
    reply malformed or naming other sites' sensors, or no part for it) into ``rejected``."""
    parts: dict[int, RecordDict] = {}
    for nid, rep in replies.items():
        if nid in failures:
            continue
        mine, why = _own_parts(nid, rep, members)
        for index in sites.get(nid, []):
            if why is not None:
                rejected[index] = why
            elif index not in mine:
                rejected[index] = "no part for this sensor in its site's reply"
            else:
                parts[index] = mine[index]
    return parts


def _own_parts(
    nid: int, rep: RecordDict, members: Mapping[int, Any]
) -> tuple[dict[int, RecordDict], str | None]:
    """A site's reply as parts for its own sensors, or why the whole reply is unusable."""
    parts, _, bad = split_parts(rep)
    mine = {m for m, member in members.items() if member.node_id == nid}
    foreign = sorted(set(parts) - mine)
    if bad or foreign:
        return {}, f"site reply with malformed record names {bad} or other sites' {foreign}"
    return parts, None


def claimed_rows(parts: Mapping[int, RecordDict], rejected: dict[int, str]) -> dict[int, int]:
    """Client index → the train rows its part claims; a malformed info into ``rejected``."""
    from fedcal.engine.flower.validation import check_info

    claimed: dict[int, int] = {}
    for index in sorted(parts):
        _sort_out(index, *check_info(parts[index], index), claimed, rejected)
    return claimed


def _sort_out(index: int, value: Any, why: str | None, kept: dict, rejected: dict) -> None:
    """``value`` kept under ``index``, or ``why`` not recorded as its rejection."""
    if why is None:
        kept[index] = value
    else:
        rejected[index] = why


def eval_row(
    part: RecordDict, spec, index: int, sensor_id: str, columns: bool
) -> tuple[dict | None, dict | None, str | None]:
    """A sensor's evaluation as the simulator's result row, with the algorithm's per-unit
    columns when ``columns`` (after the last round); or why it is refused."""
    from fedcal.engine.flower.validation import check_eval, check_units, implausible_metrics
    from fedcal.engine.schedule import result_row

    why = check_eval(part, spec) if "eval" in part else "no evaluation"
    if why is not None:
        return None, None, why
    metrics = dict(part["eval"])
    test = {k[5:]: v for k, v in metrics.items() if k.startswith("test_")}
    train = {k[6:]: v for k, v in metrics.items() if k.startswith("train_")}
    finite = part["info"].get("personal-finite", True) is not False
    why = implausible_metrics(metrics, finite)
    if why is not None:  # errors, coverage, σ are >= 0; a finite model's are finite
        return None, None, why
    row = result_row(index, sensor_id, test, train, finite)
    if not columns:
        return row, None, None
    units, why = check_units(part.get("units"), row)
    if why is not None:  # e.g. recalibrate_at missing or not a number
        return None, None, why
    return row, units, None


def checked_uploads(
    asked: list[int],
    parts: Mapping[int, RecordDict],
    spec,
    members: Mapping[int, Any],
    sites: Mapping[int, list[int]],
    rejected: dict[int, str],
) -> dict[int, Tree]:
    """Client index → its checked upload, for the asked sensors that replied; a malformed
    one into ``rejected``."""
    from fedcal.engine.flower.validation import check_reply

    # a site pads its cohort to its longest sensor (see validation.check_reply)
    longest = {n: max(members[i].num_train for i in ix) for n, ix in sites.items()}
    uploads: dict[int, Tree] = {}
    for index in asked:
        part = parts.get(index)
        if part is None or "reply" not in part:
            continue
        padded = longest[members[index].node_id]
        checked = check_reply(part, spec, members[index].num_train, padded)
        _sort_out(index, *checked, uploads, rejected)
    return uploads


def secure_update(
    algorithm: Algorithm,
    server: Tree,
    out: SecureSum,
    sites: Mapping[int, list[int]],
    claimed: Mapping[int, int],
    t: int,
    entry: dict[str, Any],
) -> tuple[Tree, list[int], list[int]]:
    """Round ``t``'s update from the unmasked sums alone (secure runs): ``(server, the
    sensors in the M-step, the sensors left out with their group)`` (the server unchanged
    and none when the sum is not finite).

    The algorithm's ``server_update`` reads sums and the count of units only
    (``reply_aggregation = "sum"``), so it is given the sum as one row and N − 1
    rows of zeros: the same sums, the same N, with its per-unit robust step off (the
    one row is no unit). Screening, robust rules and per-reply checks need each reply
    and do not run (:func:`fedcal.engine.flower.secagg.disabled`); with ``secagg-groups``
    a robust fedprior judges each group's sum against the others'
    (:mod:`~fedcal.engine.flower.secagg_groups`) and leaves out the groups beyond its
    cut-offs.
    """
    import dataclasses

    import numpy as np
    import torch

    from fedcal.core.tree import unflatten
    from fedcal.engine.flower.secagg_groups import judge_groups

    done = []
    for nid, indices in out.included.items():
        bad = [i for i in indices if i not in sites.get(nid, []) or i not in claimed]
        if bad:
            raise RuntimeError(f"round {t}: site {nid} summed sensors {bad} it was not asked")
        done.extend(indices)
    done = sorted(done)
    if len(done) != out.count:
        raise RuntimeError(
            f"round {t}: the secure sum counts {out.count} sensors, the sites name {len(done)}"
        )
    entry["trained"] = done
    entry["secure"] = {
        "sites": sorted(out.included),
        "dropped_sites": out.dropped,
        "clipped_entries": out.clipped,
        "quantization_bound": out.bound,
    }
    bad = [k for k, v in out.sums.items() if not np.isfinite(v).all()]
    if bad or not done:
        return server, [], []
    sums, left = judge_groups(algorithm, server, out, entry)
    used = [i for i in done if i not in left]
    if not used:
        return server, [], left
    stacked = {}
    for key, v in sums.items():
        rows = torch.zeros((len(used), *v.shape), dtype=torch.float64)
        rows[0] = torch.from_numpy(v)
        stacked[key] = rows
    weights = torch.ones(len(used), dtype=torch.float64)
    plain = algorithm
    if getattr(algorithm, "robust", "off") != "off":  # its per-unit step: the one row is no unit
        plain = dataclasses.replace(algorithm, robust="off")
    server = plain.server_update(server, unflatten(stacked), weights)
    entry.setdefault("aggregation", {}).update(
        {"accepted": float(len(used)), "clipped_entries": float(out.clipped)}
    )
    entry["bytes_up"] = out.bytes_up
    return server, used, left


def enough_replies(
    t: int,
    done: list[int],
    planned: list[int],
    members: Mapping[int, Any],
    failed: Mapping[int, str],
    rejected: Mapping[int, str],
    min_replies: int,
) -> None:
    """Required: ``min_replies`` out of the round's cohort (``planned``), counting members
    that are offline, dropped or not yet joined as missing; else a one-line RuntimeError."""
    required = max(1, min(min_replies, len(planned)))
    if len(done) < required:
        missing = {
            members[i].sensor_id: failed.get(i, rejected.get(i, "offline or dropped"))
            for i in planned
            if i not in done
        }
        raise RuntimeError(
            f"round {t}: {len(done)} of {len(planned)} clients trained, at least "
            f"{required} required (min-replies); failed: {missing}"
        )

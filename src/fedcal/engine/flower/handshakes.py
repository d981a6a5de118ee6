"""The handshakes on the server side of the Flower adapter: each node's reply read into its
sensors' parts (or recorded as refused or malformed), and the fleet's scaling sums gathered
from them when the run's scaling needs federated statistics.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedcal.data.scaling import needs_moments
from fedcal.engine.flower.kinds import REFUSED
from fedcal.engine.flower.wire import split_parts, to_numpy

if TYPE_CHECKING:
    from flwr.app import RecordDict


def read_handshakes(
    replies: Mapping[int, RecordDict],
    scaling: str,
    refused: dict[str, str],
    rejected: dict[str, str],
) -> dict[int, list]:
    """Node id → [(client index, its part)] of usable handshakes; a refusal into
    ``refused``, a malformed handshake into ``rejected`` (by node id)."""
    from fedcal.engine.flower.validation import check_handshake

    usable: dict[int, list] = {}
    for nid, rep in replies.items():
        if REFUSED in rep:
            refused[str(nid)] = f"node {nid} {rep['refused'].get('reason', 'refused')}"
            continue
        parts, _, bad = split_parts(rep)
        why = f"malformed record names {bad}" if bad else None
        if not parts and why is None:
            why = "handshake names no sensor"
        for index, part in sorted(parts.items()):
            if why is None:
                # the sums are checked only if this run's scaling reads them
                why = check_handshake(part, "moments" in part or moments_needed(part, scaling))
            if why is None and part["info"]["client-index"] != index:
                why = f"part {index} describes client {part['info']['client-index']}"
        if why is not None:
            rejected[str(nid)] = f"node {nid}: {why}"
            continue
        usable[nid] = sorted(parts.items())
    return usable


def moments_needed(part: RecordDict, scaling: str) -> bool:
    """Whether this sensor's declared columns need its scaling sums (False if unreadable)."""
    try:
        info = part["info"]
        features = tuple(json.loads(str(info["features"])))
        target, regression = str(info["target"]), not bool(info["classification"])
    except Exception:  # the info check reports it
        return False
    return needs_moments(features, target, scaling, regression)


def fleet_moments(
    usable: Mapping[int, list],
    members: Mapping[int, Any],
    scaling: str,
    columns: tuple[tuple[str, ...], str, bool],
    dp: bool,
    num_clients: int,
    refusals: list[str],
) -> list[dict]:
    """Every member's scaling sums, in client-index order, when ``scaling`` needs federated
    statistics of ``columns`` (features, target, classification); none otherwise. Refused
    under client-level DP (un-noised statistics to every site) and when a client is missing
    (``refusals``: why the others are not members)."""
    features, target, classification = columns
    if not needs_moments(features, target, scaling, not classification):
        return []
    if dp:  # the scaler's un-noised fleet statistics go to every site
        raise RuntimeError(
            f"scaling {scaling!r}: client-level DP needs every column on a physical "
            f"range ({', '.join([*features, target])}: federated statistics would be "
            "released un-noised, outside ε)"
        )
    if len(members) < num_clients:
        raise RuntimeError(
            f"scaling needs federated statistics of all {num_clients} clients, "
            f"only {len(members)} answered the handshake" + "".join(f"; {why}" for why in refusals)
        )
    parts = {i: p for ps in usable.values() for i, p in ps}
    moments = []
    for index in members:
        rec = parts[index]["moments"]
        moments.append({k: to_numpy(rec[k]) for k in rec})
    return moments

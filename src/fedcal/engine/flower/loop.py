"""The server's round loop: one run of a :class:`~fedcal.engine.flower.server.Federation`.

The first handshake, then per message ``t = 0 … rounds``: greet the nodes
that connected since (a late handshake), send round message ``t`` to the
online sites, fold their replies in. The loop reaches the sites through a
:class:`Transport`: the ServerApp's is the SuperLink's Grid
(:mod:`~fedcal.engine.flower.grid`); the tests' calls the client
handler in-process and may tamper with its replies
(``fedcal_support/flower_hostile.py``). Both run this very loop, so the
hostile-node tests exercise the ServerApp's own protections.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any, Protocol

from fedcal.core.hooks import labelled_units
from fedcal.engine.flower.kinds import Kind

if TYPE_CHECKING:
    from flwr.app import RecordDict

    from fedcal.engine.flower.server import Federation

HANDSHAKE = -1  # the message round of the first handshake (a late one carries its round)


class Transport(Protocol):
    """How the loop reaches the sites (node id → message content; replies by node id)."""

    def online(self, t: int, wait_for: int = 0) -> set[int]:
        """Ids of the nodes connected before message ``t`` (``HANDSHAKE``: before the first
        handshake, waiting until ``wait_for`` nodes are or the transport's patience ends)."""
        ...

    def exchange(
        self, contents: Mapping[int, RecordDict], kind: str, t: int
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """Send each node its content; ``(replies, failures)`` by node id, a failure being why
        no usable reply came (crash, timeout, …). ``kind``: a ``kinds.Kind`` (evaluate: the
        last message); ``t``: the message round (``HANDSHAKE``: the first
        handshake)."""
        ...


def run_federation(
    fed: Federation,
    transport: Transport,
    result: dict[str, Any] | None = None,
    min_nodes: int = 1,
) -> dict[str, Any]:
    """Run ``fed`` over ``transport``: the handshake, then messages ``0 … fed.rounds``.

    ``result`` (returned) is filled as the run goes, in ``result.json``'s layout
    (:mod:`fedcal.apps.flower_server`): members and the round each node
    joined at, handshake failures, refusals and rejections, per round the failures,
    dropped nodes, rejected replies and who trained, the history, timings, and at
    the end the final table and the last round each client's reply was used. A run
    that fails (fewer than ``min_nodes`` online, no usable handshake, fewer than
    ``min-replies`` trained clients) raises, with what happened so far in ``result``.
    """
    result = {} if result is None else result
    timings: dict[str, Any] = {"rounds": []}
    result["timings"] = timings
    t0 = time.monotonic()
    _handshake(fed, transport, result, min_nodes)
    timings["handshake_s"] = time.monotonic() - t0
    for t in range(fed.rounds + 1):
        t_round = time.monotonic()
        t_exchange = _round(fed, transport, t, result)
        timings["rounds"].append(
            {"round": t, "exchange_s": t_exchange, "total_s": time.monotonic() - t_round}
        )
        result["history"] = fed.history
        _log(INFO, "[fedcal] message %d/%d done in %.1f s", t, fed.rounds, t_exchange)

    units = fed.unit_columns()  # per_sensor.csv's extra columns (recalibrate_at), as fedcal run
    result["final"] = [
        {**row, **labelled_units(fed.algorithm, units.get(row["client_index"], {}))}
        for row in fed.final_rows()
    ]
    result["last_used"] = {str(i): r for i, r in sorted(fed.last_used.items())}
    return result


def _log(level: int, *args: Any) -> None:
    """Flower's logger (imported when a run logs: the engine imports no Flower otherwise)."""
    from flwr.common.logger import log

    log(level, *args)


def _handshake(
    fed: Federation, transport: Transport, result: dict[str, Any], min_nodes: int
) -> None:
    """The first handshake: at least ``min_nodes`` online, their sensors registered."""
    nodes = sorted(transport.online(HANDSHAKE, wait_for=min_nodes))
    if len(nodes) < min_nodes:
        raise RuntimeError(f"only {len(nodes)} SuperNodes online, min-nodes is {min_nodes}")
    contents = {n: fed.handshake_content() for n in nodes}
    replies, failures = transport.exchange(contents, Kind.HANDSHAKE, HANDSHAKE)
    if failures:
        _log(WARNING, "[fedcal] handshake failures: %s", failures)
    result["handshake_failures"] = {str(k): v for k, v in failures.items()}
    try:
        fed.register(replies)
    finally:
        result["handshake_refusals"] = fed.refused
        result["handshake_rejected"] = fed.handshake_rejected
    if fed.refused or fed.handshake_rejected:
        _log(WARNING, "[fedcal] handshake: %s", {**fed.refused, **fed.handshake_rejected})
    _report_members(fed, result)
    _log(INFO, "[fedcal] %s on %d sensors: %s", fed.method, len(fed.members), fed.sensors())


def _round(fed: Federation, transport: Transport, t: int, result: dict[str, Any]) -> float:
    """Message ``t``: late nodes greeted, the message exchanged (through SecAgg+ in a secure
    training round), the replies folded in and what was refused logged; the exchange's
    seconds."""
    t_round = time.monotonic()
    online = transport.online(t)
    late = {n: fed.handshake_content() for n in sorted(online - fed.known_nodes())}
    if late:  # nodes that connected since: greet them, their sensors join now
        replies, failures = transport.exchange(late, Kind.HANDSHAKE, t)
        admitted = fed.admit(t, replies, online)
        _log(INFO, "[fedcal] round %d: nodes %s joined (%s failed)", t, admitted, failures)
        _report_members(fed, result)
    contents = fed.messages(t, online=online)
    kind = Kind.TRAIN if t < fed.rounds else Kind.EVALUATE
    if fed.secure is not None and kind == Kind.TRAIN:
        replies, failures = _secure_round(fed, transport, contents, t, result)
    else:
        replies, failures = transport.exchange(contents, kind, t)
    t_exchange = time.monotonic() - t_round
    if failures:
        _log(WARNING, "[fedcal] round %d failures: %s", t, failures)
    try:
        fed.absorb(t, contents, replies, failures)
    finally:  # a run that fails here still reports who refused or sent what
        result["failures"] = fed.failed
        result["dropped"] = fed.dropped
        result["rejected"] = fed.rejected
        result["participation"] = fed.log
    _log_refused(fed, t)
    return t_exchange


def _log_refused(fed: Federation, t: int) -> None:
    """Round ``t``'s refusals, rejected replies and screened-out replies, one line each."""
    for index, why in fed.failed.get(str(t), {}).items():
        if why.startswith("node ") and " refused " in why:
            _log(WARNING, "[fedcal] round %d: client %s: %s", t, index, why)
    for index, why in fed.rejected.get(str(t), {}).items():
        _log(WARNING, "[fedcal] round %d: reply of client %s rejected: %s", t, index, why)
    entry = fed.log[-1] if fed.log and fed.log[-1].get("round") == t else {}
    for r in entry.get("screening", []):  # screened out by the server's aggregation
        _log(
            WARNING,
            "[fedcal] round %d: reply of client %s screened out: %s (ratio %.3g, threshold %g)",
            t,
            r["client"],
            r["reason"],
            r["ratio"],
            r["threshold"],
        )


def _secure_round(
    fed: Federation, transport: Transport, contents: Mapping[int, RecordDict], t: int, result
) -> tuple[dict[int, RecordDict], dict[int, str]]:
    """Message ``t`` through SecAgg+ (:mod:`~fedcal.engine.flower.secagg`): the server
    keeps only the unmasked sum (``fed.secure_sum``) for :meth:`Federation.absorb`."""
    from flwr.common.logger import log

    from fedcal.engine.flower.secagg import disabled
    from fedcal.engine.flower.secagg_server import secure_exchange

    if "secure_aggregation" not in result:
        off = disabled(fed.policy)
        result["secure_aggregation"] = {**fed.secure.describe(), "disabled": off}
        log(INFO, "[fedcal] secure aggregation (SecAgg+) on; disabled: %s", "; ".join(off))
    fed.secure_sum = None
    replies, failures, fed.secure_sum = secure_exchange(
        fed.secure, fed.secure_layout(), transport, contents, t, sorted(fed.sites())
    )
    out = fed.secure_sum
    log(
        INFO,
        "[fedcal] round %d: secure sum of %d sensors from sites %s (dropped %s, clipped %d)",
        t,
        out.count,
        sorted(out.included),
        out.dropped,
        out.clipped,
    )
    return replies, failures


def _report_members(fed: Federation, result: dict[str, Any]) -> None:
    result["sensors"] = fed.sensors()
    result["node_ids"] = {str(i): str(m.node_id) for i, m in fed.members.items()}
    result["joined"] = dict(fed.joined)
    result["handshake_refusals"] = fed.refused
    result["handshake_rejected"] = fed.handshake_rejected

"""The round loop's transport in a deployment: Flower messages through the SuperLink's Grid.

:class:`GridTransport` is the :class:`~fedcal.engine.flower.loop.Transport` of
the ServerApp (:mod:`fedcal.apps.flower_server`): no Flower Strategy, the
Message API only. A handshake is a query, a round message a train message (the
last one, evaluation only, an evaluate message); replies are matched to the
messages they answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedcal.engine.flower.kinds import Kind
from fedcal.engine.flower.loop import HANDSHAKE

# the Flower message type that carries each kind of exchange (kinds.Kind)
FLOWER_TYPES = {
    Kind.HANDSHAKE: MessageType.QUERY,
    Kind.SECAGG: MessageType.QUERY,
    Kind.TRAIN: MessageType.TRAIN,
    Kind.EVALUATE: MessageType.EVALUATE,
}


def wait_for_nodes(grid: Grid, count: int, timeout: float, poll: float) -> list[int]:
    """Online node ids once at least ``count`` are connected (or when ``timeout`` expires)."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count or time.monotonic() >= deadline:
            return nodes
        time.sleep(poll)


def exchange(
    grid: Grid,
    contents: dict[int, RecordDict],
    kind: str,
    group: str,
    ttl: float,
    timeout: float,
    poll: float,
) -> tuple[dict[int, RecordDict], dict[int, str]]:
    """Send one message per node and collect replies until all arrived or ``timeout``.

    Replies are matched by ``reply_to_message_id``: error replies made by the
    SuperLink (e.g. a node that stopped sending heartbeats) come from node 1.
    """
    nodes = list(contents)
    messages = [Message(contents[n], n, kind, group_id=group, ttl=ttl) for n in nodes]
    ids = list(grid.push_messages(messages))
    pending = {mid: n for mid, n in zip(ids, nodes, strict=True) if mid}
    failures = {n: "push failed" for mid, n in zip(ids, nodes, strict=True) if not mid}
    replies: dict[int, RecordDict] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for rep in grid.pull_messages(list(pending)):
            node = pending.pop(rep.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if rep.has_error():
                failures[node] = f"error {rep.error.code}: {rep.error.reason}"
            else:
                replies[node] = rep.content
        if pending and time.monotonic() >= deadline:
            failures.update({n: f"no reply within {timeout:g} s" for n in pending.values()})
            break
        if pending:
            time.sleep(poll)
    return replies, failures


@dataclass
class GridTransport:
    """The loop's transport in a deployment: Flower messages through the SuperLink's Grid."""

    grid: Grid
    ttl: float  # message time-to-live
    timeout: float  # how long to wait for the replies to one message
    poll: float
    node_wait: float  # how long to wait for min-nodes before the first handshake

    def online(self, t: int, wait_for: int = 0) -> set[int]:
        if t == HANDSHAKE:
            return set(wait_for_nodes(self.grid, wait_for, self.node_wait, self.poll))
        return set(self.grid.get_node_ids())

    def exchange(
        self, contents: dict[int, RecordDict], kind: str, t: int
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        message_type = FLOWER_TYPES[Kind(kind)]
        if kind == Kind.HANDSHAKE:
            group = str(Kind.HANDSHAKE) if t == HANDSHAKE else f"{Kind.HANDSHAKE}-{t}"
        elif kind == Kind.SECAGG:  # a step of secure aggregation (fedcal.engine.flower.secagg)
            group = f"{Kind.SECAGG}-{t}"
        else:
            group = str(t)
        return exchange(self.grid, contents, message_type, group, self.ttl, self.timeout, self.poll)

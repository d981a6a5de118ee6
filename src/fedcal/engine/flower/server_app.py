"""The ServerApp: the round loop (:mod:`~fedcal.engine.flower.loop`) over the Message API.

No Flower Strategy: :class:`GridTransport` carries the loop's messages through the Grid.

Run config (declared in the Flower app's ``pyproject.toml``)::

    method        registered fedcal algorithm (fedcal methods)
    seed          training seed (model init, batches), as ``simulate``'s EngineConfig.seed
    rounds        0 = the config's engine.rounds
    dtype         "" = the config's engine.dtype
    config-path   fedcal TOML file on the SuperLink machine ("" = shipped default)
    config-json   a fedcal config as JSON (TOML layout) merged into the default; beats config-path
    out-dir       where result.json and server.pt are written ("" = working directory)
    min-nodes     SuperNodes that must be online before the handshake
    min-replies   clients that must train in a round, else the run fails
    node-wait-timeout, reply-timeout, poll-interval, message-ttl   (seconds)

A SuperNode that fails or does not answer within ``reply-timeout`` sits out
that round and is asked again the next (its state is on its disk); one that
refuses the method (its node config does not allow it, see
:mod:`fedcal.engine.flower.policy`) is left out for the run. A SuperNode that
connects after the handshake is greeted at the next round and its sensors
join from the current global state. A malformed reply (keys, shapes, dtypes,
non-finite values; :mod:`fedcal.engine.flower.validation`) is left out of
that round only. The run fails with a clear message when fewer than
``min-replies`` clients trained in a round.
``result.json`` holds the per-sensor evaluation rows in the simulator's
format, who trained in each round, failures and refusals (``failures``,
``dropped``, ``handshake_refusals``), rejected replies (``rejected``,
``handshake_rejected``), the round each node joined at (``joined``) and timings.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedcal.engine.flower.loop import HANDSHAKE, run_federation

app = ServerApp()


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


def load_run_config(cfg: dict[str, Any]):
    """The fedcal RunConfig a run uses: config-json, else config-path, else the default."""
    from fedcal.config import default_config, from_json, load_config

    if str(cfg.get("config-json", "")):
        return from_json(str(cfg["config-json"]), "config-json")
    if str(cfg.get("config-path", "")):
        return load_config(str(cfg["config-path"]))
    return default_config()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    out = Path(str(cfg.get("out-dir", "")) or ".")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"run_id": str(context.run_id), "status": "running"}
    try:
        _run(grid, cfg, result, out)
        result["status"] = "ok"
    except Exception as err:
        result["status"] = "error"
        result["error"] = str(err)
        result["traceback"] = traceback.format_exc()
        raise
    finally:
        text = json.dumps(result, indent=1, default=str)
        from fedcal.core.atomic import write_text

        write_text(out / "result.json", text)


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
        if kind == "handshake":
            message_type = MessageType.QUERY
            group = "handshake" if t == HANDSHAKE else f"handshake-{t}"
        else:
            message_type = MessageType.TRAIN if kind == "train" else MessageType.EVALUATE
            group = str(t)
        return exchange(self.grid, contents, message_type, group, self.ttl, self.timeout, self.poll)


def _run(grid: Grid, cfg: dict[str, Any], result: dict[str, Any], out: Path) -> None:
    import torch

    from fedcal.engine.flower.server import Federation

    torch.set_num_threads(1)
    fed = Federation(
        load_run_config(cfg),
        method=str(cfg["method"]),
        seed=int(cfg["seed"]),
        rounds=int(cfg["rounds"]),
        dtype=str(cfg["dtype"]),
        min_replies=int(cfg["min-replies"]),
    )
    result.update(method=fed.method, seed=fed.seed, rounds=fed.rounds, dtype=fed.dtype)
    transport = GridTransport(
        grid,
        ttl=float(cfg["message-ttl"]),
        timeout=float(cfg["reply-timeout"]),
        poll=float(cfg["poll-interval"]),
        node_wait=float(cfg["node-wait-timeout"]),
    )
    run_federation(fed, transport, result, min_nodes=int(cfg["min-nodes"]))
    from fedcal.core.tree import flatten

    server = {k: v.contiguous() for k, v in flatten(fed.server).items()}
    from fedcal.core.atomic import write_with

    write_with(out / "server.pt", lambda p: torch.save(server, p))

"""A warm site worker: one long-running process per site runs its round messages.

Flower 1.41 starts a fresh ``flwr-clientapp`` process for every message (its
SuperExec runs one task per process; warm executors exist only for Kubernetes
and not for ClientApps). Importing torch and fedcal in that process was most
of a round's fixed cost (measured in docs/flower.md). A site
may instead run one worker next to its SuperNode::

    python -m fedcal.engine.flower.worker --node-config "data-path='...' site-id='...' \\
        state-dir='...' worker-socket='/abs/state/lab-a/worker.sock'"

and start the SuperNode with the same ``--node-config``. The ClientApp then
sends each round message over the Unix socket ``worker-socket`` (created
with mode 0600: only the site's own user may connect) and returns the
worker's reply; it imports neither torch nor the algorithms. The worker runs
the very same :func:`fedcal.engine.flower.client.run_round` (same state file,
written after every message), so the numbers do not change; what it keeps
between messages is only what does not change: the imported modules and the
site's data (:func:`fedcal.engine.flower.nodes.load_for_node`'s cache, keyed
by the file's size and modification time).

One message at a time: the worker answers connections one after another, so a
site's state file still has one writer. If a SuperNode dies mid-message the
worker finishes it and writes the state (a reply lost in transit: the server's
verdict rolls it back). If the socket does not answer (no worker, or it died)
the ClientApp runs the message itself, as without a worker, and logs a
warning. A worker refuses a message whose node config differs from its own.

The socket protocol (frames, the ClientApp's :func:`~fedcal.engine.flower.protocol.ask`)
is :mod:`~fedcal.engine.flower.protocol`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fedcal.engine.flower.protocol import (
    SOCKET_KEY,
    WorkerUnavailable,
    ask,
    check_socket_path,
    from_bytes,
    plain,
    recv_frame,
    send_frame,
    to_bytes,
)

if TYPE_CHECKING:
    from flwr.app import RecordDict


def run_round_here_or_on_worker(content: RecordDict, node_cfg: Mapping, run_id: int) -> RecordDict:
    """The ClientApp's round handler: on the worker if the node config names one, else here."""
    path = str(node_cfg.get(SOCKET_KEY, ""))
    if path:
        try:
            return ask(path, content, node_cfg, run_id)
        except WorkerUnavailable as err:
            from logging import WARNING

            from flwr.common.logger import log

            log(WARNING, "[fedcal] %s; running the message in the ClientApp", err)
    from fedcal.engine.flower.client import run_round

    return run_round(content, node_cfg, run_id)


# ----------------------------------------------------------------------------
# the worker
# ----------------------------------------------------------------------------
def _answer(conn: socket.socket, node_cfg: Mapping[str, str]) -> None:
    from fedcal.engine.flower.client import run_round
    from fedcal.engine.flower.kinds import CONTROL

    header = json.loads(recv_frame(conn))
    content = recv_frame(conn)
    if header.get("node_config") != plain(node_cfg):
        why = (
            f"this worker serves node config {plain(node_cfg)}, the message came with "
            f"{header.get('node_config')}"
        )
        send_frame(conn, b"error")
        send_frame(conn, why.encode())
        return
    run_id, t0 = int(header["run_id"]), time.perf_counter()
    try:
        message = from_bytes(content)
        reply = to_bytes(run_round(message, node_cfg, run_id))
    except Exception as err:  # the ClientApp reports it as the message's error
        print(f"run {run_id}: failed: {type(err).__name__}: {err}", flush=True)
        send_frame(conn, b"error")
        send_frame(conn, f"{type(err).__name__}: {err}".encode())
        return
    t = message[CONTROL]["round"]
    print(f"run {run_id} round {t}: answered in {time.perf_counter() - t0:.2f} s", flush=True)
    send_frame(conn, b"ok")
    send_frame(conn, reply)


def listen(node_cfg: Mapping[str, str]) -> socket.socket:
    """Bind the node config's worker socket (mode 0600; a stale file is replaced)."""
    path = str(node_cfg.get(SOCKET_KEY, ""))
    if not path:
        raise KeyError(f"node config has no {SOCKET_KEY}: nowhere to listen")
    check_socket_path(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        Path(path).unlink(missing_ok=True)  # no one answers: a stale file from a dead worker
    else:
        raise RuntimeError(f"{path}: another site worker already listens there")
    finally:
        probe.close()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600
    try:
        server.bind(path)
    finally:
        os.umask(old)
    server.listen(8)
    return server


def serve(node_cfg: Mapping[str, str], server: socket.socket | None = None) -> None:
    """Answer round messages for one site, one at a time, until killed.

    Imports torch, the engine and the algorithms and reads the site's
    data once, before it listens (a message sent earlier finds no worker and
    runs in its ClientApp).
    """
    import importlib

    import torch

    from fedcal.engine.flower.nodes import load_for_node
    from fedcal.engine.memory import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # a long-lived process, like the simulator's
    for module in ("fedcal.algorithms", "fedcal.engine.simulation"):  # run_round's lazy imports
        importlib.import_module(module)
    load_for_node(node_cfg)  # fail early on a bad node config; warms the site-data cache
    server = listen(node_cfg) if server is None else server
    while True:
        conn, _ = server.accept()
        try:
            _answer(conn, node_cfg)
        except OSError:
            pass  # the ClientApp went away (its SuperNode died): the next message is the news
        except Exception as err:  # a garbled request must not stop the site
            print(f"fedcal site worker: bad request: {type(err).__name__}: {err}", flush=True)
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> None:
    from flwr.common.config import parse_config_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node-config", required=True, help="the SuperNode's --node-config")
    args = parser.parse_args(argv)
    node_cfg = plain(parse_config_args([args.node_config]))
    print(f"fedcal site worker for {node_cfg.get('site-id')} on {node_cfg.get(SOCKET_KEY)}")
    serve(node_cfg)


if __name__ == "__main__":
    main()

"""The site worker's socket protocol: how a ClientApp hands a round message to its worker.

Each frame is an 8-byte big-endian length and the bytes. A request is a JSON
header frame (the node config, the run id) and the message content (Flower's
protobuf serialization of the RecordDict, bit exact); the reply is a status
frame (``ok`` or ``error``) and the reply content or the error text. The
worker's side is :mod:`~fedcal.engine.flower.worker`; this module imports no
other fedcal module, so the ClientApp, the node configs and the worker all
depend on it and not on each other.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.app import RecordDict

SOCKET_KEY = "worker-socket"
_LEN = struct.Struct(">Q")
_MAX_PATH = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL


class WorkerUnavailable(ConnectionError):
    """Nothing answers on the worker socket (no worker started, or it died)."""


class WorkerError(RuntimeError):
    """The worker ran the message and it failed (its error text, as run_round raised it)."""


def send_frame(conn: socket.socket, data: bytes) -> None:
    """One frame: the length (8 bytes, big-endian), then the bytes."""
    conn.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("worker socket closed mid-frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(conn: socket.socket) -> bytes:
    """The bytes of the next frame (a ConnectionError if the peer closes mid-frame)."""
    (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
    return _recv_exact(conn, n)


def check_socket_path(path: str) -> None:
    """Refuse a socket path longer than a Unix socket address holds."""
    if len(os.fsencode(path)) > _MAX_PATH:
        raise ValueError(
            f"{SOCKET_KEY} {path!r} is longer than {_MAX_PATH} bytes (a Unix socket's limit); "
            "pick a shorter path"
        )


def plain(node_cfg: Mapping) -> dict[str, str]:
    """A node config as strings (how the worker compares it with the message's)."""
    return {str(k): str(v) for k, v in node_cfg.items()}


def to_bytes(content: RecordDict) -> bytes:
    """A RecordDict as Flower serializes it (protobuf; bit exact)."""
    from flwr.common.serde import recorddict_to_proto

    return recorddict_to_proto(content).SerializeToString()


def from_bytes(data: bytes) -> RecordDict:
    """Inverse of :func:`to_bytes`."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

    proto = RecordDictProto()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


def ask(path: str, content: RecordDict, node_cfg: Mapping, run_id: int) -> RecordDict:
    """Run a round message on the site's worker; its reply content.

    Raises :class:`WorkerUnavailable` if nothing listens on ``path`` (then the
    message was not run) and :class:`WorkerError` if the worker ran it and it failed.
    """
    check_socket_path(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            conn.connect(path)
        except OSError as err:  # missing file, refused: no worker
            raise WorkerUnavailable(f"no site worker on {path}: {err}") from err
        header = {"node_config": plain(node_cfg), "run_id": int(run_id)}
        send_frame(conn, json.dumps(header).encode())
        send_frame(conn, to_bytes(content))
        status = recv_frame(conn).decode()
        body = recv_frame(conn)
    finally:
        conn.close()
    if status != "ok":
        raise WorkerError(f"site worker on {path}: {body.decode(errors='replace')}")
    return from_bytes(body)

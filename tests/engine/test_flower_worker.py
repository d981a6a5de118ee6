"""The warm site worker: the same replies and state as the ClientApp's own run_round.

The worker runs here in a thread on a real Unix socket (the deployment test
runs it as its own process, next to a SuperNode). What is checked: a whole
run through workers gives byte-identical replies, the same state files and
the same server history as run_round in the ClientApp; a worker refuses a
message of another node config and reports a failing message without dying;
without a worker the ClientApp runs the message itself; the socket is private
(0600), a stale file is replaced and a live worker is not stolen from; the
site-data cache reads a changed site file again.
"""

from __future__ import annotations

import shutil
import socket
import stat
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcal.apps.flower_server import federation
from fedcal.config import EngineSection, ModelConfig, RunConfig, TrainConfig
from fedcal.engine.flower import worker
from fedcal.engine.flower.client import answer_handshake, load_state, run_round, state_path
from fedcal.engine.flower.nodes import load_for_node, node_config, prepare_site_files
from fedcal.engine.flower.protocol import WorkerError, WorkerUnavailable, ask, plain, to_bytes
from fedcal.engine.flower.server import Federation
from fedcal.engine.flower.worker import listen, run_round_here_or_on_worker

CONFIG = RunConfig(
    model=ModelConfig(hidden=(6, 5)),
    train=TrainConfig(lr=0.1, local_epochs=2, batch_size=4),
    engine=EngineSection(rounds=2, dtype="float64"),
)
SITES = {"S00": "lab-b", "S01": "lab-a", "S02": "lab-a", "S03": "lab-b"}
RUN_ID = 7


@pytest.fixture
def short_dir():
    """A directory with a short path: a Unix socket's path holds at most 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fw-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _cfgs(fleet, root: Path, sockets: Path | None) -> dict[int, dict[str, str]]:
    from flwr.common.config import parse_config_args

    cfgs = {}
    for k, (site, _, path) in enumerate(prepare_site_files(fleet, root / "nodes", SITES)):
        sock = None if sockets is None else sockets / f"{site}.sock"
        text = node_config(path, site, root / "state", worker_socket=sock)
        cfgs[100 + k] = plain(parse_config_args([text]))
    return cfgs


def _start(cfg: dict[str, str]) -> threading.Thread:
    server = listen(cfg)  # bound before the thread starts: no race with the first message
    thread = threading.Thread(target=worker.serve, args=(cfg, server), daemon=True)
    thread.start()
    return thread


def _run(fleet, cfgs, handler) -> tuple[Federation, list[bytes]]:
    """A run as the ServerApp drives it; ``handler`` answers each round message of a site."""
    fed = federation(CONFIG, "fedgmi", seed=1, min_replies=1)
    fed.register({n: answer_handshake(fed.handshake_content(), c, RUN_ID) for n, c in cfgs.items()})
    wire = []
    for t in range(fed.rounds + 1):
        sent = fed.messages(t, set(cfgs))
        replies = {n: handler(c, cfgs[n], RUN_ID) for n, c in sent.items()}
        wire += [to_bytes(replies[n]) for n in sorted(replies)]
        fed.absorb(t, sent, replies, {})
    return fed, wire


def test_a_run_through_workers_equals_run_round_in_the_clientapp(
    make_fleet, tmp_path, short_dir
) -> None:
    fleet = make_fleet(num_clients=4, train=[9, 7, 11, 8])
    here = _cfgs(fleet, tmp_path / "here", None)
    there = _cfgs(fleet, tmp_path / "there", short_dir)
    for cfg in there.values():
        _start(cfg)
    fed_a, wire_a = _run(fleet, here, run_round)
    fed_b, wire_b = _run(fleet, there, run_round_here_or_on_worker)
    assert wire_a == wire_b  # every reply, byte for byte
    assert fed_a.history == fed_b.history
    for n in here:
        a = load_state(state_path(here[n]["state-dir"], here[n]["site-id"], RUN_ID))
        b = load_state(state_path(there[n]["state-dir"], there[n]["site-id"], RUN_ID))
        for tree in ("state", "personal"):
            for k, v in a[tree].items():
                torch.testing.assert_close(b[tree][k], v, rtol=0, atol=0)
        assert a["trained_round"] == b["trained_round"] == [1, 1]


def test_a_worker_refuses_another_node_config_and_survives_a_failing_message(
    make_fleet, tmp_path, short_dir
) -> None:
    fleet = make_fleet(num_clients=4, train=[9, 7, 11, 8])
    cfgs = _cfgs(fleet, tmp_path, short_dir)
    node, cfg = next(iter(cfgs.items()))
    _start(cfg)
    fed = federation(CONFIG, "fedgmi", seed=1, min_replies=1)
    fed.register({n: answer_handshake(fed.handshake_content(), c, RUN_ID) for n, c in cfgs.items()})
    sent = fed.messages(0, set(cfgs))
    other = {**cfg, "state-dir": str(tmp_path / "elsewhere")}
    answer_handshake(fed.handshake_content(), other, RUN_ID)  # the run, as another node has it
    with pytest.raises(WorkerError, match="this worker serves node config"):
        ask(cfg["worker-socket"], sent[node], other, RUN_ID)
    # another site's message names sensors this site does not have: run_round's own error
    stranger = next(n for n in cfgs if n != node)
    with pytest.raises(WorkerError, match=r"asked to train clients .* not its sensors"):
        ask(cfg["worker-socket"], sent[stranger], cfg, RUN_ID)
    assert not state_path(cfg["state-dir"], cfg["site-id"], RUN_ID).exists()
    reply = ask(cfg["worker-socket"], sent[node], cfg, RUN_ID)  # still serving
    assert to_bytes(reply) == to_bytes(run_round(sent[node], other, RUN_ID))


def test_without_a_worker_the_clientapp_runs_the_message_itself(
    make_fleet, tmp_path, short_dir
) -> None:
    fleet = make_fleet(num_clients=4, train=[9, 7, 11, 8])
    cfgs = _cfgs(fleet, tmp_path, short_dir)  # names sockets nobody listens on
    fed_b, wire_b = _run(fleet, cfgs, run_round_here_or_on_worker)
    fed_a, wire_a = _run(fleet, _cfgs(fleet, tmp_path / "ref", None), run_round)
    assert wire_a == wire_b and fed_a.history == fed_b.history
    with pytest.raises(WorkerUnavailable, match="no site worker on"):
        ask(cfgs[100]["worker-socket"], fed_a.messages(0, set(cfgs))[100], cfgs[100], RUN_ID)


def test_the_socket_is_private_stale_files_go_live_workers_stay(
    make_fleet, tmp_path, short_dir
) -> None:
    fleet = make_fleet(num_clients=4, train=[9, 7, 11, 8])
    cfg = _cfgs(fleet, tmp_path, short_dir)[100]
    path = Path(cfg["worker-socket"])
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a dead worker's file: bound, never listened on
    stale.close()
    server = listen(cfg)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(RuntimeError, match="another site worker already listens"):
            listen(cfg)
    finally:
        server.close()
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        listen({**cfg, "worker-socket": "/tmp/" + "x" * 120})
    with pytest.raises(KeyError, match="worker-socket"):
        listen({k: v for k, v in cfg.items() if k != "worker-socket"})


def test_node_config_names_the_worker_socket(tmp_path) -> None:
    text = node_config(tmp_path / "a.npz", "lab-a", tmp_path / "s", worker_socket="w.sock")
    assert f"worker-socket='{Path('w.sock').resolve()}'" in text
    assert "worker-socket" not in node_config(tmp_path / "a.npz", "lab-a", tmp_path / "s")


def test_the_site_data_cache_reads_a_changed_file_again(make_fleet, tmp_path) -> None:
    first = make_fleet(num_clients=2, train=[5, 6])
    (_, _, path), *_ = prepare_site_files(first, tmp_path, {"S00": "lab", "S01": "lab"})
    cfg = {"data-path": str(path), "site-id": "lab", "state-dir": str(tmp_path)}
    a = load_for_node(cfg)
    assert load_for_node(cfg) is a  # unchanged file: the parsed rows are kept
    with pytest.raises(ValueError, match="read-only"):
        a.train[0][0][0, 0] = 1.0  # shared between messages: nobody may write
    second = make_fleet(num_clients=2, train=[7, 6])
    prepare_site_files(second, tmp_path, {"S00": "lab", "S01": "lab"})  # replaces the file
    b = load_for_node(cfg)
    assert b.num_train == (7, 6) and a.num_train == (5, 6)
    np.testing.assert_array_equal(b.train[0][0], second.arrays("train")[0][0])

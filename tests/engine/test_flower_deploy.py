"""fedcal on a real Flower deployment: SuperLink + 3 site SuperNodes on 127.0.0.1, TLS + auth.

One deployment (module fixture) serves every test; each test is one or more
``flwr run``s against it. Six sensors on three sites: lab-a (3 sensors), lab-b
(2) and lab-h (1); lab-a runs its messages on a warm site worker
(:mod:`fedcal.engine.flower.worker`). The fault test kills and restarts a
SuperNode, so it runs last. What is proved:

* security: TLS everywhere (certificates made here), SuperNode authentication:
  registered keys connect with the id ``flwr supernode register`` returned;
  a SuperNode with an unregistered key is refused and exits;
* equivalence: FedGMI, FedPrior and Clustered FL give the vectorized
  simulator's numbers (float64, atol 1e-9): per-round per-sensor metrics, the
  final server tree, each sensor's personalized model and private state (read
  from its site's state file);
* secure aggregation: fedprior with SecAgg+ (``secure-aggregation = true``) sums
  the three sites' masked statistics each round and gives the simulator's
  numbers (rtol 1e-9: the float summation order differs);
* a curious server: a run of ``centralized`` (raw rows) is refused by every
  site (default node config), fails with their messages in result.json, and
  no site trains or writes state for it;
* a hostile client: lab-h's SuperNode runs with a ``sitecustomize`` that
  multiplies its FedPer upload by 1000 in round 1. The server screens it out
  for that round, the run continues, lab-h rolls its state back, and every
  number equals the in-process run in which that sensor computed round 1 but
  uploaded nothing;
* nodes come and go: lab-b's SuperNode is SIGKILLed in round 1 and restarted
  (same key, same node id) while the run goes on; it sits out the round(s) it
  missed and takes part again from its state file, and the run equals the
  in-process run with the same absences.

Needs flwr (the 'flower' extra) and ``cryptography``; fails loudly without them.
Timings are printed (run with -s) and written to <tmp>/timings.json.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from flwr.app import RecordDict

from fedcal.apps.flower_server import build, federation
from fedcal.build import build_policy
from fedcal.config import EngineSection, ModelConfig, RunConfig, TrainConfig, to_json
from fedcal.core.tree import flatten
from fedcal.data.fleet import Fleet
from fedcal.engine.flower.client import load_state, state_path
from fedcal.engine.flower.nodes import node_config, prepare_site_files
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal_support.flower_hostile import arrays, node_cfgs, run_in_process, with_arrays
from fedcal_support.flower_local import LocalDeployment, make_node_key, sensor_state, stop_tree

APP = Path(__file__).resolve().parents[2] / "flower"
ROUNDS, SEED = 2, 3
CONFIG = RunConfig(
    model=ModelConfig(hidden=(6, 5)),
    train=TrainConfig(lr=0.1, local_epochs=2, batch_size=4),
    engine=EngineSection(rounds=ROUNDS, dtype="float64"),
    # a prior these toy sensors identify (see test_flower_wire.py)
    method_params={"fedprior": {"orders": [1, 1], "init_noise": 0.1}},
)
# The server step of a real run: the [aggregation] policy of the config (screen, clip).
POLICY = build_policy(CONFIG)[0]
METHODS = ("fedgmi", "fedprior", "clustered")
SECURE = "fedprior-secagg"  # the fedprior run with secure-aggregation = true
SITES = {"S00": "lab-a", "S01": "lab-b", "S02": "lab-a", "S03": "lab-h", "S04": "lab-a"}
SITES |= {"S05": "lab-b"}
TRAIN_ROWS = [13, 7, 10, 9, 12, 8]
HOSTILE = 3  # the client index of lab-h's one sensor
# lab-h's SuperNode imports this at start-up (and so does every ClientApp process it starts):
# fedcal's own client, with the upload of FedPer's round 1 multiplied by 1000.
SITECUSTOMIZE = """
import fedcal.engine.flower.client as client
from fedcal.engine.flower.wire import join_parts, split_parts

_honest = client.run_round


def _hostile(content, node_cfg, run_id):
    from flwr.app import Array, ArrayRecord

    reply = _honest(content, node_cfg, run_id)
    run = client.run_path(node_cfg["state-dir"], node_cfg["site-id"], run_id)
    method = client.load_run(run)[0].method  # the run's method, as the handshake said
    if method != "fedper" or int(content["fedcal"]["round"]) != 1:
        return reply
    parts, common, _ = split_parts(reply)
    for part in parts.values():
        if "reply" in part:
            scaled = {k: Array(v.numpy() * 1000) for k, v in part["reply"].items()}
            part["reply"] = ArrayRecord(scaled)
    return join_parts(parts, common)


client.run_round = _hostile
"""
TIMINGS: dict[str, dict] = {}


@dataclass
class Setup:
    dep: LocalDeployment
    fleet: Fleet
    root: Path
    registered: dict[str, int]  # site id → node id returned by `flwr supernode register`
    keys: dict[str, Path]
    configs: dict[str, str]  # site id → its --node-config
    extra_path: dict[str, str]


WORKER_SITE = "lab-a"  # runs its messages on a warm site worker (a process of its own)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, make_fleet):
    root = tmp_path_factory.mktemp("flower")
    sockets = Path(tempfile.mkdtemp(prefix="fw-", dir="/tmp"))  # a socket path has ≤ 107 bytes
    fleet = make_fleet(num_clients=6, train=TRAIN_ROWS)
    files = prepare_site_files(fleet, root / "nodes", SITES)
    (root / "hostile").mkdir()
    (root / "hostile" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    dep = LocalDeployment(root / "deployment", tls=True, auth=True)
    try:
        t0 = time.monotonic()
        dep.start_superlink()
        registered, keys, configs, extra = {}, {}, {}, {}
        for site, _, path in files:
            keys[site], public = make_node_key(dep.root / "pki", f"key-{site}")
            registered[site] = dep.register(public)
            socket = sockets / f"{site}.sock" if site == WORKER_SITE else None
            configs[site] = node_config(path, site, root / "state" / site, worker_socket=socket)
            if socket is not None:
                dep.start_worker(site, configs[site])
            extra[site] = str(root / "hostile") if site == "lab-h" else ""
            dep.start_supernode(site, configs[site], keys[site], extra[site])
        # a node whose key was never registered (claims lab-a's data)
        rogue_key, _ = make_node_key(dep.root / "pki", "key-rogue")
        rogue_cfg = node_config(files[0][2], files[0][0], root / "rogue")
        dep.start_supernode("rogue", rogue_cfg, rogue_key)
        for site in registered:
            dep.nodes[site].node_id()
        TIMINGS["deployment_start_s"] = {"s": time.monotonic() - t0}
        yield Setup(dep, fleet, root, registered, keys, configs, extra)
    finally:
        dep.stop()
        shutil.rmtree(sockets, ignore_errors=True)
        (root / "timings.json").write_text(json.dumps(TIMINGS, indent=1))
        print("\nflower timings:", json.dumps(TIMINGS, indent=1))


def _submit(setup: Setup, name: str, **overrides) -> int:
    """``flwr run`` with a run-config file (the run starts in the background); returns its id."""
    values = {
        "seed": SEED,
        "rounds": ROUNDS,
        "dtype": "float64",
        "config-json": to_json(CONFIG),
        "out-dir": str(setup.root / "out" / name),
        "min-nodes": 3,
        "min-replies": 6,
        "reply-timeout": 240.0,
        **overrides,
    }
    run_toml = setup.root / f"run-{name}.toml"
    run_toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return setup.dep.run(APP, run_toml)


def _result(setup: Setup, name: str) -> dict:
    path = setup.root / "out" / name / "result.json"  # missing if the ServerApp never ran
    return json.loads(path.read_text()) if path.exists() else {"status": "no result.json"}


@pytest.fixture(scope="module")
def equivalence_runs(setup: Setup) -> dict[str, tuple[dict, dict, float]]:
    """One ``flwr run`` per method, all submitted at once (the SuperLink runs them side by side).

    Returns method → (flwr ls status, result.json, seconds from submission to finished).
    """
    t0 = time.monotonic()
    ids = {m: _submit(setup, m, method=m) for m in METHODS}
    done = {}
    for method, run_id in ids.items():
        status = setup.dep.wait(run_id, timeout=600)
        done[method] = (status, _result(setup, method), time.monotonic() - t0)
    TIMINGS["equivalence_runs_concurrent_wall_s"] = {"s": round(time.monotonic() - t0, 1)}
    return done


def _simulate(setup: Setup, method: str, rounds: int = ROUNDS, config: RunConfig = CONFIG):
    tensors = prepare(setup.fleet, dtype="float64")
    engine = EngineConfig(rounds=rounds, seed=SEED, dtype="float64", aggregation=POLICY)
    t0 = time.perf_counter()
    res = simulate(build(config, method, 2), tensors, engine)
    return res, time.perf_counter() - t0


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows).sort_values(["round", "client_index"]).reset_index(drop=True)


def _assert_rows_equal(got: list[dict], want: list[dict], skip=()) -> None:
    a, b = _frame(got), _frame(want)
    assert list(a["client"]) == list(b["client"]) and list(a["round"]) == list(b["round"])
    numeric = [c for c in b.columns if c not in ("client", "status", *skip)]
    np.testing.assert_allclose(a[numeric].to_numpy(float), b[numeric].to_numpy(float), atol=1e-9)


def _in_process(
    setup: Setup, tmp: Path, method: str, rounds: int, run_id: int, tamper=None, absent=None
):
    """The same run through fedcal_support's in-process harness (one node per site).

    ``absent``: (site id, message rounds at which that site is offline).
    """
    fed = federation(CONFIG, method, seed=SEED, rounds=rounds, dtype="float64")
    cfgs = node_cfgs(setup.fleet, tmp, sites=SITES)
    offline = None
    if absent is not None:
        site, at = absent
        node = next(n for n, c in cfgs.items() if c["site-id"] == site)
        offline = lambda t: {node} if t in at else set()  # noqa: E731
    run_in_process(fed, cfgs, run_id, tamper=tamper, offline=offline)
    return fed, cfgs


# ----------------------------------------------------------------------------
def test_tls_and_supernode_authentication(setup: Setup) -> None:
    dep = setup.dep
    log = (dep.root / "logs" / "superlink.log").read_text()
    assert f"https://127.0.0.1:{dep.port}" in log  # the SuperLink serves TLS only
    # registered keys connect with exactly the id that registration returned
    assert {s: dep.nodes[s].node_id() for s in setup.registered} == setup.registered
    online = {int(n["node-id"]) for n in dep.supernodes() if n["status"] == "online"}
    assert online == set(setup.registered.values())
    # the unregistered key is refused: the SuperNode gives up and exits
    rogue = dep.nodes["rogue"]
    assert rogue.proc.wait(timeout=60) != 0
    assert "Failed to activate SuperNode" in rogue.log.read_text()
    log = (dep.root / "logs" / "superlink.log").read_text()
    assert "No SuperNode found with the given public key" in log


@pytest.mark.parametrize("method", METHODS)
def test_flower_run_on_three_sites_equals_the_simulator(
    setup: Setup, equivalence_runs, method: str
) -> None:
    status, result, wall = equivalence_runs[method]
    assert status["status"] == "finished:completed", (status, result.get("traceback"))
    assert result["status"] == "ok"
    assert result["sensors"] == {str(i): s for i, s in enumerate(setup.fleet.client_ids)}
    assert result["node_ids"] == {
        str(i): str(setup.registered[SITES[s]]) for i, s in enumerate(setup.fleet.client_ids)
    }
    assert [e["trained"] for e in result["participation"]] == [list(range(6))] * ROUNDS

    res, sim_wall = _simulate(setup, method)
    assert len(res.history) == 6 * ROUNDS
    _assert_rows_equal(result["history"], res.history)
    assert [r["status"] for r in _frame(result["history"]).to_dict("records")] == [
        r["status"] for r in _frame(res.history).to_dict("records")
    ]
    server = torch.load(setup.root / "out" / method / "server.pt")
    for k, v in flatten(res.server).items():
        assert server[k].dtype == v.dtype  # float64, or clustered's integer assignments
        assert torch.allclose(server[k].double(), v.double(), rtol=0, atol=1e-9), k
    run_id = int(result["run_id"])
    for i, sensor in enumerate(setup.fleet.client_ids):
        site = SITES[sensor]
        saved = load_state(state_path(setup.root / "state" / site, site, run_id))
        assert saved["personal_round"] == ROUNDS - 1 and saved["pending"] is None
        personal = sensor_state(saved, sensor, "personal")
        for k, v in flatten(res.personal).items():
            assert torch.allclose(personal[k], v[i], rtol=0, atol=1e-9), (sensor, k)
        state = sensor_state(saved, sensor)
        for k, v in flatten(res.states).items():
            assert torch.allclose(state[k], v[i], rtol=0, atol=1e-9), (sensor, k)

    # lab-a's messages ran on its worker, none fell back to its ClientApp
    worker_log = (setup.dep.root / "logs" / f"worker-{WORKER_SITE}.log").read_text()
    for t in range(ROUNDS + 1):
        assert f"run {run_id} round {t}: answered in" in worker_log
    node_log = setup.dep.nodes[WORKER_SITE].log.read_text()
    assert "running the message in the ClientApp" not in node_log

    rounds = result["timings"]["rounds"]
    TIMINGS[method] = {
        "submitted_to_finished_s": round(wall, 1),
        "handshake_s": round(result["timings"]["handshake_s"], 1),
        "message_s": [round(r["exchange_s"], 1) for r in rounds],
        "simulator_s": round(sim_wall, 3),
    }


def test_secure_aggregation_over_tls_and_node_auth(setup: Setup) -> None:
    """fedprior with SecAgg+ on the deployment: every round sums all three sites' masked
    vectors (lab-a's statistics computed on its worker), nothing is clipped, and the run
    gives the simulator's numbers up to the float summation order (docs/flower.md)."""
    t0 = time.monotonic()
    # robust = "off": its per-unit checks need each reply (refused under SecAgg+)
    secure = {**CONFIG.method_params["fedprior"], "robust": "off"}
    config = replace(CONFIG, method_params={"fedprior": secure})
    overrides = {"secure-aggregation": True, "config-json": to_json(config)}
    run_id = _submit(setup, SECURE, method="fedprior", **overrides)
    status = setup.dep.wait(run_id, timeout=600)
    result = _result(setup, SECURE)
    assert status["status"] == "finished:completed", (status, result.get("traceback"))
    assert result["status"] == "ok"
    assert "norm screening (screen_factor = 10)" in result["secure_aggregation"]["disabled"]
    sites = sorted(setup.registered.values())
    for entry in result["participation"]:
        assert entry["trained"] == list(range(6))
        assert entry["secure"]["sites"] == sites and entry["secure"]["dropped_sites"] == []
        assert entry["secure"]["clipped_entries"] == 0
    res, _ = _simulate(setup, "fedprior", config=config)
    want = {(r["round"], r["client"]): r["test_rmse"] for r in res.history}
    assert len(result["history"]) == len(want) == 6 * ROUNDS
    for r in result["history"]:
        assert r["test_rmse"] == pytest.approx(want[(r["round"], r["client"])], rel=1e-9)
    server = torch.load(setup.root / "out" / SECURE / "server.pt")
    for k, v in flatten(res.server).items():
        assert torch.allclose(server[k].double(), v.double(), rtol=1e-9, atol=1e-12), k
    TIMINGS[SECURE] = {
        "flwr_run_to_finished_s": round(time.monotonic() - t0, 1),
        "message_s": [round(r["exchange_s"], 1) for r in result["timings"]["rounds"]],
    }


def test_curious_server_is_refused_raw_rows(setup: Setup, equivalence_runs) -> None:
    """Every SuperNode runs with the default node config: no raw rows leave a site."""
    t0 = time.monotonic()
    status = setup.dep.wait(_submit(setup, "curious", method="centralized"), timeout=300)
    result = _result(setup, "curious")
    TIMINGS["curious"] = {"flwr_run_to_finished_s": round(time.monotonic() - t0, 1)}
    assert status["status"] == "finished:failed", status
    assert result["status"] == "error"
    assert "round 0: 0 of 6 clients trained" in result["error"]
    for i, sensor in enumerate(setup.fleet.client_ids):
        site = SITES[sensor]
        why = (
            f"node {setup.registered[site]} refused method 'centralized': uploads raw_rows "
            "(the client's raw (scaled) training rows), not allowed by its node config "
            "(allow-uploads unset: every kind but raw_rows)"
        )
        assert result["failures"]["0"][str(i)] == why
        assert why in result["error"]
        run_id = int(result["run_id"])
        assert not state_path(setup.root / "state" / site, site, run_id).exists()
    assert result["participation"] == [{"round": 0, "asked": list(range(6)), "trained": []}]
    assert set(result["dropped"]) == {str(n) for n in setup.registered.values()}
    assert "history" not in result and result["rejected"] == {}


def test_hostile_site_is_screened_for_its_round_and_the_others_are_unaffected(
    setup: Setup, equivalence_runs, tmp_path
) -> None:
    """lab-h uploads its FedPer body × 1000 in round 1 (see SITECUSTOMIZE)."""
    t0 = time.monotonic()
    rounds = 3
    run_id = _submit(setup, "hostile", method="fedper", rounds=rounds)
    status = setup.dep.wait(run_id, timeout=600)
    result = _result(setup, "hostile")
    TIMINGS["hostile"] = {"flwr_run_to_finished_s": round(time.monotonic() - t0, 1)}
    assert status["status"] == "finished:completed", (status, result.get("traceback"))
    log = result["participation"]
    assert [e["trained"] for e in log] == [list(range(6))] * rounds
    assert [e.get("screened", []) for e in log] == [[], [HOSTILE], []]
    assert result["last_used"] == {str(i): rounds - 1 for i in range(6)}

    # the reference: the same sensors in-process, the hostile one uploading nothing in round 1
    def absent(t, i, part):
        if (t, i) != (1, HOSTILE):
            return part
        return RecordDict({k: v for k, v in part.items() if k not in ("reply", "train")})

    ref, cfgs = _in_process(setup, tmp_path, "fedper", rounds, 71, tamper=absent)
    assert [e["trained"] for e in ref.log][1] == [i for i in range(6) if i != HOSTILE]
    # a screened client did train (its loss is shown) and counts a rejected round
    _assert_rows_equal(result["history"], ref.history, skip=("train_loss", "rejected_rounds"))
    rejected = {(r["round"], r["client_index"]): r["rejected_rounds"] for r in result["history"]}
    assert [rejected[(t, HOSTILE)] for t in (1, 2, 3)] == [0, 1, 1]
    server = torch.load(setup.root / "out" / "hostile" / "server.pt")
    for k, v in flatten(ref.server).items():
        assert torch.allclose(server[k], v, rtol=0, atol=1e-9), k
    # lab-h rolled round 1 back: its private state is the reference's
    for site in ("lab-a", "lab-b", "lab-h"):
        real = load_state(state_path(setup.root / "state" / site, site, int(result["run_id"])))
        cfg = next(c for c in cfgs.values() if c["site-id"] == site)
        want = load_state(state_path(cfg["state-dir"], site, 71))
        for k, v in flatten(want["state"]).items():
            assert torch.allclose(flatten(real["state"])[k], v, rtol=0, atol=1e-9), (site, k)

    # and the in-process harness's own hostile run (same tamper as SITECUSTOMIZE) agrees
    def scaled(t, i, part):
        if (t, i) != (1, HOSTILE) or "reply" not in part:
            return part
        return with_arrays(part, {k: v * 1000 for k, v in arrays(part).items()})

    twin, _ = _in_process(setup, tmp_path / "twin", "fedper", rounds, 72, tamper=scaled)
    assert [e.get("screened", []) for e in twin.log] == [[], [HOSTILE], []]
    _assert_rows_equal(result["history"], twin.history)


# Timing-bound: the SuperLink needs ~61 s to mark a killed node offline before the same
# key may reconnect, and the restarted node's heartbeats must keep up until the run ends.
# It passed on a quiet machine and failed under a load average of ~10 (the restarted node
# was reported unavailable for every later round), so it runs on demand: pytest -m slow.
# The rollback and late-join logic it exercises is tested deterministically in-process
# (test_flower_wire.py).
@pytest.mark.slow
def test_killed_and_restarted_supernode_takes_part_again(setup: Setup, tmp_path) -> None:
    """SIGKILL lab-b's SuperNode in round 1, restart it while the run goes on."""
    dep, site = setup.dep, "lab-b"
    rounds = 6
    t0 = time.monotonic()
    run_id = _submit(
        setup, "fault", method="ditto", rounds=rounds, **{"min-replies": 1, "reply-timeout": 20.0}
    )
    node = dep.nodes[site]
    path = state_path(setup.root / "state" / site, site, run_id)
    other = state_path(setup.root / "state" / "lab-a", "lab-a", run_id)
    deadline = time.monotonic() + 300
    while not (path.exists() and load_state(path)["message_round"] == 0):
        assert time.monotonic() < deadline, "lab-b never finished round 0"
        time.sleep(0.2)
    seen = node.log.read_text(errors="replace").count("Start `flwr-clientapp`")
    while node.log.read_text(errors="replace").count("Start `flwr-clientapp`") <= seen:
        assert time.monotonic() < deadline, "lab-b never received round 1"
        time.sleep(0.1)
    stop_tree(node.proc, sig=signal.SIGKILL, grace=1.0)
    killed_at = time.monotonic()
    # The SuperLink refuses a key whose node it still counts online (a restart within
    # its heartbeat window exits with "Failed to activate SuperNode"): restart once it
    # has marked the node offline, while the run goes on with the others.
    node_id = setup.registered[site]
    while any(int(n["node-id"]) == node_id and n["status"] == "online" for n in dep.supernodes()):
        assert time.monotonic() < deadline, "the SuperLink never noticed lab-b was gone"
        time.sleep(1.0)
    offline_at = time.monotonic()
    assert other.exists() and load_state(other)["message_round"] < rounds - 1, "too late"
    dep.start_supernode(site, setup.configs[site], setup.keys[site], setup.extra_path[site])
    assert dep.nodes[site].node_id() == node_id  # connected again, same id
    restarted_at = time.monotonic()

    status = dep.wait(run_id, timeout=600)
    result = _result(setup, "fault")
    TIMINGS["fault"] = {
        "flwr_run_to_finished_s": round(time.monotonic() - t0, 1),
        "killed_to_offline_s": round(offline_at - killed_at, 1),
        "killed_to_restarted_s": round(restarted_at - killed_at, 1),
        "failures": result.get("failures"),
        "message_s": [round(r["exchange_s"], 1) for r in result["timings"]["rounds"]],
    }
    assert status["status"] == "finished:completed", (status, result.get("traceback"))
    lab_b = [i for i, s in enumerate(setup.fleet.client_ids) if SITES[s] == site]
    trained = [e["trained"] for e in result["participation"]]
    assert trained[0] == list(range(6))
    assert all(i not in trained[1] for i in lab_b) and set(result["failures"]["1"]) == {
        str(i) for i in lab_b
    }
    back = [t for t in range(rounds) if all(i in trained[t] for i in lab_b)]
    assert back[0] == 0 and back[-1] >= 2, trained  # it took part again
    assert result["node_ids"][str(lab_b[0])] == str(setup.registered[site])  # same node id
    # its state file carries on: the rounds it trained after the restart are committed
    saved = load_state(path)
    assert saved["trained_round"] == [back[-1]] * len(lab_b) and saved["pending"] is None

    # the same absences in-process give the same numbers
    final_clients = {r["client_index"] for r in result["final"]}
    absent_at = {t for t in range(rounds) if lab_b[0] not in trained[t]}
    if lab_b[0] not in final_clients:
        absent_at.add(rounds)
    ref, _ = _in_process(setup, tmp_path, "ditto", rounds, 81, absent=(site, absent_at))
    _assert_rows_equal(result["history"], ref.history)
    server = torch.load(setup.root / "out" / "fault" / "server.pt")
    for k, v in flatten(ref.server).items():
        assert torch.allclose(server[k], v, rtol=0, atol=1e-9), k

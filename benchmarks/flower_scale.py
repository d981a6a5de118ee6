"""Flower at fleet scale: N sensors on K site SuperNodes, against the simulator.

Starts a local SuperLink and K SuperNodes on 127.0.0.1 with TLS and SuperNode
authentication (``fedcal_support.flower_local``), spreads the sensors of the
embedded simulated fleet over K sites (contiguous blocks of client indices,
one site file each), runs FedGMI (the default configuration, float32 unless
``--dtype float64``) for a few rounds with ``flwr run``
and prints

    s_per_round: X            mean wall time of a round message (train + evaluate), server side
    max_diff_vs_simulator: D  largest |difference| of any sensor's personalized model
                              (read from its site's state file) against ``simulate``

plus the per-message times and the handshake. Each site runs a warm worker
(:mod:`fedcal.engine.flower.worker`) unless ``--no-workers``. Example::

    python benchmarks/flower_scale.py --sensors 1000 --nodes 4 --rounds 3

Every process gets ``torch.set_num_threads(1)`` (the ClientApp sets it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # fedcal_support/ (not shipped)

from fedcal.apps.flower_server import build  # noqa: E402
from fedcal.config import default_config, to_json  # noqa: E402
from fedcal.core.tree import flatten  # noqa: E402
from fedcal.data.simulator import FleetSpec, simulate_fleet  # noqa: E402
from fedcal.engine.flower.client import load_state, state_path  # noqa: E402
from fedcal.engine.flower.nodes import node_config, prepare_site_files  # noqa: E402
from fedcal.engine.simulation import EngineConfig, prepare, simulate  # noqa: E402
from fedcal.experiment import build_policy  # noqa: E402
from fedcal_support.flower_local import LocalDeployment, make_node_key  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sensors", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="fedgmi")
    parser.add_argument("--fleet-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--keep", type=Path, default=None, help="keep the deployment here")
    parser.add_argument(
        "--no-workers",
        action="store_true",
        help="no warm site workers: every message imports torch and fedcal in its ClientApp",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    base = default_config()
    config = replace(base, engine=replace(base.engine, rounds=args.rounds, dtype=args.dtype))
    fleet = simulate_fleet(FleetSpec(num_sensors=args.sensors), seed=args.fleet_seed)
    ids = [str(c) for c in fleet.client_ids]
    per_site = -(-len(ids) // args.nodes)
    sites = {s: f"site{i // per_site}" for i, s in enumerate(ids)}

    root = Path(args.keep or tempfile.mkdtemp(prefix="flower-scale-"))
    t0 = time.perf_counter()
    files = prepare_site_files(fleet, root / "sites", sites)
    print(f"site files: {len(files)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    with LocalDeployment(root / "deployment", tls=True, auth=True) as dep:
        t0 = time.perf_counter()
        dep.start_superlink()
        for site, _, path in files:
            key, public = make_node_key(dep.root / "pki", f"key-{site}")
            dep.register(public)
            state = root / "state" / site
            socket = None if args.no_workers else state / "worker.sock"
            cfg = node_config(path, site, state, worker_socket=socket)
            if socket is not None:
                dep.start_worker(site, cfg)
            dep.start_supernode(site, cfg, key)
        for site, _, _ in files:
            dep.nodes[site].node_id()
        print(f"deployment up: {time.perf_counter() - t0:.1f} s", flush=True)
        values = {
            "method": args.method,
            "seed": args.seed,
            "rounds": args.rounds,
            "dtype": args.dtype,
            "config-json": to_json(config),
            "out-dir": str(root / "out"),
            "min-nodes": len(files),
            "min-replies": len(ids),
            "reply-timeout": 900.0,
        }
        run_toml = root / "run.toml"
        run_toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
        t0 = time.perf_counter()
        run_id = dep.run(ROOT / "flower", run_toml)
        status = dep.wait(run_id, timeout=3600)
        wall = time.perf_counter() - t0
    result = json.loads((root / "out" / "result.json").read_text())
    if result["status"] != "ok":
        print(f"run {status['status']}: {result.get('error')}")
        sys.exit(1)
    messages = [r["total_s"] for r in result["timings"]["rounds"]]
    training = messages[: args.rounds]  # message `rounds` only evaluates

    t0 = time.perf_counter()
    engine = EngineConfig(
        rounds=args.rounds, seed=args.seed, dtype=args.dtype, aggregation=build_policy(config)[0]
    )
    res = simulate(
        build(config, args.method, len(fleet.features)), prepare(fleet, dtype=args.dtype), engine
    )
    sim_s = time.perf_counter() - t0
    personal = flatten(res.personal)
    diff = 0.0
    for site, _, _ in files:
        saved = load_state(state_path(root / "state" / site, site, run_id))
        rows = torch.tensor(saved["client_indices"])
        for k, v in flatten(saved["personal"]).items():
            diff = max(diff, float((v - personal[k].index_select(0, rows)).abs().max()))
    print(
        f"sensors: {len(ids)}  nodes: {len(files)}  rounds: {args.rounds}  method: {args.method}"
        f"  workers: {not args.no_workers}"
    )
    print(f"handshake_s: {result['timings']['handshake_s']:.1f}")
    print(f"message_s: {[round(m, 1) for m in messages]}")
    print(f"flwr_run_to_finished_s: {wall:.1f}  simulator_s: {sim_s:.1f}")
    print(f"s_per_round: {sum(training) / len(training):.1f}")
    print(f"max_diff_vs_simulator: {diff:.3g}")


if __name__ == "__main__":
    main()

"""A curious server and hostile clients against the Flower adapter, in one process.

The ServerApp's own round loop (:func:`~fedcal.engine.flower.loop.run_federation`,
the real :class:`~fedcal.engine.flower.server.Federation`) reaches the real
client handler (:func:`~fedcal.engine.flower.client.run_round`) through an
in-process transport; a ``tamper`` hook rewrites chosen sensors' parts of a
reply the way a hostile SuperNode could. Used by the tests and by::

    python -m fedcal_support.flower_hostile        # from the repo root: docs/flower.md's figures

which runs FedAvg (sample-weighted) on the first sensors of the embedded
fleet for several fleet seeds: an honest run, each malformed reply of one
client in round 1, row-count lies, and a server that asks for raw rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedcal.engine.flower.kinds import Kind
from fedcal.engine.flower.loop import HANDSHAKE, run_federation

if TYPE_CHECKING:
    from flwr.app import RecordDict

    from fedcal.data.fleet import Fleet
    from fedcal.engine.flower.server import Federation

# tamper(t, client index, part) → the part a hostile site sends for that sensor instead
# (t = HANDSHAKE for a handshake reply)
Tamper = Callable[[int, int, "RecordDict"], "RecordDict"]


@dataclass
class InProcess:
    """The round loop's transport without Flower processes: the client handlers called here.

    ``tamper(t, index, part)`` may replace one sensor's part of a site's reply.
    ``offline(t)``: node ids not connected at message ``t`` (a node that is
    offline at round 0 and online later joins late, greeted by a handshake).
    ``lost(t)``: node ids that run message ``t`` but whose reply never arrives
    (a crash after the state was written). ``wire`` collects every reply as it
    would go on the wire: ``(round, node id, serialized RecordDict)``.
    """

    node_cfgs: Mapping[int, Mapping]
    run_id: int
    tamper: Tamper | None = None
    offline: Callable[[int], set[int]] | None = None
    lost: Callable[[int], set[int]] | None = None
    wire: list[tuple[int, int, bytes]] = field(default_factory=list)

    def online(self, t: int, wait_for: int = 0) -> set[int]:
        away = self.offline(max(t, 0)) if self.offline is not None else set()
        return set(self.node_cfgs) - away

    def exchange(
        self, contents: Mapping[int, RecordDict], kind: str, t: int
    ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        from fedcal.engine.flower.client import answer_handshake, run_round
        from fedcal.engine.flower.secagg import SECAGG
        from fedcal.engine.flower.secagg_site import site_round, site_stage

        if kind == SECAGG:  # a step of secure aggregation: keys and shares, not data
            cfgs = self.node_cfgs
            return {n: site_stage(c, cfgs[n], self.run_id, n) for n, c in contents.items()}, {}
        if kind == Kind.HANDSHAKE:
            return {
                n: self._deliver(HANDSHAKE, n, answer_handshake(c, self.node_cfgs[n], self.run_id))
                for n, c in contents.items()
            }, {}

        def hostile_round(c, cfg, run_id):  # a hostile site tampers before it masks its sum
            return self._tampered(t, run_round(c, cfg, run_id))

        def run(c, cfg):
            if SECAGG not in c:
                return run_round(c, cfg, self.run_id)
            return site_round(c, cfg, self.run_id, hostile_round if self.tamper else run_round)

        replies = {n: self._deliver(t, n, run(c, self.node_cfgs[n])) for n, c in contents.items()}
        gone = {n: "reply lost" for n in (self.lost(t) if self.lost else set()) if n in replies}
        return {n: r for n, r in replies.items() if n not in gone}, gone

    def _tampered(self, t: int, reply: RecordDict) -> RecordDict:
        """``reply`` with each sensor's part as ``tamper`` rewrites it (a secure site's
        statistics are tampered with before they are masked: that is where it can)."""
        from fedcal.engine.flower.wire import join_parts, split_parts

        if self.tamper is None:
            return reply
        parts, common, _ = split_parts(reply)
        return join_parts({i: self.tamper(t, i, p) for i, p in parts.items()}, common)

    def _deliver(self, t: int, n: int, reply: RecordDict) -> RecordDict:
        from flwr.common.serde import recorddict_to_proto

        reply = self._tampered(t, reply)
        self.wire.append((t, n, recorddict_to_proto(reply).SerializeToString()))
        return reply


def run_in_process(
    fed: Federation,
    node_cfgs: Mapping[int, Mapping],
    run_id: int,
    tamper: Tamper | None = None,
    wire: list[tuple[int, int, bytes]] | None = None,
    offline: Callable[[int], set[int]] | None = None,
    lost: Callable[[int], set[int]] | None = None,
) -> list[tuple[int, int, bytes]]:
    """The ServerApp's round loop (:func:`~fedcal.engine.flower.loop.run_federation`) over
    an :class:`InProcess` transport; returns the replies as they went on the wire,
    appended to ``wire`` if given (so a run that fails keeps what was received)."""
    transport = InProcess(node_cfgs, run_id, tamper, offline, lost, [] if wire is None else wire)
    run_federation(fed, transport)
    return transport.wire


def node_cfgs(
    fleet: Fleet,
    root: Path,
    allow: Mapping[int, Mapping[str, str]] | None = None,
    sites: Mapping[str, str] | None = None,
) -> dict[int, dict]:
    """Node configs of every site as flower-supernode parses them (node id = 100 + site number).

    ``sites``: sensor id → site (None: one site per sensor, so node 100 + i serves
    client i); ``allow``: site number → ``node_config`` policy arguments.
    """
    from flwr.common.config import parse_config_args

    from fedcal.engine.flower.nodes import node_config, prepare_site_files

    cfgs = {}
    for k, (site, _, path) in enumerate(prepare_site_files(fleet, root / "nodes", sites)):
        text = node_config(path, site, root / "state", **(allow or {}).get(k, {}))
        cfgs[100 + k] = parse_config_args([text])
    return cfgs


# ----------------------------------------------------------------------------
# malformed replies
# ----------------------------------------------------------------------------
def with_arrays(reply: RecordDict, arrays: Mapping[str, np.ndarray]) -> RecordDict:
    """``reply`` with its upload replaced by ``arrays``."""
    from flwr.app import Array, ArrayRecord, RecordDict

    out = RecordDict({k: v for k, v in reply.items() if k != "reply"})
    # contiguous, and of the shape given (np.ascontiguousarray alone makes a 0-d leaf 1-d)
    out["reply"] = ArrayRecord(
        {k: Array(np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in arrays.items()}
    )
    return out


def arrays(reply: RecordDict) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in reply["reply"].items()}


def retag(reply: RecordDict, record: str, **values) -> RecordDict:
    """``reply`` with entries of its ``info`` (ConfigRecord) or ``train`` (metrics) replaced."""
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    out = RecordDict(dict(reply.items()))
    kind = ConfigRecord if record == "info" else MetricRecord
    out[record] = kind({**dict(reply[record]), **values})
    return out


def _first_nan(a: dict) -> dict:
    k = next(iter(a))
    bad = a[k].copy()
    bad.reshape(-1)[0] = np.nan
    return {**a, k: bad}


def _other_float(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64 if a.dtype == np.float32 else np.float32)


def _not_arrays(reply: RecordDict) -> RecordDict:
    from flwr.app import ConfigRecord, RecordDict

    return RecordDict({**dict(reply.items()), "reply": ConfigRecord({"model/l0": 1.0})})


# name → what a hostile client does to its reply (the training upload must be in it)
CORRUPTIONS: dict[str, Callable[[RecordDict], RecordDict]] = {
    "extra key": lambda r: with_arrays(r, {**arrays(r), "model/spy": np.zeros(3)}),
    "missing key": lambda r: with_arrays(r, dict(list(arrays(r).items())[1:])),
    "wrong shape": lambda r: with_arrays(
        r, {k: np.concatenate([v, v]) if v.ndim else v for k, v in arrays(r).items()}
    ),
    "wrong dtype": lambda r: with_arrays(r, {k: _other_float(v) for k, v in arrays(r).items()}),
    "NaN": lambda r: with_arrays(r, _first_nan(arrays(r))),
    "inf": lambda r: with_arrays(r, {k: np.full_like(v, np.inf) for k, v in arrays(r).items()}),
    "not arrays": _not_arrays,
    "foreign index": lambda r: retag(r, "info", **{"client-index": 0}),
    "negative rows": lambda r: retag(r, "info", **{"num-train": -5}),
    "extra metric": lambda r: retag(r, "train", spy=1.0),
}


# ----------------------------------------------------------------------------
# the figures of docs/flower.md
# ----------------------------------------------------------------------------
def _final_rmse(fed: Federation) -> float:
    rows = [r["test_rmse"] for r in fed.history if r["round"] == fed.rounds]
    return float(np.mean(rows)) if rows else float("nan")


def _max_gap(a: Federation, b: Federation) -> float:
    from fedcal.core.tree import flatten

    fa, fb = flatten(a.server), flatten(b.server)
    return max(float((fa[k].double() - fb[k].double()).abs().max()) for k in fb)


def row_bytes(fleet: Fleet, fed: Federation, index: int) -> list[bytes]:
    """Client ``index``'s scaled training rows as centralized sends them (the run's dtype).

    One entry per row's inputs and one per row's target value.
    """
    dtype = np.dtype(fed.dtype)
    x, y = fleet.arrays("train")[index]
    sx, sy = fed.scaler.x(x).astype(dtype), fed.scaler.y(y).astype(dtype)
    return [r.tobytes() for r in sx] + [v.tobytes() for v in sy.reshape(-1)]


def main(argv: list[str] | None = None) -> None:
    import tempfile
    from dataclasses import replace

    import torch

    from fedcal.apps.flower_server import federation
    from fedcal.config import default_config
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sensors", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fleet-seeds", default="0,1,2")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = default_config()
    config = replace(
        base,
        engine=replace(base.engine, rounds=args.rounds),
        method_params={**base.method_params, "fedavg": {"sample_weighted": True}},
    )
    victim = 1  # the hostile client's index; it misbehaves in round 1

    def at(t_bad: int, fn):
        return lambda t, i, r: fn(r) if (t, i) == (t_bad, victim) else r

    def strip(r):  # the reference: the client computes round 1 but uploads nothing
        from flwr.app import RecordDict

        return RecordDict({k: v for k, v in r.items() if k not in ("reply", "train")})

    cases: dict[str, Tamper | None] = {"honest": None, "sits round 1 out": at(1, strip)}
    cases.update({name: at(1, fn) for name, fn in CORRUPTIONS.items()})
    cases["claims 1e9 rows in round 1"] = at(1, lambda r: retag(r, "info", **{"num-train": 10**9}))
    cases["uploads its model x1000"] = at(
        1, lambda r: with_arrays(r, {k: v * 1000 for k, v in arrays(r).items()})
    )
    cases["claims 1e9 rows at the handshake only"] = at(
        HANDSHAKE, lambda r: retag(r, "info", **{"num-train": 10**9})
    )
    cases["claims 1e9 rows at the handshake and in every reply"] = lambda t, i, r: (
        retag(r, "info", **{"num-train": 10**9}) if i == victim else r
    )
    seeds = [int(s) for s in args.fleet_seeds.split(",")]
    table: dict[str, dict] = {
        name: {"rmse": [], "gap": [], "why": "", "trained": "", "stopped": []} for name in cases
    }
    curious: list[str] = []
    for seed in seeds:
        fleet = simulate_fleet(FleetSpec(num_sensors=args.sensors), seed=seed)
        with tempfile.TemporaryDirectory() as tmp:
            runs, completed = {}, set()
            for i, (name, tamper) in enumerate(cases.items()):
                fed = federation(config, "fedavg", seed=0, min_replies=1)
                try:
                    run_in_process(
                        fed, node_cfgs(fleet, Path(tmp) / str(i)), run_id=i, tamper=tamper
                    )
                    completed.add(name)
                except RuntimeError as err:  # e.g. every reply non-finite: reported, not a number
                    table[name]["stopped"].append(f"seed {seed}: {str(err).split(';')[0]}")
                runs[name] = fed
            for name, fed in runs.items():
                row = table[name]
                if name in completed:
                    row["rmse"].append(_final_rmse(fed))
                row["gap"].append(_max_gap(fed, runs["sits round 1 out"]))
                row["why"] = fed.rejected.get("1", {}).get(victim, "")
                row["trained"] = ",".join(map(str, fed.log[1]["trained"]))
            # a curious server: centralized, default nodes, then nodes that allow raw rows
            for allow in (None, {i: {"allow_uploads": "*"} for i in range(args.sensors)}):
                root = Path(tmp) / ("curious" if allow is None else "consent")
                fed = federation(config, "centralized", seed=0, min_replies=1)
                wire: list = []
                try:
                    run_in_process(fed, node_cfgs(fleet, root, allow), run_id=99, wire=wire)
                    outcome = f"ran {fed.rounds} rounds"
                except RuntimeError as err:
                    outcome = f"run stopped ({str(err).split(';')[0][:48]}…)"
                rows = [b for i in range(args.sensors) for b in row_bytes(fleet, fed, i)]
                blob = b"".join(p for _, _, p in wire)
                seen = sum(b in blob for b in rows)
                who = "default nodes" if allow is None else "allow-uploads=*"
                curious.append(
                    f"fleet seed {seed}, {who}: "
                    f"{outcome}; row values found in the replies: {seen} of {len(rows)}; "
                    f"refusals: {len(fed.failed.get('0', {}))}"
                )
                if allow is None and seed == seeds[0]:
                    curious.append(f"  message: {next(iter(fed.failed['0'].values()))}")
    print(
        f"FedAvg (sample-weighted), {args.sensors} sensors of the embedded fleet, "
        f"{args.rounds} rounds, fleet seeds {seeds}; client {victim} misbehaves in round 1"
    )
    print(
        "| case | trained in round 1 | max abs server diff vs sitting out | test RMSE (hPa) "
        "| server's reason |"
    )
    print("|---|---|---:|---:|---|")
    for name, row in table.items():
        rmse = f"{np.mean(row['rmse']):.4g} ± {np.std(row['rmse']):.2g}" if row["rmse"] else ""
        rmse = "; ".join([rmse] * bool(rmse) + [f"run stopped ({w})" for w in row["stopped"]])
        print(f"| {name} | {row['trained']} | {max(row['gap']):.3g} | {rmse} | {row['why']} |")
    print()
    print("\n".join(curious))


if __name__ == "__main__":
    main()

"""A SuperNode decides what it shares; the server validates what it receives (in-process).

Drives the real server side (:class:`Federation`) and the real client handler
(:func:`run_round`) in one process, as test_flower_wire.py does (one site per
sensor: node 100 + i serves client i), with

* a curious server: it asks default nodes for ``centralized`` (raw rows) —
  refused, and the bytes every reply would put on the wire hold none of the
  rows; a node whose config allows it is served (the same byte check then
  finds the rows, so the check can fail);
* a hostile client: wrong keys, shape, dtype, NaN/inf, a foreign client
  index, bad metrics — its reply is dropped for that round only, and the run
  equals a run in which that client did not train that round; a client that
  claims 1e9 rows after the handshake is weighted by the rows it declared;
* the declared upload kinds of every regression algorithm against the keys
  its replies actually carry.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedcal.algorithms import REGISTRY
from fedcal.apps.flower_server import build, federation
from fedcal.config import EngineSection, ModelConfig, RunConfig, TrainConfig
from fedcal.core.tree import flatten
from fedcal.data.fleet import Fleet
from fedcal.engine.flower.client import answer_handshake, load_state, state_path
from fedcal.engine.flower.policy import UPLOAD_KINDS, NodePolicy, PolicyError
from fedcal.engine.flower.server import Federation
from fedcal.engine.flower.validation import ROWS, expected_reply
from fedcal.engine.flower.wire import split_parts
from fedcal.engine.simulation import DTYPES
from fedcal_support.flower_hostile import (
    CORRUPTIONS,
    arrays,
    node_cfgs,
    retag,
    row_bytes,
    run_in_process,
    with_arrays,
)

REGRESSION = sorted(n for n, c in REGISTRY.items() if c.task_kind == "regression")
CONFIG = RunConfig(
    model=ModelConfig(hidden=(6, 5)),
    train=TrainConfig(lr=0.1, local_epochs=2, batch_size=4),
    engine=EngineSection(rounds=3, dtype="float64"),
)
# Top-level reply keys → upload kind (read off each algorithm's client_update).
# A key missing here fails test_declared_upload_kinds_cover_every_reply_key.
KEY_KIND = {
    "model": "model",
    "base": "model",
    "experts": "model",
    "candidates": "model",
    "x": "raw_rows",
    "y": "raw_rows",
    "count": "raw_rows",
    "gram": "statistics",
    "rhs": "statistics",
    "predictions": "public_outputs",
    "protos": "prototypes",
    "counts": "label_counts",
    "bin_counts": "label_counts",
    "loss": "gradients",
    "grad": "gradients",
    "rho": "gradients",
    "beta": "gradients",
    "samples": "costs",
    "time_per_sample": "costs",
    "energy_per_sample": "costs",
    "directions": "update_directions",
    "assignment": "cluster_choice",
    "val_loss": "validation_losses",
    "mean": "model",  # fedprior: a unit's posterior mean coefficients
    "second": "statistics",
    "gls_gram": "statistics",
    "gls_rhs": "statistics",
    "rss": "statistics",
    "n": "statistics",
    "support": "statistics",
    "drift": "statistics",  # fedprior_drift: its log-evidence per drift variance, its time span
    "key": None,  # the client's round seed: a function of (run seed, round, index)
    "seed": None,
}


def _node_cfgs(fleet: Fleet, tmp_path, per_index: dict[int, dict] | None = None) -> dict:
    return node_cfgs(fleet, tmp_path, per_index)


def _run(fed: Federation, cfgs: dict, run_id: int, tamper=None) -> list:
    return run_in_process(fed, cfgs, run_id, tamper)


def _node_of(cfgs: dict, index: int) -> int:
    assert 100 + index in cfgs
    return 100 + index  # fedcal_support.flower_hostile.node_cfgs: one site per sensor


def _states(cfgs: dict, run_id: int) -> dict[int, dict]:
    """Node id → its site's committed private state (flattened), read from its state file."""
    return {
        n: flatten(load_state(state_path(c["state-dir"], c["site-id"], run_id))["state"])
        for n, c in cfgs.items()
    }


# ----------------------------------------------------------------------------
# the node's policy
# ----------------------------------------------------------------------------
def test_policy_defaults_refuse_raw_rows_only() -> None:
    default = NodePolicy.from_node_config({})
    assert default.uploads == frozenset(UPLOAD_KINDS) - {"raw_rows"}
    assert default.refusal("fedavg", "fedavg", ("model",)) is None
    assert default.refusal("fedpoly", "fedpoly", ("statistics",)) is None
    why = default.refusal("centralized", "centralized", ("raw_rows",))
    assert why == (
        "refused method 'centralized': uploads raw_rows (the client's raw (scaled) training "
        "rows), not allowed by its node config (allow-uploads unset: every kind but raw_rows)"
    )
    everything = NodePolicy.from_node_config({"allow-uploads": "*"})
    assert everything.refusal("centralized", "centralized", ("raw_rows",)) is None
    only = NodePolicy.from_node_config({"allow-methods": "fedavg, fedgmi", "allow-uploads": "*"})
    assert only.refusal("fedgmi_joint", "fedgmi", ("model",)) is None  # a variant: its algorithm
    assert only.refusal("fedper", "fedper", ("model",)) == (
        "refused method 'fedper': not allowed by its node config (allow-methods=fedavg,fedgmi)"
    )
    stats = NodePolicy.from_node_config({"allow-uploads": "statistics"})
    assert "uploads model (model parameters" in stats.refusal("fedavg", "fedavg", ("model",))
    assert "allow-uploads=statistics)" in stats.refusal("fedavg", "fedavg", ("model",))
    with pytest.raises(PolicyError, match=r"unknown kinds \['rows'\]"):
        NodePolicy.from_node_config({"allow-uploads": "model,rows"})
    with pytest.raises(PolicyError, match="comma-separated string"):
        NodePolicy.from_node_config({"allow-methods": 3})


@pytest.mark.parametrize("method", REGRESSION)
def test_declared_upload_kinds_cover_every_reply_key(method) -> None:
    """Every key an honest reply carries maps to a kind the algorithm declares."""
    alg = build(CONFIG, method, 2)
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), torch.float64))
    from fedcal.data.scaling import scaler_from_moments

    scaler = scaler_from_moments(("frequency_hz", "temperature_c"), "pressure_hpa", [], "physical")
    spec = expected_reply(alg, server, scaler, 2, torch.float64)
    tops = {k.split("/")[0] for k in spec.leaves}
    unknown = tops - set(KEY_KIND)
    assert not unknown, f"{method}: classify reply keys {unknown} in KEY_KIND and its uploads"
    kinds = {KEY_KIND[k] for k in tops} - {None}
    declared = set(type(alg).uploads)
    assert kinds <= declared, (method, kinds, declared)
    assert declared <= set(UPLOAD_KINDS)
    # declared kinds that the default hyperparameters do not send: only these, on purpose
    optional = {
        "fedkd": {"model"},  # share="both" also uploads the body
        "leastsq": {"statistics"},  # pooled=true uploads Gram sums; per sensor: nothing
    }
    assert declared - kinds == optional.get(method, set()), method
    if method not in optional:
        assert (not alg.federated) == (declared == set())


def test_reply_rows_follow_the_declared_row_count() -> None:
    alg = build(CONFIG, "centralized", 2)
    server = alg.server_init(alg.task.model.init(torch.Generator().manual_seed(0), torch.float64))
    from fedcal.data.scaling import scaler_from_moments

    scaler = scaler_from_moments(("frequency_hz", "temperature_c"), "pressure_hpa", [], "physical")
    spec = expected_reply(alg, server, scaler, 2, torch.float64)
    assert spec.leaves["x"][1] == (ROWS, 2) and spec.leaves["y"][1] == (ROWS, 1)
    assert spec.leaves["count"][1] == () and spec.eval_metrics >= {"test_rmse", "train_rmse"}


# ----------------------------------------------------------------------------
# a curious server
# ----------------------------------------------------------------------------
def test_curious_server_gets_no_raw_rows_from_default_nodes(make_fleet, tmp_path) -> None:
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    cfgs = _node_cfgs(fleet, tmp_path)
    fed = federation(CONFIG, "centralized", seed=4)
    wire: list = []
    with pytest.raises(RuntimeError, match="round 0: 0 of 3 clients trained") as err:
        run_in_process(fed, cfgs, run_id=1, wire=wire)
    for n in cfgs:
        assert f"node {n} refused method 'centralized': uploads raw_rows" in str(err.value)
        assert f"node {n} refused" in fed.failed["0"][n - 100]
    assert set(fed.dropped) == {str(n) for n in cfgs}
    # nothing of any row left a node: not one row's bytes in any reply on the wire
    assert sorted(t for t, _, _ in wire) == [-1, -1, -1, 0, 0, 0]  # handshakes, round 0
    rows = [r for i in range(3) for r in row_bytes(fleet, fed, i)]
    assert all(r not in payload for _, _, payload in wire for r in rows)
    assert all(len(payload) < 1000 for _, _, payload in wire)  # refusals, not data
    # a refused node trains nothing and keeps no state
    for cfg in cfgs.values():
        assert not state_path(cfg["state-dir"], cfg["site-id"], 1).exists()


def test_a_renamed_variant_is_judged_by_its_algorithm(make_fleet, tmp_path) -> None:
    fleet = make_fleet(num_clients=2, train=[8, 7])
    cfgs = _node_cfgs(fleet, tmp_path, {0: {"allow_methods": "fedavg,innocent"}, 1: {}})
    config = replace(CONFIG, method_params={"innocent": {"base": "centralized"}})
    fed = federation(config, "innocent", seed=1)
    with pytest.raises(RuntimeError, match="round 0: 0 of 2"):
        _run(fed, cfgs, run_id=2)
    assert fed.failed["0"][0].endswith(
        "refused method 'innocent' (algorithm 'centralized'): not allowed by its node config "
        "(allow-methods=fedavg,innocent)"
    )
    assert "(algorithm 'centralized'): uploads raw_rows" in fed.failed["0"][1]


def test_a_node_that_allows_raw_rows_is_served_and_only_it(make_fleet, tmp_path) -> None:
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    cfgs = _node_cfgs(fleet, tmp_path, {1: {"allow_uploads": "raw_rows,model"}})
    fed = federation(CONFIG, "centralized", seed=4, min_replies=1)
    wire = _run(fed, cfgs, run_id=3)
    assert [e["trained"] for e in fed.log] == [[1], [1], [1]]
    assert set(fed.failed["0"]) == {0, 2}
    assert set(fed.dropped) == {str(_node_of(cfgs, 0)), str(_node_of(cfgs, 2))}
    # the consenting node's rows are on the wire (so the byte check above can fail) …
    sent_by_1 = b"".join(p for _, n, p in wire if n == _node_of(cfgs, 1))
    assert all(r in sent_by_1 for r in row_bytes(fleet, fed, 1))
    # … the others' are nowhere
    others = [r for i in (0, 2) for r in row_bytes(fleet, fed, i)]
    assert all(r not in p for _, _, p in wire for r in others)
    assert sorted({r["client_index"] for r in fed.history}) == [1]


def test_a_node_refuses_its_scaling_sums_when_statistics_are_not_allowed(
    make_fleet, tmp_path
) -> None:
    fleet = make_fleet(num_clients=2, train=[8, 7])
    config = replace(CONFIG, data=replace(CONFIG.data, scaling="federated"))
    cfgs = _node_cfgs(fleet, tmp_path, {0: {"allow_uploads": "model"}})
    fed = federation(config, "fedavg", seed=1)
    replies = {n: answer_handshake(fed.handshake_content(), c, 1) for n, c in cfgs.items()}
    refused = replies[_node_of(cfgs, 0)]
    assert list(refused) == ["refused"] and "moments" in split_parts(replies[101])[0][1]
    with pytest.raises(RuntimeError, match="only 1 answered the handshake; node 100 refused"):
        fed.register(replies)
    assert "statistics not allowed by its node config (allow-uploads=model)" in str(
        refused["refused"]["reason"]
    )


# ----------------------------------------------------------------------------
# a hostile client
# ----------------------------------------------------------------------------
# corruption → what the server's reason says
CORRUPT = {
    "extra key": "unexpected ['model/spy']",
    "missing key": "missing ['model/l0.weight']",
    "wrong shape": "has shape (12, 2), expected (6, 2)",
    "wrong dtype": "has dtype float32, expected float64",
    "NaN": "holds 1 non-finite value",
    "inf": "non-finite value",
    "not arrays": "reply is a ConfigRecord, not arrays",
    "foreign index": "info says client 0, the handshake said 1",
    "negative rows": "info num-train -5 is not a row count",
    "extra metric": "training metrics names ['spy'] not expected",
}
_with_reply, _arrays, _retag = with_arrays, arrays, retag


@pytest.mark.parametrize("case", list(CORRUPT))
def test_malformed_reply_drops_that_node_for_that_round_only(case, make_fleet, tmp_path) -> None:
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    corrupt, reason = CORRUPTIONS[case], CORRUPT[case]
    assert set(CORRUPT) == set(CORRUPTIONS)
    config = replace(CONFIG, method_params={"fedavg": {"sample_weighted": True}})

    def hostile(t, i, reply):
        return corrupt(reply) if (t, i) == (1, 1) else reply

    def absent(t, i, reply):  # the reference: client 1 computes round 1 but does not upload
        if (t, i) == (1, 1):
            return RecordDict({k: v for k, v in reply.items() if k not in ("reply", "train")})
        return reply

    cfgs = _node_cfgs(fleet, tmp_path / "a")
    fed = federation(config, "fedavg", seed=4, min_replies=2)
    _run(fed, cfgs, run_id=21, tamper=hostile)
    states = _states(cfgs, 21)
    assert [e["trained"] for e in fed.log] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    assert list(fed.rejected) == ["1"] and list(fed.rejected["1"]) == [1]
    assert reason in fed.rejected["1"][1], fed.rejected["1"][1]
    assert fed.log[1]["rejected"] == {"1": fed.rejected["1"][1]}
    assert not fed.dropped and all(f == {} for f in fed.failed.values())

    cfgs = _node_cfgs(fleet, tmp_path / "b")
    ref = federation(config, "fedavg", seed=4, min_replies=2)
    _run(ref, cfgs, run_id=22, tamper=absent)
    ref_states = _states(cfgs, 22)
    assert [e["trained"] for e in ref.log] == [[0, 1, 2], [0, 2], [0, 1, 2]]
    expected = ref.history
    if case in ("foreign index", "negative rows"):  # an unusable info record: no eval row either
        expected = [r for r in ref.history if (r["round"], r["client_index"]) != (1, 1)]
        assert len(expected) == len(ref.history) - 1
    np.testing.assert_equal(fed.history, expected)
    for k, v in flatten(ref.server).items():
        assert torch.equal(flatten(fed.server)[k], v), k
    for (n, a), (m, b) in zip(states.items(), ref_states.items(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), (n, m)


def test_a_later_claim_of_1e9_rows_is_capped_at_the_handshake_count(
    make_fleet, tmp_path, monkeypatch
) -> None:
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    config = replace(CONFIG, method_params={"fedavg": {"sample_weighted": True}})

    def boast(t, i, reply):
        return _retag(reply, "info", **{"num-train": 10**9}) if "reply" in reply else reply

    honest = federation(config, "fedavg", seed=4)
    _run(honest, _node_cfgs(fleet, tmp_path / "h"), run_id=31)
    cfgs = _node_cfgs(fleet, tmp_path / "b")
    fed = federation(config, "fedavg", seed=4)
    _run(fed, cfgs, run_id=32, tamper=lambda t, i, r: boast(t, i, r) if i == 2 else r)
    assert fed.rejected == {} and [e["trained"] for e in fed.log] == [[0, 1, 2]] * 3
    for k, v in flatten(honest.server).items():
        assert torch.equal(flatten(fed.server)[k], v), k
    np.testing.assert_equal(fed.history, honest.history)
    assert fed.members[2].num_train == 10 and fed.members[2].node_id == _node_of(cfgs, 2)
    # uncapped, the claim hands the server to client 2 (so the equality above can fail)
    import fedcal.engine.flower.validation as validation

    monkeypatch.setattr(validation, "capped_weight", lambda declared, claimed: float(claimed))
    cfgs = _node_cfgs(fleet, tmp_path / "u")
    naive = federation(config, "fedavg", seed=4)
    _run(
        naive,
        cfgs,
        run_id=33,
        tamper=lambda t, i, r: boast(t, i, r) if i == 2 else r,
    )
    gap = max((flatten(naive.server)[k] - v).abs().max() for k, v in flatten(honest.server).items())
    assert gap > 1e-3


def test_honest_replies_of_every_shape_pass_and_ragged_rows_are_checked(
    make_fleet, tmp_path
) -> None:
    """centralized's rows: the reply must hold exactly the rows declared at the handshake."""
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    cfgs = _node_cfgs(fleet, tmp_path, {i: {"allow_uploads": "*"} for i in range(3)})

    def pad(t, i, reply):
        if i != 2 or "reply" not in reply:
            return reply
        a = _arrays(reply)
        return _with_reply(reply, {**a, "x": np.concatenate([a["x"], a["x"][:1]])})

    fed = federation(CONFIG, "centralized", seed=4)
    _run(fed, cfgs, run_id=41, tamper=pad)
    assert [e["trained"] for e in fed.log] == [[0, 1]] * 3
    assert all(
        r[2] == "reply 'x' has shape (11, 2), expected (10, 2)" for r in fed.rejected.values()
    )
    assert DTYPES[fed.dtype] == torch.float64


HANDSHAKE_CORRUPT = {
    "no info": (
        lambda r: RecordDict({"spy": ConfigRecord({"x": 1})}),
        "handshake without an info record",
    ),
    "rows not a number": (
        lambda r: retag(r, "info", **{"num-train": "many"}),
        "handshake info num-train='many' is not a int",
    ),
    "index out of range": (
        lambda r: retag(r, "info", **{"client-index": 7}),
        "handshake info client-index=7 num-clients=3 num-train=7 is inconsistent",
    ),
    "features not JSON": (
        lambda r: retag(r, "info", features="f,T"),
        "handshake info features='f,T' is not a JSON list of names",
    ),
    "a class count sizes the server's model": (
        lambda r: retag(r, "info", **{"num-classes": 10**9}),
        "handshake info num-classes=1000000000 does not fit classification=False",
    ),
}


@pytest.mark.parametrize("case", list(HANDSHAKE_CORRUPT))
def test_malformed_handshake_leaves_that_node_out(case, make_fleet, tmp_path) -> None:
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    corrupt, reason = HANDSHAKE_CORRUPT[case]
    cfgs = _node_cfgs(fleet, tmp_path)
    bad = _node_of(cfgs, 1)
    fed = federation(CONFIG, "fedavg", seed=4)
    run_in_process(fed, cfgs, 51, lambda t, i, r: corrupt(r) if (t, i) == (-1, 1) else r)
    assert fed.handshake_rejected == {str(bad): f"node {bad}: {reason}"}
    assert sorted(m.client_index for m in fed.members.values()) == [0, 2]
    assert [e["trained"] for e in fed.log] == [[0, 2]] * 3


def test_malformed_scaling_sums_are_rejected(make_fleet, tmp_path) -> None:
    """Federated scaling needs every client's sums: a NaN sum stops the run, saying why."""
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])
    config = replace(CONFIG, data=replace(CONFIG.data, scaling="federated"))
    cfgs = _node_cfgs(fleet, tmp_path)
    bad = _node_of(cfgs, 2)

    def poison(t, i, r):
        if (t, i) != (-1, 2):
            return r
        out = RecordDict(dict(r.items()))
        sums = {k: v.numpy() for k, v in r["moments"].items()}
        sums["sx"] = np.full_like(sums["sx"], np.nan)
        out["moments"] = ArrayRecord({k: Array(v) for k, v in sums.items()})
        return out

    fed = federation(config, "fedavg", seed=4)
    with pytest.raises(RuntimeError, match=f"only 2 answered the handshake; node {bad}: scaling"):
        run_in_process(fed, cfgs, 52, poison)
    assert fed.handshake_rejected == {
        str(bad): f"node {bad}: scaling sum 'sx': float64 (2,), expected finite float64 (2,)"
    }


def test_a_reply_screened_out_by_the_server_is_rolled_back_on_its_site(
    make_fleet, tmp_path
) -> None:
    """Client 1 uploads its body × 1000 in round 1: well formed, so validation passes it, but
    the server's screening (update norm > 10 × the median) rejects it. Its site must then keep
    the private state from before round 1 — the run equals one where client 1 computed round 1
    and uploaded nothing, and differs from one that kept the screened round's state."""
    fleet = make_fleet(num_clients=3, train=[13, 7, 10])

    def scaled(t, i, reply):
        if (t, i) != (1, 1):
            return reply
        return _with_reply(reply, {k: v * 1000 for k, v in _arrays(reply).items()})

    def absent(t, i, reply):
        if (t, i) == (1, 1):
            return RecordDict({k: v for k, v in reply.items() if k not in ("reply", "train")})
        return reply

    runs = {}
    for name, tamper in (("screened", scaled), ("absent", absent), ("honest", None)):
        cfgs = _node_cfgs(fleet, tmp_path / name)
        runs[name] = federation(CONFIG, "fedper", seed=4)
        _run(runs[name], cfgs, run_id=61, tamper=tamper)
        runs[name].states = _states(cfgs, 61)
    fed, ref, honest = runs["screened"], runs["absent"], runs["honest"]
    assert fed.log[1]["trained"] == [0, 1, 2] and fed.log[1]["screened"] == [1]
    assert fed.rejected == {} and ref.log[1]["trained"] == [0, 2]
    assert fed.last_used == {0: 2, 1: 2, 2: 2} and fed.rejected_rounds == {1: 1}
    for k, v in flatten(ref.server).items():
        assert torch.equal(flatten(fed.server)[k], v), k
    drop = ("rejected_rounds", "train_loss")  # a screened client did train: its loss is shown
    strip = [{k: v for k, v in r.items() if k not in drop} for r in fed.history]
    np.testing.assert_equal(
        strip, [{k: v for k, v in r.items() if k not in drop} for r in ref.history]
    )
    assert [r["rejected_rounds"] for r in fed.history if r["client_index"] == 1] == [0, 1, 1]
    victim = _node_of(cfgs, 1)
    for n, state in fed.states.items():
        assert all(torch.equal(state[k], ref.states[n][k]) for k in state), n
    # the rollback matters: keeping round 1's head would have changed client 1's state
    gap = max((fed.states[victim][k] - honest.states[victim][k]).abs().max() for k in state)
    assert gap > 1e-6

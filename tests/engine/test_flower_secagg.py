"""Secure aggregation (SecAgg+) of fedprior's and fedpoly's statistics on the Flower path.

In process (the ServerApp's own round loop and the sites' real handlers,
``fedcal_support.flower_hostile``): six sensors on three sites of 1, 2 and 3.

* a SecAgg+ run's round-0 sums equal the plain run's within the fixed-point
  bound N·q/2 (computed, asserted, and the error is not zero), no sensor's
  statistics are on the wire, each site's vector is masked, and the runs'
  results agree;
* a site whose reply is lost after the key shares (within the threshold) is
  unmasked away and the round completes, as the plain run with the same loss;
  beyond the threshold the round fails in one line;
* a method or policy that needs each reply is refused in one line.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.common.serde import recorddict_from_proto
from flwr.proto.recorddict_pb2 import RecordDict as RecordDictProto

from fedcal.apps.flower_server import federation, secure_settings
from fedcal.config import (
    ConfigError,
    EngineSection,
    ModelConfig,
    RunConfig,
    TrainConfig,
    load_config,
)
from fedcal.core.aggregation import AggregationRules
from fedcal.core.tree import flatten
from fedcal.engine.flower.loop import run_federation
from fedcal.engine.flower.secagg import (
    SECAGG,
    Layout,
    SecureAggregation,
    SecureAggregationError,
    decode,
    encode,
    neighbours,
)
from fedcal.engine.flower.wire import split_parts, to_numpy
from fedcal_support.flower_hostile import InProcess, node_cfgs

ROUNDS = 2
CONFIG = RunConfig(
    model=ModelConfig(hidden=(6, 5)),
    train=TrainConfig(lr=0.1, local_epochs=2, batch_size=4),
    engine=EngineSection(rounds=ROUNDS, dtype="float64"),
    method_params={"fedprior": {"orders": [1, 1], "init_noise": 0.1, "robust": "off"}},
)
SITES = {"S00": "lab-b", "S01": "lab-a", "S02": "lab-c", "S03": "lab-c", "S04": "lab-a"}
SITES |= {"S05": "lab-c"}
TRAIN_ROWS = [13, 7, 10, 9, 12, 8]
# Ranges these toy sensors stay inside (fedprior's GLS terms grow as σ² shrinks: 137 here)
# and 40 fraction bits, so that the rounding (q = R·2⁻⁴⁰) is visible above float64's
RANGES = SecureAggregation(
    range=64.0, ranges={"gram": 1024, "n": 1024, "gls_gram": 65536, "gls_rhs": 4096}, bits=40
)


def _run(fleet, root, method, secure=None, lost=None, rounds=0):
    cfgs = node_cfgs(fleet, root, sites=SITES)
    fed = federation(CONFIG, method, seed=4, secure=secure, rounds=rounds)
    wire: list = []
    transport = InProcess(cfgs, 11, lost=lost, wire=wire)
    run_federation(fed, transport)
    return fed, cfgs, wire


def _replies(wire, t):
    """node → per-sensor parts of its reply to message t (as it went on the wire)."""
    out = {}
    for r, n, data in wire:
        if r != t:
            continue
        proto = RecordDictProto()
        proto.ParseFromString(data)
        content = recorddict_from_proto(proto)
        if "fedcal" in content or "site" in content:  # a round reply (not a handshake)
            out[n] = content
    return out


@pytest.fixture(scope="module")
def fleet(make_fleet):
    return make_fleet(num_clients=6, train=TRAIN_ROWS)


@pytest.mark.parametrize("method", ["fedprior", "fedpoly"])
def test_secure_run_equals_the_plain_run_within_the_quantization_bound(
    method, fleet, tmp_path
) -> None:
    plain, _, plain_wire = _run(fleet, tmp_path / "plain", method)
    secure, _, secure_wire = _run(fleet, tmp_path / "secure", method, SecureAggregation())
    coarse, _, _ = _run(fleet, tmp_path / "coarse", method, RANGES, rounds=1)
    assert [e["trained"] for e in secure.log] == [list(range(6))] * ROUNDS

    # Round 0 starts from the same server state: the secure sum is the plain sum of the six
    # sensors' statistics, up to fixed point (N·q/2 per entry, q = range·2⁻⁴⁰) and float64.
    got = coarse.secure_sums[0]
    assert got.count == 6 and got.clipped == 0 and got.dropped == []
    per_sensor: dict[str, list[np.ndarray]] = {}
    for rep in _replies(plain_wire, 0).values():
        parts, _, _ = split_parts(rep)
        for part in parts.values():
            for k, v in part["reply"].items():
                per_sensor.setdefault(k, []).append(to_numpy(v).astype(np.float64))
    assert sorted(per_sensor) == sorted(got.sums) and all(len(v) == 6 for v in per_sensor.values())
    worst = 0.0
    for k, values in per_sensor.items():
        exact = np.sum(values, axis=0)
        q = RANGES.range_of(k) * 2.0**-RANGES.bits
        bound = 6 * q / 2 + 4 * np.finfo(float).eps * np.sum(np.abs(values), axis=0)
        assert got.bound[k] == pytest.approx(6 * q / 2)
        err = np.abs(got.sums[k] - exact)
        assert (err <= bound).all(), (k, err.max(), bound.max())
        worst = max(worst, float((err / bound).max()))
    assert worst > 0  # the encoding rounds: the test would see an exact copy

    # What the server received: no sensor's statistics, each site's vector masked.
    layout = Layout.of({k: v[0].shape for k, v in per_sensor.items()}, RANGES)
    plain_parts = {n: split_parts(r)[0] for n, r in _replies(plain_wire, 0).items()}
    for n, rep in _replies(secure_wire, 0).items():
        parts, common, _ = split_parts(rep)
        assert all("reply" not in p for p in parts.values())
        masked = to_numpy(common[f"{SECAGG}-masked"]["y"])
        own = encode(
            layout,
            [{k: to_numpy(v) for k, v in p["reply"].items()} for p in plain_parts[n].values()],
        ).view(np.uint64)
        assert masked.shape == own.shape and (masked != own).mean() > 0.99

    # The whole run with the default encoding (84 fraction bits: below float64's spacing,
    # so what differs is the order of the float additions): the plain run's numbers.
    assert all(out.clipped == 0 for out in secure.secure_sums.values())
    a, b = flatten(plain.server), flatten(secure.server)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12), k
    rows = {(r["round"], r["client"]): r["test_rmse"] for r in plain.history}
    for r in secure.history:
        assert r["test_rmse"] == pytest.approx(rows[(r["round"], r["client"])], rel=1e-9)


def test_a_site_dropped_within_the_threshold_is_unmasked_away_and_the_round_completes(
    fleet, tmp_path
) -> None:
    cfgs = node_cfgs(fleet, tmp_path / "probe", sites=SITES)
    lab_b = next(n for n, c in cfgs.items() if c["site-id"] == "lab-b")  # sensor 0's site
    lost = lambda t: {lab_b} if t == 1 else set()  # noqa: E731 — its round-1 reply is lost
    plain, _, _ = _run(fleet, tmp_path / "plain", "fedprior", lost=lost)
    secure, _, _ = _run(fleet, tmp_path / "secure", "fedprior", SecureAggregation(), lost=lost)
    entry = secure.log[1]
    assert entry["secure"]["dropped_sites"] == [lab_b]
    assert entry["trained"] == [1, 2, 3, 4, 5] == plain.log[1]["trained"]
    assert secure.secure_sums[1].count == 5
    assert secure.last_used[0] == 0  # its round-1 state is rolled back, as in the plain run
    a, b = flatten(plain.server), flatten(secure.server)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12), k

    # All three sites' shares needed: losing one reply leaves the sum masked; the run says so.
    strict = SecureAggregation(threshold=1.0)
    with pytest.raises(SecureAggregationError, match="threshold 3") as err:
        _run(fleet, tmp_path / "strict", "fedprior", strict, lost=lost)
    assert "\n" not in str(err.value)


def test_secagg_plus_ring_and_run_config() -> None:
    ring = neighbours([5, 1, 9, 3, 7], shares=3)
    assert ring == {1: [1, 3, 9], 3: [1, 3, 5], 5: [3, 5, 7], 7: [5, 7, 9], 9: [1, 7, 9]}
    assert neighbours([2, 1, 3], shares=0) == {n: [1, 2, 3] for n in (1, 2, 3)}
    assert secure_settings({"secure-aggregation": False}) is None
    got = secure_settings(
        {"secure-aggregation": True, "secagg-range": 8.0, "secagg-ranges": "gram=4096,cand/=2"}
    )
    assert got.range_of("gram") == 4096 and got.range_of("cand/mean") == 2
    assert got.range_of("mean") == 8
    assert got.range_of("cand/gls_gram") == got.range_of("gls_gram") == 2.0**36  # the default
    with pytest.raises(ValueError, match="not name=number"):
        SecureAggregation.parse_ranges("gram:3")
    # entries beyond their range are clipped and counted; the rest round to the nearest q
    # (a range is rounded up to a power of two: 1.5 → 2)
    layout = Layout.of({"a": (3,)}, SecureAggregation(range=1.5, bits=60))
    q = 2.0 * 2.0**-60
    total = encode(layout, [{"a": np.array([2.5, -7.0, 0.3])}, {"a": np.array([1.0, 0, q / 3])}])
    assert total[:2].tolist() == [2, 2]  # two sensors, two clipped entries
    hi, lo = total[2:5].astype(object), total[5:].astype(object)
    e = [h * 2**42 + low for h, low in zip(hi, lo, strict=True)]
    assert e == [3 * 2**59, -(2**60), int(0.3 * 2**59)]  # 2 + 1, −2, 0.3 (+ q/3 → 0), over q
    sums, count, clipped = decode(layout, total.view(np.uint64))
    assert (count, clipped) == (2, 2) and sums["a"].tolist() == [3.0, -2.0, 0.3]


@pytest.mark.parametrize(
    "method, params, rules, says",
    [
        ("fedavg", {}, {}, "fedavg does not upload sums"),
        ("fedprior", {"interval": "calibrated"}, {}, "interval = 'calibrated'"),
        ("fedprior", {"robust": "full"}, {}, "robust = 'full'"),
        ("fedprior", {}, {"rule": "krum"}, "rule 'krum' needs each site's reply"),
    ],
)
def test_methods_and_policies_that_need_each_reply_are_refused(method, params, rules, says):
    config = replace(
        CONFIG,
        method_params={method: {**CONFIG.method_params.get(method, {}), **params}},
        aggregation=AggregationRules(**rules),
    )
    with pytest.raises(ConfigError, match="secure aggregation") as err:
        federation(config, method, secure=SecureAggregation())
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_documented_secure_fedprior_configuration_is_accepted(tmp_path) -> None:
    """docs/flower.md's secure.toml block: the shipped fedprior with it runs under grouped
    SecAgg+; without it (or without groups) it is refused in one line that says why."""
    docs = (Path(__file__).parents[2] / "docs" / "flower.md").read_text(encoding="utf-8")
    block = re.search(r"```toml\n(\[methods\.fedprior\][^`]*)```", docs)
    assert block is not None, "docs/flower.md lost its secure.toml block"
    path = tmp_path / "secure.toml"
    path.write_text(block.group(1), encoding="utf-8")
    documented = load_config(path)
    assert federation(documented, "fedprior", secure=SecureAggregation(groups=2)) is not None
    with pytest.raises(ConfigError, match="robust = 'full'"):
        federation(documented, "fedprior", secure=SecureAggregation(groups=0))
    with pytest.raises(ConfigError, match="interval = 'calibrated'"):
        federation(load_config(None), "fedprior", secure=SecureAggregation(groups=2))

"""A fleet's tensors built chunk by chunk (``prepare_chunks``) against the whole frame's.

A mixed fleet (3 reference units of a 4x3 design, then 4 new 3x2 units: the chunks pad to
different row counts) simulated 3 sensors a chunk must give :func:`prepare`'s tensors of the
whole fleet to the bit — inputs, targets, counts, sweep signs, ids, scaler — with the
barometer's physical scaling (one pass) and with federated scaling (a first pass of sums).
"""

from __future__ import annotations

import pytest
import torch

from fedcal.data.fleet import Fleet
from fedcal.data.simulator import FleetSpec, simulate_chunks, simulate_fleet, simulated_meta
from fedcal.engine.simulation import prepare, prepare_chunks

SPEC = FleetSpec(num_reference=3, num_new=4, reference_design="4x3", train_design="3x2")


def _parts(calls: list[int]):
    def parts():
        calls.append(1)
        meta = simulated_meta(SPEC, 5)
        for frame in simulate_chunks(SPEC, seed=5, chunk_size=3):
            yield Fleet(frame, meta=meta)

    return parts


@pytest.mark.parametrize(("scaling", "passes"), [("auto", 1), ("federated", 2)])
def test_chunked_tensors_equal_the_whole_frames(scaling, passes):
    whole = prepare(simulate_fleet(SPEC, seed=5), scaling)
    calls: list[int] = []
    chunked = prepare_chunks(_parts(calls), scaling)
    assert len(calls) == passes
    assert chunked.client_ids == whole.client_ids
    assert chunked.scaler.to_dict() == whole.scaler.to_dict()
    assert chunked.target_unit == whole.target_unit
    for split in ("train", "test"):
        a, b = getattr(chunked, split), getattr(whole, split)
        assert a.x.shape == b.x.shape and a.x.dtype == b.x.dtype
        for name in ("x", "y", "count", "branch"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (split, name)
        assert b.branch is not None and a.time is None and b.time is None
        assert a.seeds == b.seeds and a.index == b.index
    # The chunks padded differently: the reference units have more calibration rows.
    counts = whole.train.count.tolist()
    assert counts[0] > counts[-1]


def test_no_sensors_is_refused():
    with pytest.raises(ValueError, match="no sensors"):
        prepare_chunks(lambda: iter(()))

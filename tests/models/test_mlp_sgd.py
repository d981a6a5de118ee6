"""The MLP's fused SGD loop equals the generic loop (core.local.train + optim.SGD) to the bit."""

from __future__ import annotations

import pytest
import torch

from fedcal.core.data import ClientData, full_batch, minibatches
from fedcal.core.local import train
from fedcal.core.optim import SGD, Adam, plain_sgd_lr
from fedcal.core.task import Task
from fedcal.core.tree import expand
from fedcal.models.mlp import MLP


def cohort(counts: list[int], dtype: torch.dtype) -> ClientData:
    gen = torch.Generator().manual_seed(3)
    arrays = [
        (torch.randn(n, 2, generator=gen).numpy(), torch.randn(n, 1, generator=gen).numpy())
        for n in counts
    ]
    return ClientData.from_arrays(arrays, seeds=tuple(range(11, 11 + len(counts))), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("wrt", [None, ("l2.weight", "l2.bias"), ("l0.weight", "l1.bias")])
@pytest.mark.parametrize("counts", [[21, 9, 16], [21, 9, 16, 0]])
def test_fused_sgd_equals_the_generic_loop_to_the_bit(dtype, activation, wrt, counts):
    model = MLP(hidden=(8, 6), activation=activation)
    # Different row counts: late steps have idle clients (the masked update); a client
    # with no rows at all must not move, and its loss is 0.
    data = cohort(counts, dtype)
    params = expand(model.init(torch.Generator().manual_seed(0), dtype), data.num_clients)
    batches = minibatches(data, epochs=3, batch_size=4)
    assert not all(batches.all_active)
    assert any(batches.all_active) == (0 not in counts)  # both kinds of step are run
    names = list(params) if wrt is None else [k for k in params if k in wrt]
    want, want_loss = train(model.mse_value_and_grad, params, batches, SGD(0.1), names)
    got, got_loss = model.sgd_train(params, batches, 0.1, wrt)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert torch.equal(got_loss, want_loss)
    for k in params:  # untrained leaves are the caller's; a client without rows keeps its own
        assert (got[k] is params[k]) == (k not in names)
        if 0 in counts:
            assert torch.equal(got[k][3], params[k][3])
    assert (want_loss[:3] > 0).all() and (0 not in counts or want_loss[3] == 0)


def test_fused_full_batch_steps_equal_the_generic_loop():
    model = MLP(hidden=(5, 4))
    data = cohort([7, 12], torch.float32)
    params = expand(model.init(torch.Generator().manual_seed(1), torch.float32), 2)
    batches = full_batch(data, steps=3)
    want, _ = train(model.mse_value_and_grad, params, batches, SGD(0.05))
    got, _ = model.sgd_train(params, batches, 0.05)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_only_plain_sgd_takes_the_fused_loop():
    assert plain_sgd_lr(SGD(0.2)) == 0.2
    assert plain_sgd_lr(SGD(0.2, momentum=0.9)) is None
    assert plain_sgd_lr(SGD(0.2, weight_decay=1e-4)) is None
    assert plain_sgd_lr(Adam(0.01)) is None


def test_a_task_with_its_own_loss_does_not_take_the_fused_loop():
    class Huber(Task):
        def criterion(self, pred, y, w):
            return torch.nn.functional.huber_loss(pred, y, reduction="none").mean(-1).sum(1)

    model = MLP(hidden=(3,))
    data = cohort([5], torch.float32)
    params = expand(model.init(torch.Generator().manual_seed(2), torch.float32), 1)
    batches = full_batch(data)
    assert Huber(model).sgd_train(params, batches, 0.1) is None
    assert Task(model).sgd_train(params, batches, 0.1) is not None


@pytest.mark.parametrize("wrt", [None, ("l1.weight", "l2.weight")])
def test_fused_sgd_equals_the_generic_loop_at_the_seed_width(wrt):
    # The seed's 2-64-64-1 at batch 32: the widths where torch's element-wise kernels run
    # vectorized (the small test above mostly exercises their scalar tails).
    model = MLP(hidden=(64, 64))
    data = cohort([96, 96, 80, 64], torch.float32)
    params = expand(model.init(torch.Generator().manual_seed(4), torch.float32), 4)
    batches = minibatches(data, epochs=2, batch_size=32)
    names = list(params) if wrt is None else list(wrt)
    want, want_loss = train(model.mse_value_and_grad, params, batches, SGD(0.05), names)
    got, got_loss = model.sgd_train(params, batches, 0.05, wrt)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(got_loss, want_loss)
    assert not torch.equal(got["l1.weight"], params["l1.weight"])  # it did train

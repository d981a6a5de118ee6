"""Per-client gradient-norm clipping of local training against torch's clip_grad_norm_."""

from __future__ import annotations

import torch

from fedcal.core.local import GradClip, clip_by_norm
from fedcal.core.optim import SGD

F64 = torch.float64


def test_each_client_is_clipped_like_clip_grad_norm():
    gen = torch.Generator().manual_seed(0)
    grads = {
        "w": torch.randn(3, 4, 2, generator=gen, dtype=F64)
        * torch.tensor([10.0, 0.1, 1.0], dtype=F64).reshape(3, 1, 1),
        "b": torch.randn(3, 2, generator=gen, dtype=F64),
    }
    clipped = clip_by_norm(grads, 1.5)
    for c in range(3):
        ref = [
            torch.nn.Parameter(torch.zeros(4, 2, dtype=F64)),
            torch.nn.Parameter(torch.zeros(2, dtype=F64)),
        ]
        ref[0].grad, ref[1].grad = grads["w"][c].clone(), grads["b"][c].clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.5)
        assert torch.allclose(clipped["w"][c], ref[0].grad, atol=1e-15)
        assert torch.allclose(clipped["b"][c], ref[1].grad, atol=1e-15)
    # The small client is untouched, the large one lands on the bound.
    norms = torch.cat([clipped["w"].flatten(1), clipped["b"]], 1).norm(dim=1)
    assert abs(float(norms[0]) - 1.5) < 1e-5
    assert torch.equal(clipped["w"][1], grads["w"][1])


def test_clipped_sgd_step_by_hand():
    params = {"w": torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=F64)}
    grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=F64)}
    new, _ = GradClip(SGD(lr=0.1), 1.0).update(params, grads, {})
    factor = 1.0 / (5.0 + 1e-6)  # torch's max_norm / (norm + 1e-6)
    expected = torch.tensor(
        [[1 - 0.1 * 3 * factor, 1 - 0.1 * 4 * factor], [1 - 0.03, 1 - 0.04]], dtype=F64
    )
    assert torch.allclose(new["w"], expected, atol=1e-15)
    assert GradClip(SGD(lr=0.1), 1.0).lr == 0.1


def test_algorithm_recipe_switches_clipping_on():
    from fedcal.algorithms.fedavg import FedAvg
    from fedcal.core.task import Task
    from fedcal.models.mlp import MLP

    task = Task(MLP(hidden=(4,)))
    assert isinstance(FedAvg(task).make_optimizer(), SGD)
    clipped = FedAvg(task, grad_clip=2.0).make_optimizer()
    assert isinstance(clipped, GradClip) and clipped.max_norm == 2.0

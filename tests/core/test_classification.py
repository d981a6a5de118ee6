"""The prototype pieces FedProto and FedUCS share (core/classification), by hand."""

import torch

from fedcal.core.classification import prototype_consensus, prototype_distance

F64 = torch.float64


def test_prototype_consensus_is_count_weighted_and_flags_held_classes():
    """Class 0: (1·[3,0] + 3·[1,4])/4 = [1.5, 3]; class 1: client 0's [2, 2] alone;
    class 2 held by nobody: mean 0, not held, but known from before."""
    protos = torch.tensor(
        [[[3.0, 0.0], [2.0, 2.0], [7.0, 7.0]], [[1.0, 4.0], [5.0, 5.0], [7.0, 7.0]]], dtype=F64
    )
    counts = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], dtype=F64)
    known = torch.tensor([0.0, 1.0, 1.0], dtype=F64)
    mean, held, now_known = prototype_consensus(protos, counts, known)
    assert torch.equal(mean, torch.tensor([[1.5, 3.0], [2.0, 2.0], [0.0, 0.0]], dtype=F64))
    assert held.tolist() == [[True], [True], [False]]
    assert now_known.tolist() == [1.0, 1.0, 1.0] and known.tolist() == [0.0, 1.0, 1.0]


def test_prototype_distance_per_row_only_where_the_class_has_a_prototype():
    """Rows of class 0 against P_0 = [1, 0]: h = [2, 2] → ((1)² + (2)²)/2 = 2.5;
    h = [1, 0] → 0. A row of class 1 (no prototype: known 0) → 0."""
    h = torch.tensor([[[2.0, 2.0], [1.0, 0.0], [9.0, 9.0]]], dtype=F64)
    labels = torch.tensor([[0, 0, 1]])
    protos = torch.tensor([[[1.0, 0.0], [3.0, 3.0]]], dtype=F64)
    known = torch.tensor([[1.0, 0.0]], dtype=F64)
    dist = prototype_distance(h, labels, protos, known)
    assert dist.tolist() == [[2.5, 0.0, 0.0]]
    known = torch.tensor([[1.0, 1.0]], dtype=F64)  # with a prototype: ((6)² + (6)²)/2
    assert prototype_distance(h, labels, protos, known).tolist() == [[2.5, 0.0, 36.0]]

import torch

from fedcal.core import tree as T


def test_weighted_mean_is_closed_form():
    replies = {"w": torch.tensor([[1.0, 2.0], [3.0, 6.0], [5.0, 10.0]])}
    out = T.weighted_mean(replies, torch.tensor([1.0, 1.0, 2.0]))
    # (1·[1,2] + 1·[3,6] + 2·[5,10]) / 4
    assert torch.allclose(out["w"], torch.tensor([14 / 4, 28 / 4]))


def test_expand_gather_scatter_round_trip():
    server = {"a": torch.arange(3.0), "b": {"c": torch.ones(2, 2)}}
    client = T.expand(server, 4)
    assert client["a"].shape == (4, 3) and client["b"]["c"].shape == (4, 2, 2)
    idx = torch.tensor([1, 3])
    rows = T.tree_map(lambda t: t + 10, T.gather(client, idx))
    out = T.scatter(T.clone(client), idx, rows)
    assert torch.equal(out["a"][1], server["a"] + 10)
    assert torch.equal(out["a"][0], server["a"])
    assert torch.equal(client["a"][1], server["a"])  # input untouched


def test_flatten_unflatten_and_bytes():
    t = {"x": {"y": torch.zeros(2, 3), "z": torch.zeros(2, dtype=torch.float64)}}
    assert T.unflatten(T.flatten(t)).keys() == t.keys()
    assert set(T.flatten(t)) == {"x/y", "x/z"}
    assert T.num_bytes(t) == 6 * 4 + 2 * 8
    assert T.num_bytes(t, per_client_axis=True) == 3 * 4 + 8


def test_sq_norm_per_client():
    t = {"a": torch.tensor([[3.0], [0.0]]), "b": torch.tensor([[4.0, 0.0], [1.0, 1.0]])}
    assert torch.allclose(T.sq_norm(t), torch.tensor([25.0, 2.0]))


def test_weighted_mean_with_unit_weights_equals_the_weighted_formula_to_the_bit():
    gen = torch.Generator().manual_seed(4)
    replies = {"w": torch.randn(300, 7, 5, generator=gen) * 1e3, "b": torch.randn(300, 2)}
    ones = torch.ones(300, dtype=torch.float64)
    got = T.weighted_mean(replies, ones)
    for k, t in replies.items():
        assert torch.equal(
            got[k], (ones.to(t.dtype).reshape(-1, *[1] * (t.dim() - 1)) * t).sum(0) / 300
        )

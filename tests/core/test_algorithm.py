"""The Algorithm base: string options checked once, and the default server aggregation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch

from fedcal.algorithms import REGISTRY
from fedcal.core.algorithm import Algorithm, ClientResult, options
from fedcal.core.classification import ClassificationTask
from fedcal.core.task import Task
from fedcal.models.classifier import HypersphereClassifier
from fedcal.models.mlp import MLP

TASK = Task(MLP(hidden=(5, 4)))
TASKS = {
    "regression": TASK,
    "classification": ClassificationTask(HypersphereClassifier(4, (5,), 3, 2)),
}


@dataclass(frozen=True)
class Toy(Algorithm):
    mode: Literal["a", "b"] = "a"
    maybe: Literal["x"] | None = None
    plain: str = "anything"

    name = "toy"

    def __post_init__(self) -> None:  # no super() call: the check runs all the same
        pass

    def client_update(self, down, state, data):
        return ClientResult(down, state, {})


def test_options_are_the_literal_fields():
    assert options(Toy) == {"optimizer": ("sgd", "adam"), "mode": ("a", "b"), "maybe": ("x", None)}


def test_a_bad_option_is_one_line_naming_method_field_and_choices():
    with pytest.raises(ValueError, match=r"^toy mode: must be one of 'a' or 'b', got 'c'$"):
        Toy(TASK, mode="c")
    with pytest.raises(ValueError, match=r"^toy maybe: must be one of 'x', got 'y'$"):
        Toy(TASK, maybe="y")
    with pytest.raises(ValueError, match=r"^toy optimizer: must be one of 'sgd' or 'adam'"):
        Toy(TASK, optimizer="rmsprop")
    assert Toy(TASK, mode="b", maybe="x", plain="free").mode == "b"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_option_is_checked(name):
    """Every Literal field of every method refuses a value outside its choices, and its
    default is one of them; every method has at least the optimizer option."""
    cls = REGISTRY[name]
    found = options(cls)
    assert "optimizer" in found
    for field, choices in found.items():
        default = cls.__dataclass_fields__[field].default
        assert default in choices, (field, default)
        with pytest.raises(ValueError, match=rf"^{cls.name} {field}: must be one of "):
            cls(TASKS[cls.task_kind], **{field: "no-such-choice"})


def test_fedgmi_options_are_literals_not_hand_checks():
    assert options(REGISTRY["fedgmi"]) == {
        "optimizer": ("sgd", "adam"),
        "magnitude": ("element", "tensor"),
        "upload": ("full", "body"),
        "evaluate": ("local", "global_body"),
        "normalize": ("separate", "joint"),
        "interpolation": ("gradient", "posterior"),
    }


def test_server_update_averages_what_was_uploaded_and_keeps_the_rest():
    """Server model {a: 1, b: 2}; two clients upload only a = 1 and 3 with 1 and 3 rows:
    sample-weighted a = (1·1 + 3·3)/4 = 2.5, plain mean 2; b (never uploaded) stays 2."""
    server = {"model": {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])}, "other": 7}
    replies = {"model": {"a": torch.tensor([[1.0], [3.0]])}}
    counts = torch.tensor([1, 3])
    weighted = Toy(TASK, sample_weighted=True).server_update(server, replies, counts)
    plain = Toy(TASK).server_update(server, replies, counts)
    assert weighted["model"]["a"].tolist() == [2.5] and plain["model"]["a"].tolist() == [2.0]
    assert weighted["model"]["b"] is server["model"]["b"] and weighted["other"] == 7
    assert list(weighted["model"]) == ["a", "b"]


@pytest.mark.parametrize("name", ["fedproto", "fedlsa"])
def test_prototype_methods_refuse_a_model_without_an_embedding(name):
    """A classification fleet may use any model family; these two need the classifier's."""
    with pytest.raises(ValueError, match=f"{name} needs the hypersphere classifier"):
        REGISTRY[name](ClassificationTask(MLP(4, (5,), 3)))

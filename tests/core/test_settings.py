"""A method's settings are checked in one place: ranges declared on its fields, one task hook.

Every registered method's declared ranges are enforced at configuration load (a value just
outside each bound is refused in one line naming the table and the field), and checks that
need the task (:meth:`Algorithm.check_task`) run at load on the task the configuration
describes, wherever a constructor reads the task.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pytest
from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import Field
from pydantic.fields import FieldInfo

from fedcal.algorithms import REGISTRY
from fedcal.config import ConfigError, apply, default_config
from fedcal.core.algorithm import (
    Algorithm,
    ClientResult,
    Recipe,
    SettingError,
    check_settings,
    setting_types,
)
from fedcal.core.task import Task
from fedcal.models.mlp import MLP


def _declared(cls: type) -> dict[str, Any]:
    """Each field's declared type (a recipe field's from Recipe), as setting_types reads them."""
    hints = typing.get_type_hints(cls, include_extras=True)
    hints.update(typing.get_type_hints(Recipe, include_extras=True))
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "task"}


def _outside(hint: Any, default: Any) -> list[Any]:
    """Values just outside each bound ``hint`` declares (ge=a: a − 1; gt=a: a; ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        base, out = args[0], _outside(args[0], default)
        kind = base if base in (int, float) else float
        for item in args[1:]:
            for c in item.metadata if isinstance(item, FieldInfo) else [item]:
                if isinstance(c, Ge):
                    out.append(kind(c.ge - 1))
                elif isinstance(c, Gt):
                    out.append(kind(c.gt))
                elif isinstance(c, Le):
                    out.append(kind(c.le + 1) if kind is int else kind(c.le) * 2 + 1)
                elif isinstance(c, Lt):
                    out.append(kind(c.lt))
                elif isinstance(c, MinLen) and c.min_length == 1:
                    out.append(())
        return out
    if origin is Literal:
        return ["no-such-choice"]
    if origin in (typing.Union, types.UnionType):
        return [v for a in args if a is not type(None) for v in _outside(a, default)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = default[0] if default else None
        return [(v,) for v in _outside(args[0], inner)]
    if origin is tuple:  # fixed length: one entry outside, the others the default's
        if not (isinstance(default, tuple) and len(default) == len(args)):
            default = (0,) * len(args)
        return [
            tuple(v if j == i else d for j, d in enumerate(default))
            for i, a in enumerate(args)
            for v in _outside(a, default[i])
        ]
    return []


def _cases() -> list[tuple[str, str, Any]]:
    out = []
    for name, cls in sorted(REGISTRY.items()):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for field, hint in _declared(cls).items():
            for value in _outside(hint, defaults[field]):
                out.append((name, field, value))
    return out


CASES = _cases()


def test_the_declared_ranges_cover_every_method():
    """Each registered method has ranges to check (the recipe's at least), and the corpus of
    out-of-range values is large: a declaration the walk above cannot read would shrink it."""
    methods = {name for name, _, _ in CASES}
    assert methods == set(REGISTRY)
    assert len(CASES) >= 200
    fields = {(name, field) for name, field, _ in CASES}
    for name, field in [
        ("fedprior", "shrinkage_units"),
        ("fedprior", "orders"),
        ("fedpoly", "private_terms"),
        ("polynomial", "max_orders"),
        ("fedlsa", "lr"),  # a recipe field re-declared by the method keeps the recipe's range
        ("fedgmi", "magnitude"),
    ]:
        assert (name, field) in fields


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_an_out_of_range_setting_is_refused_at_load_naming_the_field(name):
    """Each of the method's out-of-range values alone, as a [methods.<name>] table."""
    wrong = []
    for value_name, field, value in CASES:
        if value_name != name:
            continue
        raw = {"methods": {name: {field: list(value) if isinstance(value, tuple) else value}}}
        try:
            apply(default_config(), raw, "bad.toml")
            wrong.append(f"{field} = {value!r}: accepted")
        except ConfigError as err:
            text = str(err)
            if not text.startswith(f"bad.toml [methods.{name}] {field}: ") or "\n" in text:
                wrong.append(f"{field} = {value!r}: {text}")
    assert wrong == []


def test_every_default_is_inside_its_own_range():
    for cls in REGISTRY.values():
        check_settings(
            cls, {f.name: f.default for f in dataclasses.fields(cls) if f.name != "task"}
        )


def test_every_number_of_every_method_declares_a_range():
    """No number is left to a rule of thumb (the old load refused a negative value where the
    default was not negative): each int or float field (or None) declares a bound."""
    unbounded = []
    for name, cls in REGISTRY.items():
        plain = typing.get_type_hints(cls)
        for field, hint in _declared(cls).items():
            kind = plain[field]
            union = typing.get_origin(kind) in (typing.Union, types.UnionType)
            numeric = set(typing.get_args(kind) if union else (kind,)) & {int, float}
            if numeric and not _outside(hint, None):
                unbounded.append(f"{name}.{field}")
    assert unbounded == []


def test_construction_checks_the_same_ranges_before_post_init():
    """From Python too: one line naming the method and the field, before __post_init__ derives
    anything from the value (fedprior's orders would fail inside int() otherwise)."""
    task = Task(MLP())
    with pytest.raises(SettingError, match=r"^fedprior orders: expected an integer, got 'x'$"):
        REGISTRY["fedprior"](task, orders=("x", 3))
    with pytest.raises(SettingError, match=r"^fedprior shrinkage_units: must be >= 0.0, got -1.0"):
        REGISTRY["fedprior"](task, shrinkage_units=-1.0)
    assert setting_types(REGISTRY["fedprior"])["rank"].validate_python(3) == 3


# ----------------------------------------------------------------------------
# checks that need the task: one hook, run at load on the configuration's task
# ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Widths(Algorithm):
    """A toy whose constructor reads the task before anything else (a derived value)."""

    width: Annotated[int, Field(ge=1)] = 1
    mode: Literal["a", "b"] = "a"

    name = "widths"

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", self.task.model.in_features)  # the task, first

    def check_task(self, task: Task) -> None:
        if self.width > task.model.in_features:
            raise SettingError("width", f"must be <= {task.model.in_features} inputs")

    def client_update(self, down, state, data):
        return ClientResult(down, state, {})


def test_a_task_check_runs_at_load_wherever_the_constructor_reads_the_task(monkeypatch):
    """The old load probed constructors with a task that raised on first access, so every
    check after it was skipped; now the field ranges are checked without a task and the
    hook runs on the configuration's task (the simulator: 2 inputs)."""
    monkeypatch.setitem(REGISTRY, "widths", Widths)
    cfg = default_config()
    with pytest.raises(
        ConfigError, match=r"^x.toml \[methods.widths\] width: must be <= 2 inputs$"
    ):
        apply(cfg, {"methods": {"widths": {"width": 3}}}, "x.toml")
    with pytest.raises(ConfigError, match=r"^x.toml \[methods.widths\] mode: must be one of "):
        apply(cfg, {"methods": {"widths": {"mode": "c"}}}, "x.toml")
    assert apply(cfg, {"methods": {"widths": {"width": 2}}}, "x.toml").method_params["widths"]
    with pytest.raises(SettingError, match=r"^widths width: must be <= 2 inputs$"):
        Widths(Task(MLP()), width=3)


@pytest.mark.parametrize(
    "table,message",
    [  # each check sat after the constructor's first task access: skipped at load until now
        ({"fedala": {"layer_idx": 9}}, "[methods.fedala] layer_idx: must be in 1..3, got 9"),
        (
            {"layerchoice": {"force_k": 4}},
            "[methods.layerchoice] force_k: must be <= the model's 3 layers",
        ),
        (
            {"fedkd": {"public_points": [3]}},
            "[methods.fedkd] public_box, public_points: need one entry per input feature (2)",
        ),
    ],
)
def test_the_registered_task_checks_run_at_load(table, message):
    with pytest.raises(ConfigError) as err:
        apply(default_config(), {"methods": table}, "x.toml")
    assert str(err.value).startswith(f"x.toml {message}"), str(err.value)


def test_the_task_at_load_is_the_one_the_configuration_describes():
    """A file with three named features: fedkd's public box needs three entries, not two."""
    three = {"path": "fleet.csv", "features": ["a", "b", "c"]}
    box = {"public_box": [[0.0, 1.0]] * 3, "public_points": [3, 3, 3]}
    cfg = apply(default_config(), {"data": three, "methods": {"fedkd": box}}, "x.toml")
    assert len(cfg.method_params["fedkd"]["public_box"]) == 3
    with pytest.raises(ConfigError, match=r"\[methods.fedkd\] public_box, public_points"):
        apply(default_config(), {"methods": {"fedkd": box}}, "x.toml")  # the simulator: 2


def test_a_run_s_config_json_of_three_inputs_reads_back():
    """A run's config.json lists every default table (fedpoly_p3 among them): on a fleet of
    three inputs it reads back (``fedcal predict`` refused it), while a method that the file
    runs, or a table it changes, is still checked on the three-input task."""
    three = {"path": "fleet.csv", "features": ["a", "b", "c"]}
    tables = default_config().method_params
    cfg = apply(
        default_config(),
        {"data": three, "run": {"methods": ["fedprior"]}, "methods": tables},
        "config.json",
    )
    assert cfg.method_params["fedpoly_p3"] == tables["fedpoly_p3"]
    runs_it = {"data": three, "run": {"methods": ["fedpoly_p3"]}, "methods": tables}
    with pytest.raises(ConfigError, match=r"\[methods.fedpoly_p3\]: fedpoly calibrates two"):
        apply(default_config(), runs_it, "config.json")
    changed = {**tables, "fedpoly_p3": {**tables["fedpoly_p3"], "max_orders": [3, 2]}}
    with pytest.raises(ConfigError, match=r"\[methods.fedpoly_p3\]: fedpoly calibrates two"):
        apply(default_config(), {"data": three, "methods": changed}, "config.json")

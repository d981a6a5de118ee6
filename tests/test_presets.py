"""Named presets (fedcal.presets): each value written once, checked, and recorded by a run.

The class defaults, the presets and the shipped configurations cannot disagree: a preset
lists only settings its method has, with valid values that differ from the class
defaults, and no shipped table repeats a value its class or preset already gives.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest

from fedcal import presets
from fedcal.algorithms import REGISTRY
from fedcal.build import method_settings, method_values, run_record
from fedcal.config import SHIPPED, ConfigError, from_json, load_config, shipped_layout, to_json
from fedcal.core.algorithm import check_settings
from fedcal.presets import PRESET_KEY, PRESETS, Preset, PresetError, preset_settings


def _defaults(cls: type) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "task"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_names_settings_of_its_method_with_valid_non_default_values(name) -> None:
    preset = PRESETS[name]
    cls = REGISTRY[preset.method]
    defaults = _defaults(cls)
    assert preset.settings, f"{name}: a preset that sets nothing is the class itself"
    for key, value in preset.settings.items():
        assert key in defaults, f"preset {name}: {key} is no setting of {preset.method}"
        check_settings(cls, {key: value})  # the declared type and range
        assert value != defaults[key], f"preset {name}: {key} = {value!r} is the class default"
    assert preset.use.strip()


def test_a_preset_of_an_unknown_setting_or_another_method_is_refused(monkeypatch) -> None:
    bad = {**PRESETS, "typo": Preset("fedprior", MappingProxyType({"shrinkage": 1.0}), "x")}
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType(bad))
    with pytest.raises(PresetError, match=r"preset 'typo' sets shrinkage, not settings of fp"):
        preset_settings("typo", REGISTRY["fedprior"], "fp")
    with pytest.raises(PresetError, match=r"unknown preset 'feld' \(did you mean field"):
        preset_settings("feld", REGISTRY["fedprior"], "fp")
    with pytest.raises(PresetError, match=r"'field' is for fedprior_drift"):
        preset_settings("field", REGISTRY["fedprior"], "fp")
    # a subclass takes its base's presets
    assert preset_settings("chamber", REGISTRY["fedprior_drift"], "d")["own_folds"] == 5


def _given_without(cfg, name: str, key: str) -> object:
    """What the class, the preset and the base's table give ``[methods.<name>]``'s ``key``
    if the table did not set it (before anything the data decide, e.g. basis = "auto")."""
    table = {k: v for k, v in cfg.method_params[name].items() if k != key}
    cls = REGISTRY[table.get("base", name)]
    if "base" in table:
        table = {**cfg.method_params.get(table["base"], {}), **table}
    return {**_defaults(cls), **presets.expanded(table, cls, name)}[key]


def test_no_shipped_table_repeats_a_value_its_class_or_preset_gives() -> None:
    with_presets = tuple(REGISTRY[p.method] for p in PRESETS.values())
    checked = 0
    for config in SHIPPED:
        cfg = load_config(config)
        for name, table in shipped_layout(config).get("methods", {}).items():
            cls, _ = method_settings(name, cfg)
            if not issubclass(cls, with_presets):
                continue
            for key, value in table.items():
                if key in ("base", PRESET_KEY):
                    continue
                value = tuple(value) if isinstance(value, list) else value
                assert value != _given_without(cfg, name, key), (
                    f"configs/{config}.toml [methods.{name}] {key} = {value!r} repeats the "
                    "value its class or preset gives: write it in one place"
                )
                checked += 1
    assert checked >= 5  # fedprior_fixed, _sensor, _branch, generic's basis/degree/noise …


def test_the_shipped_default_is_the_class_with_its_preset() -> None:
    cfg = load_config(None)
    recipe = dataclasses.asdict(cfg.train)
    for name, preset in (("fedprior", "chamber"), ("fedprior_drift", "field")):
        assert cfg.method_params[name] == {PRESET_KEY: preset}
        cls = REGISTRY[name]
        want = {**_defaults(cls), **PRESETS[preset].settings}
        got = method_values(name, cfg)
        run_resolved = {*recipe, "choose"}  # the recipe, and choose = auto resolved by the data
        assert {k: v for k, v in got.items() if k not in run_resolved} == {
            k: v for k, v in want.items() if k not in run_resolved
        }
    # fedprior_drift keeps no own-fold τ² (what its table gave before the presets: 0); the
    # class refuses one beside its short co-location step, so chamber's cannot be used on it
    assert method_values("fedprior_drift", cfg)["own_folds"] == 0
    assert method_values("fedprior", cfg)["own_folds"] == 5


def test_an_explicit_key_beats_the_preset_and_a_variant_inherits_it(tmp_path) -> None:
    path = tmp_path / "my.toml"
    path.write_text(
        '[methods.fedprior]\npreset = "chamber"\nown_folds = 3\n'
        '[methods.fp_sensor]\nbase = "fedprior"\nnoise = "sensor"\n'
    )
    cfg = load_config(path)
    assert cfg.method_params["fedprior"] == {PRESET_KEY: "chamber", "own_folds": 3}
    values = method_values("fedprior", cfg)
    assert (values["own_folds"], values["select"], values["interval"]) == (3, "bic", "calibrated")
    variant = method_values("fp_sensor", cfg)
    assert (variant["noise"], variant["own_folds"], variant["select"]) == ("sensor", 3, "bic")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('preset = "feld"', r"my.toml \[methods.fedprior\] preset: unknown preset 'feld'"),
        ("preset = 3", r"my.toml \[methods.fedprior\] preset: unknown preset 3; known:"),
        (
            'preset = "field"',
            r"my.toml \[methods.fedprior\] preset: preset 'field' is for fedprior_drift",
        ),
    ],
)
def test_a_wrong_preset_is_one_line_naming_file_table_and_key(tmp_path, table, message) -> None:
    path = tmp_path / "my.toml"
    path.write_text(f"[methods.fedprior]\n{table}\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert "\n" not in str(err.value)


def test_config_json_records_the_preset_name_and_the_resolved_settings() -> None:
    cfg = load_config(None)
    record = json.loads(json.dumps(run_record(cfg, ["fedprior", "fedprior_drift"], [0])))
    assert record["methods"]["fedprior"] == {PRESET_KEY: "chamber"}
    resolved = record["resolved"]["methods"]
    assert resolved["fedprior"]["own_folds"] == 5 and resolved["fedprior"]["select"] == "bic"
    assert resolved["fedprior_drift"]["interval"] == "calibrated"
    back = from_json(record)
    assert back.method_params == {
        k: v for k, v in cfg.method_params.items() if k in back.method_params
    }
    assert from_json(to_json(cfg)) == cfg


def test_a_preset_whose_values_its_method_refuses_is_one_line(tmp_path) -> None:
    """chamber's own-fold τ² beside fedprior_drift's short co-location step: the class's own
    check, at load, naming the table (why the field preset has none)."""
    path = tmp_path / "my.toml"
    path.write_text(
        '[run]\nmethods = ["fedprior_drift"]\n[methods.fedprior_drift]\npreset = "chamber"\n'
    )
    with pytest.raises(ConfigError, match=r"\[methods.fedprior_drift\] own_folds: 5 with short_co"):
        load_config(path)


def test_the_command_line_preset_names_the_table_of_its_method() -> None:
    from fedcal.cli.options import _resolve

    cfg = _resolve(None, methods="fedprior_drift", preset="field")
    assert cfg.method_params["fedprior_drift"][PRESET_KEY] == "field"
    cfg = _resolve(None, methods="fedprior", preset="chamber")
    assert method_values("fedprior", cfg)["own_folds"] == 5
    with pytest.raises(ConfigError, match=r"--preset: unknown preset 'lab'; known: chamber, field"):
        _resolve(None, preset="lab")

"""The configuration schema: hostile files, the round trip, and whose defaults a method runs with.

Every hostile file goes through ``fedcal run --config FILE`` (in process): it must end
in exit code 2 with one line naming the file, the section and the field, and nothing
written — never a traceback, never accepted.
"""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from typer.testing import CliRunner

from fedcal.algorithms.clustered import ClusteredLayered as Clustered
from fedcal.algorithms.fedlsa import FedLSA
from fedcal.build import method_settings, method_values, run_record
from fedcal.cli import app
from fedcal.config import (
    ConfigError,
    default_config,
    from_json,
    load_config,
    override,
    shipped_recipe,
    to_json,
    to_layout,
)

runner = CliRunner()

# (file text, what the message must name: "[section] field")
HOSTILE = [
    # [run]
    ("[run]\nmethods = []\n", "[run] methods"),
    ("[run]\nmethods = 'fedavg'\n", "[run] methods"),
    ("[run]\nmethods = ['fedavg', 'fedavg']\n", "[run] methods"),
    ("[run]\nmethods = ['all', 'local']\n", "[run] methods"),
    ("[run]\nmethods = [1]\n", "[run] methods[0]"),
    ("[run]\nmethods = ['fedmagic']\n", "[run] methods"),
    ("[run]\nseeds = 0\n", "[run] seeds"),
    ("[run]\nseeds = -1\n", "[run] seeds"),
    ("[run]\nseeds = 1.5\n", "[run] seeds"),
    ("[run]\nseeds = true\n", "[run] seeds"),
    ("[run]\nseeds = 100000\n", "[run] seeds"),
    ("[run]\ndesigns = ['3y2']\n", "[run] designs"),
    ("[run]\ndesigns = ['3x2', '3x2']\n", "[run] designs"),
    ("[run]\ndesigns = '3x2'\n", "[run] designs"),
    ("[run]\nfleet_seeds = [-1]\n", "[run] fleet_seeds[0]"),
    ("[run]\nfleet_seeds = [0, 0]\n", "[run] fleet_seeds"),
    ("[run]\nfleet_seeds = [1.5]\n", "[run] fleet_seeds[0]"),
    ("[run]\nbogus = 1\n", "[run] bogus"),
    # [data]
    ("[data]\npath = 3\n", "[data] path"),
    ("[data]\nfeatures = []\n", "[data] features"),
    ("[data]\nfeatures = 'frequency_hz'\n", "[data] features"),
    ("[data]\nfeatures = ['frequency_hz', 'frequency_hz']\n", "[data] features"),
    ("[data]\nfeatures = ['']\n", "[data] features[0]"),
    ("[data]\ntarget = ''\n", "[data] target"),
    ("[data]\ntarget = 'frequency_hz'\n", "[data] target"),
    ("[data]\ntest_fraction = 0.0\n", "[data] test_fraction"),
    ("[data]\ntest_fraction = 1.5\n", "[data] test_fraction"),
    ("[data]\ntest_fraction = nan\n", "[data] test_fraction"),
    ("[data]\nsplit_seed = -1\n", "[data] split_seed"),
    ("[data]\ntrain_points = -1\n", "[data] train_points"),
    ("[data]\ntrain_points = 1e9\n", "[data] train_points"),
    ("[data]\nscaling = 'magic'\n", "[data] scaling"),
    ("[data.physical_bounds]\nfrequency_hz = [1.0, 0.0]\n", "[data] physical_bounds.frequency_hz"),
    ("[data.physical_bounds]\nfrequency_hz = 'x'\n", "[data] physical_bounds.frequency_hz"),
    ("[data.physical_bounds]\nfrequency_hz = [nan, 1.0]\n", "[data] physical_bounds.frequency_hz"),
    ("[data.physical_bounds]\nfrequency_hz = [1.0]\n", "[data] physical_bounds.frequency_hz"),
    ("[data]\ncolour = 'red'\n", "[data] colour"),
    # [fleet]
    ("[fleet]\nseed = -1\n", "[fleet] seed"),
    ("[fleet]\nnum_sensors = 0\n", "[fleet] num_sensors"),
    ("[fleet]\nnum_sensors = 1000000000\n", "[fleet] num_sensors"),
    ("[fleet]\nfamily = 'granite'\n", "[fleet] family"),
    ("[fleet]\npreset = 'lunar'\n", "[fleet] preset"),
    ("[fleet]\nheterogeneity = -1.0\n", "[fleet] heterogeneity"),
    ("[fleet]\nheterogeneity = inf\n", "[fleet] heterogeneity"),
    ("[fleet]\nnum_lots = 0\n", "[fleet] num_lots"),
    ("[fleet]\ntest_design = 'sometimes'\n", "[fleet] test_design"),
    ("[fleet]\ntrain_design = '3y2'\n", "[fleet] train_design"),
    ("[fleet]\ntrain_design = 3\n", "[fleet] train_design"),
    ("[fleet]\nnum_reference = -1\n", "[fleet] num_reference"),
    ("[fleet]\nreference_design = '1x1'\n", "[fleet] reference_design"),
    # [model]
    ("[model]\nfamily = 'transformer'\n", "[model] family"),
    ("[model]\nhidden = [0]\n", "[model] hidden[0]"),
    ("[model]\nhidden = [64, -1]\n", "[model] hidden[1]"),
    ("[model]\nhidden = '64'\n", "[model] hidden"),
    ("[model]\nactivation = 'sigmoid'\n", "[model] activation"),
    ("[model]\nhead_layers = 0\n", "[model] head_layers"),
    ("[model]\nhead_layers = 5\n", "[model] head_layers"),
    ("[model]\npoly_orders = [-1, 2]\n", "[model] poly_orders[0]"),
    ("[model]\nwhiten = 'yes'\n", "[model] whiten"),
    # [engine]
    ("[engine]\nrounds = 0\n", "[engine] rounds"),
    ("[engine]\nrounds = -5\n", "[engine] rounds"),
    ("[engine]\nrounds = 1000000000\n", "[engine] rounds"),
    ("[engine]\nrounds = 2.5\n", "[engine] rounds"),
    ("[engine]\nrounds = '50'\n", "[engine] rounds"),
    ("[engine]\nparticipation = 0.0\n", "[engine] participation"),
    ("[engine]\nparticipation = 1.5\n", "[engine] participation"),
    ("[engine]\nparticipation = -0.2\n", "[engine] participation"),
    ("[engine]\neval_every = 0\n", "[engine] eval_every"),
    ("[engine]\ndtype = 'float16'\n", "[engine] dtype"),
    ("[engine]\ncheckpoint_every = 0\n", "[engine] checkpoint_every"),
    ("[engine]\nround = 3\n", "[engine] round"),
    # [train]
    ("[train]\nlr = -0.1\n", "[train] lr"),
    ("[train]\nlr = nan\n", "[train] lr"),
    ("[train]\nlr = inf\n", "[train] lr"),
    ("[train]\nlr = 0.0\n", "[train] lr"),
    ("[train]\nlr = 100.0\n", "[train] lr"),
    ("[train]\nlocal_epochs = -1\n", "[train] local_epochs"),
    ("[train]\nbatch_size = 0\n", "[train] batch_size"),
    ("[train]\nbatch_size = -8\n", "[train] batch_size"),
    ("[train]\noptimizer = 'rmsprop'\n", "[train] optimizer"),
    ("[train]\nmomentum = 5.0\n", "[train] momentum"),
    ("[train]\nmomentum = -0.1\n", "[train] momentum"),
    ("[train]\nweight_decay = -1.0\n", "[train] weight_decay"),
    ("[train]\nsample_weighted = 1\n", "[train] sample_weighted"),
    ("[train]\ngrad_clip = -1.0\n", "[train] grad_clip"),
    # [aggregation], [privacy]
    ("[aggregation]\nrule = 'mode'\n", "[aggregation] rule"),
    ("[aggregation]\nscreen_factor = -1.0\n", "[aggregation] screen_factor"),
    ("[aggregation]\ntrim_fraction = 0.5\n", "[aggregation] trim_fraction"),
    ("[aggregation]\nkrum_byzantine = -1\n", "[aggregation] krum_byzantine"),
    ("[aggregation]\nkrum_select = -2\n", "[aggregation] krum_select"),
    ("[privacy]\nepsilon = -1.0\n", "[privacy] epsilon"),
    ("[privacy]\ndelta = 0.0\n", "[privacy] delta"),
    ("[privacy]\ndelta = 1.5\n", "[privacy] delta"),
    ("[privacy]\nclip = -1.0\n", "[privacy] clip"),
    # [methods.*]
    ("[methods.local]\nbase = 'fedavg'\n", "[methods.local] base"),
    ("[methods.mine]\nbase = 'nonexistent'\n", "[methods.mine] base"),
    ("[methods.mine]\nbase = 3\n", "[methods.mine] base"),
    ("[methods.mine]\nbase = 'fedgmi_joint'\n", "[methods.mine] base"),
    ("[methods.mine]\nlr = 0.1\n", "[methods.mine] name"),
    ("[methods.fedgmi]\nnope = 1\n", "[methods.fedgmi] nope"),
    ("[methods.fedgmi]\nfinetune_steps = -1\n", "[methods.fedgmi] finetune_steps"),
    ("[methods.fedgmi]\nfinetune_steps = 1.5\n", "[methods.fedgmi] finetune_steps"),
    ("[methods.fedgmi]\nfinetune_lr = nan\n", "[methods.fedgmi] finetune_lr"),
    ("[methods.fedgmi]\nmagnitude = 3\n", "[methods.fedgmi] magnitude"),
    ("[methods.fedavg]\nlr = -0.1\n", "[methods.fedavg] lr"),
    ("[methods.fedavg]\nbatch_size = 0\n", "[methods.fedavg] batch_size"),
    ("[methods.fedavg]\nmomentum = 5.0\n", "[methods.fedavg] momentum"),
    ("[methods.fedpoly_p3]\nprivate_terms = 'all'\n", "[methods.fedpoly_p3] private_terms"),
    ("[methods.fedprior]\nselect = 'aic'\n", "[methods.fedprior] select"),
    ("[methods.fedprior_fixed]\nnoise = 'unit'\n", "[methods.fedprior_fixed] noise"),
    # a method's own ranges (its __post_init__), for every table: none of these runs here
    ("[methods.aflcsem]\ncost_weight = 1.5\n", "[methods.aflcsem] cost_weight"),
    ("[methods.fedala]\nrand_percent = 500\n", "[methods.fedala] rand_percent"),
    ("[methods.ifca]\nclusters = 0\n", "[methods.ifca] clusters"),
    ("[methods.layerchoice]\nholdout_every = 1\n", "[methods.layerchoice] holdout_every"),
    ("[methods.polynomial]\nlevel_gap = 1.5\n", "[methods.polynomial] level_gap"),
    ("[methods.fedgen]\nnum_bins = 0\n", "[methods.fedgen] num_bins"),
    # a proximal weight that pins the model to its anchor (fedcal.core.local)
    ("[methods.fedprox]\nmu = 1e9\n", "[methods.fedprox] mu"),
    ("[methods.ditto]\nlam = 1e9\n", "[methods.ditto] lam"),
    ("[methods.pfedme]\nlam = 1e9\n", "[methods.pfedme] lam"),
    ("[methods.prox2]\nbase = 'fedprox'\nmu = 2000.0\n", "[methods.prox2] mu"),
    ("[methods.mine]\nbase = 'leastsq'\nridge = 0.0\n", "[methods.mine] ridge"),
    (  # each value alone is fine, together they are not
        "[methods.fedpoly]\nmax_orders = [2, 3]\nprivate_terms = [[3, 0]]\n",
        "[methods.fedpoly] max_orders, private_terms",
    ),
    ("methods = 3\n", "[methods]"),
    ("[methods]\nfedavg = 3\n", "[methods.fedavg]"),
    # the file's shape
    ("[bogus]\n", "[bogus]"),
    ("rounds = 3\n", "[rounds]"),
    ("engine = 3\n", "[engine]"),
    ("[engine\n", "not valid TOML"),
    # found while building the run (data, model, policy): still the file and the field
    ("[privacy]\nepsilon = 1.0\n", "[privacy] clip"),
    ("[model]\nfamily = 'basis'\npoly_orders = [3]\n", "[model] poly_orders"),
    ("[model]\nfamily = 'classifier'\n", "[model] family"),
    ("[methods.fedgmi]\nmagnitude = 'bogus'\n", "[methods.fedgmi]"),
    ("[data]\npath = 'builtin:humidity'\nscaling = 'physical'\n", "[data] scaling"),
    ("[run]\nmethods = ['fedlsa']\n", "[run] methods"),
    ("[aggregation]\nscreen_factor = 0.5\n", "[aggregation] screen_factor"),
    ("[aggregation]\nclip_factor = 0.5\n", "[aggregation] clip_factor"),
    ("[aggregation]\nrule = 'krum'\nkrum_byzantine = 15\n", "[aggregation] krum_byzantine"),
    ("[aggregation]\nrule = 'krum'\nkrum_select = 50\n", "[aggregation] krum_select"),
    ("[engine]\nparticipation = 0.01\n", "[engine] participation"),
    ("[fleet]\nnum_lots = 50\n", "[fleet] num_lots"),
]


def _run(tmp_path, text: str | bytes):
    path = tmp_path / "bad.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    out = tmp_path / "out"
    # the default methods (fedgmi, fedavg, local) are built: their parameters are checked
    args = ["run", "--config", str(path), "--out", str(out), "--quiet"]
    return runner.invoke(app, args), out


def test_the_corpus_is_large_enough():
    assert len(HOSTILE) >= 70 and len({t for t, _ in HOSTILE}) == len(HOSTILE)


@pytest.mark.parametrize("text,names", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_config_is_one_line_naming_file_section_and_field(tmp_path, text, names):
    result, out = _run(tmp_path, text)
    message = result.output.strip()
    assert result.exit_code == 2, (result.exit_code, message, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), result.exception
    assert "Traceback" not in message and len(message.splitlines()) == 1, message
    assert message.startswith("error: ") and "bad.toml" in message, message
    assert names in message, message
    assert not out.exists()


@pytest.mark.parametrize(
    "content,needle", [(b"\xff\xfe\x00garbage", "not a text"), (b"", None)], ids=["binary", "empty"]
)
def test_a_binary_file_is_refused_and_an_empty_one_is_the_default(tmp_path, content, needle):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    if needle is None:
        assert load_config(path) == default_config()
        return
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


def test_a_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_command_line_values_go_through_the_schema(tmp_path):
    cfg = default_config()
    with pytest.raises(ConfigError, match=r"--rounds \[engine\] rounds: must be >= 1, got 0"):
        override(cfg, {"engine": {"rounds": 0}}, "--rounds")
    # a fixed choice is refused by the option itself, naming the allowed values (issue 37.5)
    result = runner.invoke(app, ["run", "--aggregation", "mode", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "'mode' is not one of 'mean', 'median'" in result.output
    with pytest.raises(ConfigError, match=r"--aggregation \[aggregation\] rule"):
        override(cfg, {"aggregation": {"rule": "mode"}}, "--aggregation")
    result = runner.invoke(app, ["compare", "--seeds", "0", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--seeds [run] seeds: must be >= 1" in result.output


# ----------------------------------------------------------------------------
# accepted values are the values used
# ----------------------------------------------------------------------------
def test_physical_bounds_reach_the_loader(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        "[data.physical_bounds]\ntemperature_c = [-50.0, inf]\npressure_hpa = [0, 2000]\n"
    )
    cfg = load_config(path)
    assert cfg.data.physical_bounds == {
        "temperature_c": (-50.0, float("inf")),
        "pressure_hpa": (0.0, 2000.0),
    }
    assert cfg.data.loader_bounds() == {
        "temperature_c": (-50.0, None),
        "pressure_hpa": (0.0, 2000.0),
    }


def test_physical_bounds_refuse_rows_of_a_file(tmp_path):
    """A bound set in the TOML is the loader's: a reading beyond it stops the run, naming it."""
    from fedcal.data.loader import save_fleet
    from fedcal.data.simulator import FleetSpec, simulate_fleet

    data = tmp_path / "fleet.csv"
    save_fleet(simulate_fleet(FleetSpec(num_sensors=3), seed=0), data)
    cfg = tmp_path / "c.toml"
    cfg.write_text("[data.physical_bounds]\ntemperature_c = [0.0, 100.0]\n")
    args = ["run", "--data", str(data), "--config", str(cfg), "--out", str(tmp_path / "o")]
    result = runner.invoke(app, [*args, "--quiet"])
    assert result.exit_code == 2 and "temperature_c" in result.output
    assert not (tmp_path / "o").exists()


def test_the_round_trip_is_exact_for_every_shipped_config():
    from fedcal.config import SHIPPED

    for name in (None, *SHIPPED):
        cfg = load_config(name)
        back = from_json(to_json(cfg))
        assert back == cfg and back.recipe_overrides() == cfg.recipe_overrides(), name
        assert json.loads(to_json(back)) == to_layout(cfg), name


def test_a_user_recipe_value_equal_to_the_shipped_one_still_wins(tmp_path):
    """FedLSA's own lr is 0.01; a user who writes [train] lr = <the shipped 0.1> gets 0.1."""
    shipped_lr = shipped_recipe().lr
    path = tmp_path / "c.toml"
    path.write_text(f"[train]\nlr = {shipped_lr}\n")
    cfg = load_config(path)
    assert method_values("fedlsa", cfg)["lr"] == shipped_lr
    assert method_values("fedlsa", default_config())["lr"] == FedLSA.lr == 0.01
    back = from_json(to_json(cfg))  # the choice survives the round trip (Flower, run dirs)
    assert method_values("fedlsa", back)["lr"] == shipped_lr


def test_an_algorithms_own_defaults_win_unless_the_user_sets_them(tmp_path):
    cfg = default_config()
    recipe = shipped_recipe()
    assert recipe.sample_weighted is False and Clustered.sample_weighted is True
    # clustered.py (patent S43): sample-weighted; the shipped recipe does not override it
    assert method_values("clustered", cfg)["sample_weighted"] is True
    # FedLSA's own recipe (its paper's): lr, momentum, batch size
    fedlsa = method_values("fedlsa", cfg)
    assert (fedlsa["lr"], fedlsa["momentum"], fedlsa["batch_size"]) == (0.01, 0.9, 64)
    proto = method_values("fedproto", cfg)
    assert (proto["lr"], proto["momentum"], proto["batch_size"]) == (0.01, 0.9, 64)
    # a method without its own recipe takes the shipped one
    assert method_values("fedavg", cfg)["lr"] == recipe.lr
    assert method_values("fedavg", cfg)["batch_size"] == recipe.batch_size
    # the user's [train] beats the method's own; [methods.<name>] beats both
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsample_weighted = false\nlr = 0.2\n[methods.fedlsa]\nlr = 0.03\n")
    user = load_config(path)
    assert method_values("clustered", user)["sample_weighted"] is False
    assert method_values("fedproto", user)["lr"] == 0.2
    assert method_values("fedlsa", user)["lr"] == 0.03
    cls, values = method_settings("clustered", cfg)
    assert cls is Clustered and "sample_weighted" not in values


def test_the_run_record_shows_the_values_used():
    cfg = default_config()
    record = run_record(cfg, ["clustered", "fedavg", "fedgmi_joint"], [0])
    used = record["resolved"]["methods"]
    assert used["clustered"]["sample_weighted"] is True
    assert used["fedavg"]["lr"] == shipped_recipe().lr
    assert used["fedgmi_joint"]["normalize"] == "joint"
    assert used["fedgmi_joint"]["finetune_steps"] == cfg.method_params["fedgmi"]["finetune_steps"]
    assert from_json(json.dumps(record)) == dataclasses.replace(
        cfg, methods=("clustered", "fedavg", "fedgmi_joint")
    )


def test_fedcal_methods_lists_the_values_a_run_uses():
    result = runner.invoke(app, ["methods"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert "sample_weighted=True" in rows["clustered"]
    assert "lr=0.01" in rows["fedlsa"] and "batch_size=64" in rows["fedlsa"]
    assert "lr=" not in rows["fedavg"]  # the shared recipe, printed once above the table


def test_a_run_directory_records_and_rebuilds_the_values_used(tmp_path):
    """config.json's resolved values are what the saved model is rebuilt with by the exports."""
    from fedcal.report.export import load_models

    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[fleet]\nnum_sensors = 3\n[engine]\nrounds = 1\n[train]\nlocal_epochs = 1\n"
        "[run]\nmethods = ['clustered']\nseeds = 1\n"
    )
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", "--config", str(cfg), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    record = json.loads((out / "config.json").read_text())
    assert record["resolved"]["methods"]["clustered"]["sample_weighted"] is True
    assert record["train"] == {"local_epochs": 1}
    fleet = load_models(out, "clustered", 0, 0)
    assert fleet.algorithm.sample_weighted is True and fleet.algorithm.local_epochs == 1
    # a default that changed since the run: the recorded value is used
    record["resolved"]["methods"]["clustered"]["num_groups"] = 3
    (out / "config.json").write_text(json.dumps(record))
    assert load_models(out, "clustered", 0, 0).algorithm.num_groups == 3


# ----------------------------------------------------------------------------
# one definition each: the schema's sections against the classes they fill
# ----------------------------------------------------------------------------
def test_each_group_of_settings_has_one_definition():
    """[fleet] is the simulator's FleetSpec plus the seed; [engine] the engine's settings plus
    the checkpoint interval; [train] the algorithms' Recipe; [aggregation] the policy's rules.
    Each refuses a bad value in one line when built from Python too, and so does an algorithm
    (its recipe's ranges, its proximal weight)."""
    from fedcal.algorithms.ditto import Ditto
    from fedcal.algorithms.fedavg import FedAvg
    from fedcal.algorithms.fedprox import FedProx
    from fedcal.algorithms.pfedme import PFedMe
    from fedcal.build import engine_settings
    from fedcal.config import SECTIONS, EngineSection, FleetConfig, TrainConfig
    from fedcal.core.aggregation import AggregationPolicy, AggregationRules
    from fedcal.core.algorithm import Algorithm, Recipe
    from fedcal.data.simulator import FleetSpec
    from fedcal.engine.settings import EngineSettings
    from fedcal.engine.simulation import EngineConfig

    names = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    # [train] is the contract's Recipe; Algorithm's recipe fields are made from it
    assert TrainConfig is Recipe and names(Algorithm) == ["task", *names(Recipe)]
    shipped = {f.name: f.default for f in dataclasses.fields(Algorithm) if f.name != "task"}
    assert shipped == dataclasses.asdict(Recipe())
    hints = typing.get_type_hints(Algorithm)
    assert {n: hints[n] for n in names(Recipe)} == typing.get_type_hints(Recipe)
    # [aggregation] is the server's rules; the engine's policy is those rules plus DP
    assert SECTIONS["aggregation"] is AggregationRules and issubclass(
        AggregationPolicy, AggregationRules
    )
    dp = ["dp_noise_multiplier", "dp_clip", "dp_quantile", "dp_quantile_steps", "dp_quantile_rate"]
    tail = ["dp_count_multiplier", "dp_noise_secret"]
    assert names(AggregationPolicy) == [*names(AggregationRules), *dp, *tail]
    assert issubclass(FleetConfig, FleetSpec) and names(FleetConfig) == [*names(FleetSpec), "seed"]
    assert issubclass(EngineSection, EngineSettings) and issubclass(EngineConfig, EngineSettings)
    assert names(EngineSection) == [*names(EngineSettings), "checkpoint_every"]
    cfg = default_config()
    engine = EngineConfig(**engine_settings(cfg), seed=0)
    assert (engine.rounds, engine.participation, engine.dtype) == (50, 1.0, "float32")
    assert cfg.fleet.spec() == FleetSpec(**{k: getattr(cfg.fleet, k) for k in names(FleetSpec)})
    for make, text in [
        (lambda: FleetSpec(num_lots=0), "FleetSpec num_lots: must be >= 1, got 0"),
        (lambda: FleetSpec(heterogeneity="1"), "FleetSpec heterogeneity: expected a finite"),
        (lambda: FleetSpec(train_design="3y2"), "FleetSpec train_design: '3y2' is not"),
        (lambda: EngineConfig(rounds=0), "EngineConfig rounds: must be >= 1, got 0"),
        (lambda: EngineConfig(participation=float("nan")), "EngineConfig participation: "),
        (lambda: EngineConfig(seed=-1), "EngineConfig seed: must be >= 0, got -1"),
        (lambda: EngineSection(checkpoint_every=0), "EngineSection checkpoint_every: must be"),
        (lambda: AggregationPolicy(trim_fraction=0.5), "AggregationPolicy trim_fraction: must"),
        (lambda: AggregationPolicy(rule="mode"), "AggregationPolicy rule: must be one of"),
        (lambda: AggregationPolicy(dp_noise_multiplier=1.0), "AggregationPolicy privacy: a noise"),
        (lambda: Recipe(lr=0.0), "Recipe lr: must be > 0"),
        (lambda: FedAvg(task=None, lr=-1.0), "fedavg lr: must be > 0.0, got -1.0"),
        (lambda: FedAvg(task=None, batch_size=0), "fedavg batch_size: must be >= 1, got 0"),
        (lambda: FedAvg(task=None, momentum=1.0), "fedavg momentum: must be < 1"),
        (lambda: FedProx(task=None, mu=1e9), "fedprox mu: must be <= 1000.0, got 1000000000.0"),
        (lambda: Ditto(task=None, lam=float("nan")), "ditto lam: must be <= 1000.0, got nan"),
        (lambda: PFedMe(task=None, lam=-1.0), "pfedme lam: must be >= 0.0, got -1.0"),
        (lambda: PFedMe(task=None, lam=1e7), "pfedme lam: must be <= 1000000.0, got 10000000.0"),
    ]:
        with pytest.raises(ValueError) as err:
            make()
        assert str(err.value).startswith(text) and "\n" not in str(err.value)


def test_nothing_below_the_experiment_imports_it():
    """config, build, engine (simulation and Flower), data, models, core, algorithms."""
    import ast
    from pathlib import Path

    import fedcal

    root = Path(fedcal.__file__).parent
    below = []
    for package in ("config", "build", "engine", "data", "models", "core", "algorithms"):
        below += sorted((root / package).rglob("*.py"))
    for path in below:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "fedcal.experiment", path
                assert not (
                    node.module == "fedcal" and any(a.name == "experiment" for a in node.names)
                ), path
            if isinstance(node, ast.Import):
                assert all(a.name != "fedcal.experiment" for a in node.names), path


def test_a_run_directory_of_an_older_fedcal_reads_back():
    """config.json before the layout: top-level methods list and method_params."""
    old = {
        "methods": ["fedavg", "fedgmi_joint"],
        "seeds": 2,
        "designs": [],
        "fleet_seeds": [],
        "engine": {"rounds": 7},
        "train": {"lr": 0.2},
        "method_params": {"fedgmi_joint": {"base": "fedgmi", "normalize": "joint"}},
        "train_points_sweep": [0],
        "data_sha256": "x",
    }
    cfg = from_json(json.dumps(old), "config.json")
    assert cfg.methods == ("fedavg", "fedgmi_joint") and cfg.seeds == 2
    assert cfg.engine.rounds == 7 and cfg.train.lr == 0.2
    assert cfg.method_params["fedgmi_joint"]["normalize"] == "joint"

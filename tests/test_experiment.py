"""Run directories: contents, resume with identical numbers, refusal to mix configurations."""

import json
from dataclasses import replace

import pandas as pd
import pytest

from fedcal.config import ConfigError, default_config
from fedcal.core.tensorfile import load_trees
from fedcal.experiment import RunDirectoryError, build_algorithm, build_task, run_experiment
from fedcal.report.export import load_models
from fedcal.report.tables import aggregate


def small_config(rounds=3, seeds=2):
    cfg = default_config()
    return replace(
        cfg,
        seeds=seeds,
        engine=replace(cfg.engine, rounds=rounds, checkpoint_every=1),
        model=replace(cfg.model, hidden=(8, 8)),
        train=replace(cfg.train, local_epochs=1),
        unconverged_tol=1.0,  # 3 rounds are unconverged by design (tests/test_status.py)
    )


def test_run_directory_contents(tmp_path, make_fleet):
    fleet = make_fleet(num_clients=3)
    summary = run_experiment(small_config(), fleet, tmp_path, ["fedgmi", "local"])
    assert list(summary.columns[:12]) == [
        "method",
        "seed",
        "train_points",
        "rmse_mean",
        "rmse_worst",
        "mae_mean",
        "max_abs_worst",
        "rmse_mean_pct_fs",
        "max_abs_worst_pct_fs",
        "wall_s",
        "bytes_up_per_round",
        "bytes_down_per_round",
    ]
    assert len(summary) == 4
    on_disk = pd.read_csv(tmp_path / "summary.csv")
    assert (
        on_disk[["method", "seed"]].values.tolist() == summary[["method", "seed"]].values.tolist()
    )
    run = tmp_path / "runs" / "fedgmi_tp0_seed1"
    per_sensor = pd.read_csv(run / "per_sensor.csv")
    assert len(per_sensor) == 3 and per_sensor["test_rmse"].mean() == pytest.approx(
        summary.query("method == 'fedgmi' and seed == 1")["rmse_mean"].item()
    )
    metrics = pd.read_csv(run / "metrics.csv")
    assert sorted(metrics["round"].unique()) == [1, 2, 3]
    trees, meta, _ = load_trees(run / "model.safetensors")
    assert meta["client_ids"] == ["S00", "S01", "S02"]
    assert trees["params"]["l0.weight"].shape[0] == 3  # (clients, out, in)
    assert not (run / "checkpoint.safetensors").exists()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["engine"]["rounds"] == 3
    # local uploads nothing; FedGMI uploads the whole model each round
    local = summary.query("method == 'local'")
    assert (local["bytes_up_per_round"] == 0).all()
    table = aggregate(summary)
    assert table["method"].tolist() == ["fedgmi", "local"] and (table["seeds"] == 2).all()


def test_rerun_resumes_and_refuses_other_configs(tmp_path, make_fleet):
    fleet = make_fleet(num_clients=3)
    first = run_experiment(small_config(), fleet, tmp_path, ["fedgmi"])
    # Remove one finished run: it is redone, the others are read back.
    (tmp_path / "runs" / "fedgmi_tp0_seed0" / "done.json").unlink()
    again = run_experiment(small_config(), fleet, tmp_path, ["fedgmi"])
    cols = ["rmse_mean", "rmse_worst", "mae_mean"]
    assert again[cols].values.tolist() == first[cols].values.tolist()
    # where and on how many threads a run computes does not change its numbers: read back
    (tmp_path / "runs" / "fedgmi_tp0_seed0" / "done.json").unlink()
    cfg = small_config()
    other = replace(cfg, engine=replace(cfg.engine, workers=3, chunk_size=2))
    again = run_experiment(other, fleet, tmp_path, ["fedgmi"])
    assert again[cols].values.tolist() == first[cols].values.tolist()
    with pytest.raises(ConfigError, match="another configuration"):
        run_experiment(small_config(rounds=4), fleet, tmp_path, ["fedgmi"])
    assert (
        pd.read_csv(tmp_path / "summary.csv")[cols].values.tolist() == first[cols].values.tolist()
    )


def test_unknown_method_parameter_is_refused():
    cfg = small_config()
    cfg = replace(cfg, method_params={"fedgmi": {"nope": 1}})
    task = build_task(cfg, 2)
    with pytest.raises(ConfigError, match=r"\[methods.fedgmi\]: unknown parameter\(s\) nope"):
        build_algorithm("fedgmi", cfg, task)


def test_config_variants_run_under_their_own_name():
    cfg = small_config()
    alg = build_algorithm("fedgmi_joint", cfg, build_task(cfg, 2))
    assert alg.name == "fedgmi" and alg.normalize == "joint"
    assert alg.finetune_steps == cfg.method_params["fedgmi"]["finetune_steps"]
    from fedcal.experiment import check_methods

    names = check_methods(["all"], cfg)
    assert {"fedgmi_joint", "fedgmi_body", "fedgmi", "polynomial"} <= set(names)
    with pytest.raises(ConfigError, match="unknown method"):
        check_methods(["fedgmi_nope"], cfg)


def test_all_runs_fedgmi_posterior_once_not_also_as_fedgmi_bayes():
    """``all`` runs the Bayesian head once, as its documented variant fedgmi_posterior
    (fedgmi_bayes is the class that variant builds); both names stay usable by name, and
    no class that a variant of another method selects appears under its registered name."""
    from fedcal.algorithms import REGISTRY
    from fedcal.build import method_settings
    from fedcal.config import default_config
    from fedcal.experiment import check_methods

    cfg = default_config()
    names = check_methods(["all"], cfg)
    assert "fedgmi_bayes" not in names and len(names) == len(set(names))
    assert {"fedgmi", "fedgmi_posterior", "fedgmi_posterior_frozen", "fedprior"} <= set(names)
    assert {"fedprior_fixed", "fedprior_branch"} <= set(names)  # same class as fedprior: kept
    classes = {n: method_settings(n, cfg)[0] for n in names}
    assert classes["fedgmi_posterior"] is REGISTRY["fedgmi_bayes"]
    registered = [n for n in names if n in REGISTRY]
    variants = [n for n in names if n not in REGISTRY]
    for n in registered:  # none is built, under another name, by a class-switching variant
        switched = [
            v
            for v in variants
            if classes[v] is REGISTRY[n]
            and REGISTRY[cfg.method_params[v]["base"]] is not classes[v]
        ]
        assert not switched, (n, switched)
    assert check_methods(["fedgmi_bayes", "fedgmi_posterior"], cfg) == [
        "fedgmi_bayes",
        "fedgmi_posterior",
    ]


def test_whitened_basis_is_built_from_the_fleet_and_runs(tmp_path, make_fleet):
    from fedcal.config import load_config
    from fedcal.models.basis import Basis

    cfg = replace(
        load_config("physics"),
        seeds=1,
        engine=replace(small_config().engine, rounds=2),
        unconverged_tol=1.0,  # 2 rounds: unconverged by design, not what this test is about
    )
    summary = run_experiment(cfg, make_fleet(num_clients=3), tmp_path, ["local"])
    assert summary["rmse_mean"].notna().all()
    _, meta, _ = load_trees(tmp_path / "runs" / "local_tp0_seed0" / "model.safetensors")
    assert meta["whitening"]["poly_transform"]
    # The model is rebuilt from config + stored moments, equal to the one trained.
    fleet_models = load_models(tmp_path, "local")
    assert isinstance(fleet_models.algorithm.task.model, Basis)
    assert repr(fleet_models.algorithm.task.model) == meta["model_repr"]
    with pytest.raises(ConfigError, match="needs the fleet's training inputs"):
        build_task(cfg, 2)


def test_changed_data_at_the_same_path_is_refused(tmp_path, make_fleet):
    fleet = make_fleet(num_clients=3)
    run_experiment(small_config(rounds=1, seeds=1), fleet, tmp_path, ["local"])
    frame = fleet.frame.copy()
    frame.loc[0, "pressure_hpa"] += 0.5  # one reading differs, everything else equal
    changed = replace(fleet, frame=frame)
    before = (tmp_path / "summary.csv").read_bytes()
    with pytest.raises(RunDirectoryError, match=r"data changed since this run started.*remove"):
        run_experiment(small_config(rounds=1, seeds=1), changed, tmp_path, ["local"])
    assert (tmp_path / "summary.csv").read_bytes() == before
    # the same data again is still read back
    run_experiment(small_config(rounds=1, seeds=1), fleet, tmp_path, ["local"])


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_in_a_run_directory_is_a_clear_error(tmp_path, make_fleet, damage):
    fleet = make_fleet(num_clients=3)
    cfg = small_config(rounds=2, seeds=1)
    run_experiment(cfg, fleet, tmp_path, ["local"])
    run = tmp_path / "runs" / "local_tp0_seed0"
    # Simulate a run killed after its first checkpoint: no done.json, a checkpoint left.
    from fedcal.engine.simulation import EngineConfig, prepare, simulate

    algorithm = build_algorithm("local", cfg, build_task(cfg, 2))
    tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
    ckpt = run / "checkpoint.safetensors"
    simulate(algorithm, tensors, EngineConfig(rounds=1, dtype=cfg.engine.dtype), checkpoint=ckpt)
    (run / "done.json").unlink()
    data = bytearray(ckpt.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 7]
    else:
        data[len(data) // 2] ^= 0x10
    ckpt.write_bytes(bytes(data))
    with pytest.raises(
        RunDirectoryError, match=r"checkpoint .*: remove .* or choose another --out"
    ):
        run_experiment(cfg, fleet, tmp_path, ["local"])


def _planted_pickle(path, marker):
    """A pickle whose loading would create ``marker`` (what a malicious model.pt does)."""
    import pickle

    class Plant:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path.write_bytes(pickle.dumps({"params": Plant()}))


def test_planted_pickle_model_or_checkpoint_never_runs(tmp_path, make_fleet):
    fleet = make_fleet(num_clients=3)
    cfg = small_config(rounds=2, seeds=1)
    run_experiment(cfg, fleet, tmp_path, ["local"])
    run = tmp_path / "runs" / "local_tp0_seed0"
    marker = tmp_path / "pwned"
    for name in ("model.safetensors", "model.pt"):
        if name == "model.pt":
            (run / "model.safetensors").unlink()
        _planted_pickle(run / name, marker)
        with pytest.raises(ValueError, match=str(run / name)):
            load_models(tmp_path, "local")
        assert not marker.exists()
    (run / "done.json").unlink()
    _planted_pickle(run / "checkpoint.safetensors", marker)
    with pytest.raises(RunDirectoryError, match="not a fedcal tensor file"):
        run_experiment(cfg, fleet, tmp_path, ["local"])
    assert not marker.exists()


@pytest.mark.parametrize("name", ["done.json", "config.json"])
def test_corrupt_run_files_are_one_line_errors(tmp_path, make_fleet, name):
    fleet = make_fleet(num_clients=3)
    cfg = small_config(rounds=1, seeds=1)
    run_experiment(cfg, fleet, tmp_path, ["local"])
    path = (
        tmp_path / name if name == "config.json" else tmp_path / "runs" / "local_tp0_seed0" / name
    )
    path.write_text(path.read_text()[:25])  # cut mid-JSON, as a full disk might
    with pytest.raises(RunDirectoryError, match=rf"{name} is .*corrupt.*another --out") as err:
        run_experiment(cfg, fleet, tmp_path, ["local"])
    assert "\n" not in str(err.value)


def test_a_classification_fleet_may_use_any_model_family():
    """With the gradient trap closed in core (tests/core/test_task.py) an MLP classifies on
    cross-entropy; methods that need the classifier's embedding say so in one line."""
    from fedcal.config import load_config
    from fedcal.core.classification import ClassificationTask
    from fedcal.models.mlp import MLP

    digits = load_config("digits")
    cfg = replace(digits, model=replace(digits.model, family="mlp", hidden=(8,)))
    task = build_task(cfg, 64, {"task": "classification", "num_classes": 10})
    assert isinstance(task, ClassificationTask) and isinstance(task.model, MLP)
    assert task.model.out_features == 10 and task.hand_gradient is None
    build_algorithm("fedavg", cfg, task)
    with pytest.raises(ConfigError, match=r"\[methods.fedlsa\]: fedlsa needs the hypersphere"):
        build_algorithm("fedlsa", cfg, task)

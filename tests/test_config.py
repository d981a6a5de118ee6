import pytest

from fedcal.config import ConfigError, default_config, load_config


def test_default_is_the_seed_protocol():
    cfg = default_config()
    assert cfg.engine.rounds == 50 and cfg.train.local_epochs == 5 and cfg.fleet.num_sensors == 20
    assert cfg.methods == ("fedgmi", "fedavg", "local") and cfg.train.optimizer == "sgd"
    assert cfg.method_params["fedgmi"]["finetune_steps"] == 1


def test_user_file_overrides_only_what_it_sets(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[engine]\nrounds = 3\n[methods.fedgmi]\nmagnitude = "tensor"\n[run]\nseeds = 2\n')
    cfg = load_config(p)
    assert cfg.engine.rounds == 3 and cfg.engine.dtype == "float32" and cfg.seeds == 2
    assert cfg.method_params["fedgmi"] == {
        **default_config().method_params["fedgmi"],
        "magnitude": "tensor",
    }


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[engine]\nround = 3\n", "[engine] round: unknown field"),
        ("[engine]\nrounds = 'x'\n", "[engine] rounds: expected an integer, got 'x'"),
        ("[engine]\nrounds = 2.5\n", "[engine] rounds: expected an integer, got 2.5"),
        ("[bogus]\n", "[bogus]: unknown section(s) bogus"),
        ("[engine\n", "not valid TOML"),
    ],
)
def test_bad_files_name_the_file_and_field(tmp_path, text, needle):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert needle in str(err.value) and "bad.toml" in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.toml")


def test_config_json_round_trip():
    from dataclasses import replace

    from fedcal.config import ModelConfig, from_json, to_json

    base = default_config()
    params = {"fedgmi": {"finetune_steps": 3}, "ditto": {"lam": 0.5}}
    cfg = replace(base, method_params=params)
    assert from_json(to_json(cfg)) == cfg
    partial = from_json('{"train": {"lr": 0.2}}')  # over the shipped default
    assert partial.train.lr == 0.2 and partial.model == ModelConfig()


def test_the_shipped_recipe_is_the_default_configurations_train_table():
    """shipped_recipe reads default.toml's [train] on its own (config/files.py, below the
    run's value that compares with it); it is the recipe the whole default file gives."""
    from fedcal.config import shipped_recipe

    assert shipped_recipe() == default_config().train
    assert default_config().recipe_overrides() == frozenset()

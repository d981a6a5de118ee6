"""The optional keyed MAC of a run folder (issue 36.3, core/mac.py): written by run and
calibrate given a key, checked by predict/export/calibrate --prior given one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.core.mac import KEY_ENV, MAC_FILE, check_mac, covered_files, write_mac
from fedcal.data.simulator import FleetSpec, simulate_fleet

runner = CliRunner(env={"COLUMNS": "1000"})
PRIOR = "runs/fedprior_tp0_seed0"


def _refused(result, names: str) -> None:
    """Exit 2 with one line ``error: …`` naming ``names``."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], lines


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    """``run/`` (fedprior, signed with ``key``), ``fleet.csv``, ``readings.csv``, the keys."""
    root = tmp_path_factory.mktemp("mac")
    fleet = simulate_fleet(FleetSpec(num_sensors=4), seed=3)
    fleet.frame.to_csv(root / "fleet.csv", index=False)
    cols = ["sensor_id", "frequency_hz", "temperature_c"]
    fleet.frame.query("split == 'test'")[cols].to_csv(root / "readings.csv", index=False)
    (root / "key").write_text("a site's secret key, 32+ bytes long\n")
    (root / "other").write_text("another site's secret key, 32+ bytes\n")
    (root / "c.toml").write_text("[engine]\nrounds = 2\n")
    args = ["run", "--data", str(root / "fleet.csv"), "--methods", "fedprior", "--seeds", "1"]
    args += ["--config", str(root / "c.toml"), "--out", str(root / "run"), "--quiet"]
    result = runner.invoke(app, [*args, "--key-file", str(root / "key")])
    assert result.exit_code == 0, result.output
    return root


def _copy(signed: Path, tmp_path: Path) -> Path:
    shutil.copytree(signed / "run", tmp_path / "run")
    return tmp_path / "run"


def _predict(signed: Path, run: Path, out: Path, *key: str):
    args = ["predict", str(run), "--data", str(signed / "readings.csv"), "--out", str(out)]
    return runner.invoke(app, [*args, *key])


def test_a_signed_run_covers_every_file_and_serves_with_its_key(signed, tmp_path) -> None:
    run = signed / "run"
    doc = json.loads((run / MAC_FILE).read_text())
    assert sorted(doc["files"]) == covered_files(run, everything=True)
    assert {"config.json", "summary.csv", f"{PRIOR}/model.safetensors", f"{PRIOR}/prior.json"}
    assert len(doc["mac"]) == 64  # HMAC-SHA256, hex
    result = _predict(signed, run, tmp_path / "a.csv", "--key-file", str(signed / "key"))
    assert result.exit_code == 0, result.output
    # without a key nothing is checked (the MAC is optional)
    assert _predict(signed, run, tmp_path / "b.csv").exit_code == 0


def test_a_wrong_key_or_an_unsigned_folder_is_refused(signed, tmp_path) -> None:
    run = signed / "run"
    result = _predict(signed, run, tmp_path / "a.csv", "--key-file", str(signed / "other"))
    _refused(result, f"{MAC_FILE}: wrong MAC")
    unsigned = _copy(signed, tmp_path)
    (unsigned / MAC_FILE).unlink()
    result = _predict(signed, unsigned, tmp_path / "b.csv", "--key-file", str(signed / "key"))
    _refused(result, f"{MAC_FILE}: missing")
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "b.csv").exists()


def test_an_edited_file_is_named_even_with_its_checksum_recomputed(signed, tmp_path) -> None:
    """The model file's own SHA-256 is recomputed by any editor; the MAC is not."""
    from fedcal.core.tensorfile import load_trees, save_trees

    run = _copy(signed, tmp_path)
    model = run / PRIOR / "model.safetensors"
    trees, meta, blobs = load_trees(model)
    trees["params"]["coef"] = trees["params"]["coef"] * 1.01  # plausible, but not the run's
    save_trees(model, trees, meta, blobs)
    result = _predict(signed, run, tmp_path / "a.csv", "--key-file", str(signed / "key"))
    _refused(result, f"{model}: MAC mismatch")
    result = runner.invoke(
        app, ["export", str(run), "--format", "json", "--key-file", str(signed / "key")]
    )
    _refused(result, f"{model}: MAC mismatch")


@pytest.mark.parametrize("text", ["[1, 2]", "5", '"mac"', "null", "{}", '{"format": 1}'])
def test_a_mac_file_of_other_json_is_refused_in_one_line(signed, tmp_path, text) -> None:
    """JSON that is no MAC object (a list, a number, …) is refused, not an AttributeError."""
    run = _copy(signed, tmp_path)
    (run / MAC_FILE).write_text(text)
    key = ["--key-file", str(signed / "key")]
    _refused(_predict(signed, run, tmp_path / "a.csv", *key), f"{MAC_FILE}: not a fedcal MAC")
    result = runner.invoke(app, ["export", str(run), "--format", "json", *key])
    _refused(result, f"{MAC_FILE}: not a fedcal MAC")
    assert not (tmp_path / "a.csv").exists()


def test_calibrate_checks_the_prior_and_signs_its_output(signed, tmp_path, monkeypatch) -> None:
    run = _copy(signed, tmp_path)
    prior = run / PRIOR / "prior.json"
    doc = json.loads(prior.read_text())
    doc["noise_var"] *= 2.0  # still a valid prior.json
    prior.write_text(json.dumps(doc))
    args = ["calibrate", "--data", str(signed / "fleet.csv")]
    monkeypatch.setenv(KEY_ENV, (signed / "key").read_text().strip())  # the key from $ENV
    _refused(runner.invoke(app, [*args, "--prior", str(run), "--out", str(tmp_path / "x")]),
             f"{prior}: MAC mismatch")  # fmt: skip
    assert not (tmp_path / "x").exists()
    out = tmp_path / "new"
    result = runner.invoke(app, [*args, "--prior", str(signed / "run"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    check_mac(out, (signed / "key").read_text().strip().encode())  # signed with the key
    # a file planted where fedcal reads (another seed's model) is not covered
    planted = out / "runs" / "fedprior_tp0_seed1"
    planted.mkdir()
    shutil.copy(out / PRIOR / "model.safetensors", planted / "model.safetensors")
    result = _predict(signed, out, tmp_path / "p.csv", "--seed", "1")
    _refused(result, f"{planted / 'model.safetensors'}: not covered by the MAC")


def test_a_short_key_is_refused_and_no_key_writes_no_mac(signed, tmp_path) -> None:
    (tmp_path / "short").write_text("1234\n")
    result = _predict(signed, signed / "run", tmp_path / "a.csv", "--key-file",
                      str(tmp_path / "short"))  # fmt: skip
    _refused(result, "at least 16 bytes")
    run = _copy(signed, tmp_path)
    (run / MAC_FILE).unlink()
    write_mac(run, b"k" * 16)
    check_mac(run, b"k" * 16)
    with pytest.raises(ValueError, match="wrong MAC"):
        check_mac(run, b"j" * 16)

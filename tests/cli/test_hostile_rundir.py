"""A hostile-input corpus for run folders: every file slot × every hostile mutation, refused.

One small trained run folder (fedgmi: an MLP; fedprior: a fleet prior) is built once;
every case copies it, breaks one file in one way, and runs every command that reads
that file, in-process with a watchdog. Each must:

* exit 2 (refused input) with exactly one line, ``error: …``, and no traceback;
* finish within :data:`TIME_LIMIT` (a FIFO or ``/dev/zero`` read would hang);
* write nothing and change nothing: every file under the case's folder (the run, the
  inputs, the would-be outputs and any path a hostile name points to) is the same after.

The overwrite and path-escape cases (an output onto an input, a name that leaves its
folder) are checked the same way. ``test_the_intact_run_serves_every_command`` makes
sure every command works on the untouched copy, so each refusal is the mutation's doing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fedcal.cli import app
from fedcal.core.tensorfile import load_trees, save_trees
from fedcal.data.simulator import FleetSpec, simulate_fleet

SRC = str(Path(__file__).resolve().parents[2] / "src")
TIME_LIMIT = 20.0  # seconds per command; a refused file takes well under one
HUGE = 2 * 1024**3 + 1  # one byte over the default size limit (a sparse file: no disk used)
runner = CliRunner(env={"COLUMNS": "1000"})  # wide: a message must not wrap

GMI = "runs/fedgmi_tp0_seed0"
PRIOR = "runs/fedprior_tp0_seed0"


# --------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A case folder: ``run/`` (fedgmi + fedprior), ``readings.csv``, ``new_units.csv``."""
    root = tmp_path_factory.mktemp("hostile_rundir")
    fleet = simulate_fleet(FleetSpec(num_sensors=4), seed=3)
    fleet.frame.to_csv(root / "fleet.csv", index=False)
    cfg = root / "c.toml"
    cfg.write_text("[model]\nhidden = [4]\n[train]\nlocal_epochs = 1\n[engine]\nrounds = 2\n")
    args = ["run", "--data", str(root / "fleet.csv"), "--methods", "fedprior,fedgmi"]
    args += ["--seeds", "1", "--config", str(cfg), "--out", str(root / "run"), "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cols = ["sensor_id", "frequency_hz", "temperature_c"]
    fleet.frame.query("split == 'test'")[cols].to_csv(root / "readings.csv", index=False)
    new = simulate_fleet(FleetSpec(num_sensors=2, train_design="3x2"), seed=9).frame
    new = new.assign(sensor_id="NEW-" + new["sensor_id"])
    new[[*cols, "pressure_hpa"]].to_csv(root / "new_units.csv", index=False)
    (root / "fleet.csv").unlink()
    cfg.unlink()
    return root


def commands(case: Path) -> dict[str, list[str]]:
    """Every command that reads a run folder, its outputs under ``case/out``."""
    run, out = str(case / "run"), case / "out"
    return {
        "predict_mlp": ["predict", run, "--data", str(case / "readings.csv"), "--method",
                        "fedgmi", "--out", str(out / "cal.csv")],
        "predict_prior": ["predict", run, "--data", str(case / "readings.csv"), "--method",
                          "fedprior", "--out", str(out / "cal.csv")],
        "export_c": ["export", run, "--method", "fedgmi", "--format", "c",
                     "--out", str(out / "m.h")],
        "export_json": ["export", run, "--method", "fedprior", "--format", "json",
                        "--out", str(out / "m.json")],
        "export_onnx": ["export", run, "--method", "fedgmi", "--format", "onnx",
                        "--out", str(out / "onnx")],
        "report": ["report", run, "--markdown"],
        "report_html": ["report", run, "--html", str(out / "html" / "r.html")],  # a new dir
        "calibrate": ["calibrate", "--prior", run, "--data", str(case / "new_units.csv"),
                      "--out", str(out / "new")],
    }  # fmt: skip


# Which commands read each slot of the run folder.
SLOTS = {
    "config.json": ["predict_mlp", "export_c", "report"],
    "summary.csv": ["report"],
    f"{GMI}/model.safetensors": ["predict_mlp", "export_c", "export_onnx"],
    f"{PRIOR}/model.safetensors": ["predict_prior", "export_json"],
    f"{PRIOR}/prior.json": ["calibrate"],
    f"{GMI}/valid_range.json": ["export_c", "export_onnx"],
    f"{PRIOR}/valid_range.json": ["export_json"],
    f"{GMI}/per_sensor.csv": ["report_html"],
}


# --------------------------------------------------------------------------- mutations


def fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def dev_zero(p: Path) -> None:
    p.unlink()
    p.symlink_to("/dev/zero")


def directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


def empty(p: Path) -> None:
    p.write_bytes(b"")


def truncated(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def huge(p: Path) -> None:
    os.truncate(p, HUGE)  # sparse: reading it would take 2 GiB of memory


def garbage(p: Path) -> None:
    p.write_bytes(bytes(range(256)) * 8)


def deep_json(p: Path) -> None:  # a RecursionError in json.loads (issue 36.5)
    p.write_text("[" * 100_000 + "]" * 100_000)


FILE_LEVEL = {
    "fifo": fifo,
    "dev_zero": dev_zero,
    "directory": directory,
    "empty": empty,
    "truncated": truncated,
    "huge": huge,
    "garbage": garbage,
    "deep_json": deep_json,
}


def json_edit(edit):
    def mutate(p: Path) -> None:
        doc = json.loads(p.read_text())
        doc = edit(doc)
        p.write_text(json.dumps(doc, allow_nan=True) if not isinstance(doc, str) else doc)

    return mutate


def model_edit(edit):
    """Edit a model file's trees/meta and save it again: a valid checksum over hostile content."""

    def mutate(p: Path) -> None:
        trees, meta, blobs = load_trees(p)
        edit(trees["params"], meta)
        save_trees(p, trees, meta, blobs)

    return mutate


def _first_leaf(params: dict, edit) -> None:
    key = sorted(k for k, v in params.items() if torch.is_tensor(v) and v.is_floating_point())[0]
    params[key] = edit(params[key])


def _nan(t):
    t = t.clone()
    t.view(-1)[-1] = float("nan")  # the last sensor's last value
    return t


def _inf(t):
    t = t.clone()
    t.view(-1)[0] = float("inf")
    return t


def _reshape(t):
    return torch.zeros(t.shape[0], t.numel() // t.shape[0] + 1, dtype=t.dtype)


def _scaler(meta: dict, key: str, value) -> None:
    meta["scaler"][key] = value


MODEL = {
    "nan_weight": model_edit(lambda p, m: _first_leaf(p, _nan)),
    "inf_weight": model_edit(lambda p, m: _first_leaf(p, _inf)),
    "wrong_shape": model_edit(lambda p, m: _first_leaf(p, _reshape)),
    "nan_scaler": model_edit(lambda p, m: _scaler(m, "x_offset", [float("nan")] * 2)),
    "zero_scale": model_edit(lambda p, m: _scaler(m, "y_scale", [0.0])),
    "short_scaler": model_edit(lambda p, m: _scaler(m, "x_scale", [1.0])),
    "duplicate_ids": model_edit(lambda p, m: m.update(client_ids=[m["client_ids"][0]] * 4)),
    "ids_short": model_edit(lambda p, m: m.update(client_ids=m["client_ids"][:2])),
    "bad_json": lambda p: p.write_bytes(p.read_bytes().replace(b'"fedcal"', b'"fedca!"', 1)),
}


def _leaf(name: str, edit):
    """Replace one named parameter (all sensors) by ``edit`` of it."""
    return model_edit(lambda p, m: p.__setitem__(name, edit(p[name].clone())))


def _negative_diagonal(cov):
    cov[0, 0, 0] = -abs(float(cov[0, 0, 0])) - 1e-9
    return cov


def _not_pd(cov):  # symmetric, positive diagonal, a negative eigenvalue
    i = int(cov[0].diagonal().argmax())
    j = int(sorted(range(cov.shape[-1]), key=lambda k: -float(cov[0, k, k]))[1])
    big = 2.0 * float(torch.sqrt(cov[0, i, i] * cov[0, j, j]))
    cov[0, i, j] = cov[0, j, i] = big
    return cov


def _moved_prior(p: Path) -> None:  # fedprior's model under the MLP method's name
    shutil.copyfile(p.parents[1] / PRIOR.removeprefix("runs/") / "model.safetensors", p)


def _all_int64(params: dict, meta: dict) -> None:
    for k in list(params):
        params[k] = params[k].round().to(torch.int64)


# issue 36.3: the model file held to prior.json's checks (its checksum recomputed each time)
MODEL_PRIOR = {
    "negative_noise_var": _leaf("noise_var", lambda t: -t.abs()),
    "zero_noise_var": _leaf("noise_var", lambda t: t * 0.0),
    "negative_variance": _leaf("cov", _negative_diagonal),
    "cov_not_pd": _leaf("cov", _not_pd),
    "coef_x1e38": _leaf("coef", lambda t: t * 1e38),
    "coef_x1e6": _leaf("coef", lambda t: t * 1e6),
    "int64": model_edit(_all_int64),
}
MODEL_MLP = {
    "weight_x1e38": _leaf("l1.weight", lambda t: t * 1e38),
    "int64": model_edit(_all_int64),
    "fedprior_model_moved_here": _moved_prior,
}


def _set(key, value):
    def edit(doc):
        doc[key] = value
        return doc

    return edit


def _sigma_not_pd(doc):
    doc["sigma"] = [[-abs(v) if i == j else v for j, v in enumerate(r)] for i, r in
                    enumerate(doc["sigma"])]  # fmt: skip
    return doc


def _sigma_asymmetric(doc):
    doc["sigma"][0][1] += 1.0
    return doc


NAN = float("nan")
PRIOR_DOC = {
    "bad_json": json_edit(lambda d: json.dumps(d)[:-3]),
    "not_object": json_edit(lambda d: [d]),
    "wrong_kind": json_edit(_set("kind", "fedgmi")),
    "sigma_not_pd": json_edit(_sigma_not_pd),
    "sigma_asymmetric": json_edit(_sigma_asymmetric),
    "sigma_wrong_shape": json_edit(lambda d: _set("sigma", [r[:-1] for r in d["sigma"]])(d)),
    "sigma_nan": json_edit(lambda d: _set("sigma", [[NAN] * len(r) for r in d["sigma"]])(d)),
    "noise_nan": json_edit(_set("noise_var", NAN)),
    "noise_inf": json_edit(_set("noise_var", float("inf"))),
    "noise_negative": json_edit(_set("noise_var", -1.0)),
    "noise_string": json_edit(_set("noise_var", "0.1")),
    "mu_short": json_edit(lambda d: _set("mu", d["mu"][:-1])(d)),
    "mu_nan": json_edit(lambda d: _set("mu", [NAN] * len(d["mu"]))(d)),
    "mu_missing": json_edit(lambda d: {k: v for k, v in d.items() if k != "mu"}),
    "terms_wrong_width": json_edit(lambda d: _set("terms", [[*t, 0] for t in d["terms"]])(d)),
    "scaler_zero": json_edit(lambda d: d["scaler"].update(x_scale=[0.0, 1.0]) or d),
    "scaler_nan": json_edit(lambda d: d["scaler"].update(y_offset=[NAN]) or d),
    "range_nan": json_edit(lambda d: d["input_range"].update(frequency_hz=[NAN, 1.0]) or d),
    "range_reversed": json_edit(lambda d: d["input_range"].update(temperature_c=[60, -40]) or d),
    "method_params_bad": json_edit(lambda d: d["method_params"].update(lr="fast") or d),
    # issue 35: magnitudes no prior in scaled units holds (calibrate wrote outputs before)
    "mu_1e300": json_edit(lambda d: _set("mu", [1e300] * len(d["mu"]))(d)),
    "sigma_x1e300": json_edit(
        lambda d: _set("sigma", [[v * 1e300 for v in r] for r in d["sigma"]])(d)
    ),
    "noise_1e308": json_edit(_set("noise_var", 1e308)),
    "probe_rows_negative": json_edit(lambda d: d["interval"].update(probe_rows=-7) or d),
    "tau_1e308": json_edit(lambda d: d["interval"].update(discrepancy_var=1e308) or d),
    "identification_5": json_edit(_set("identification", 5)),
}
ESCAPES = ["../../../ESCAPED", "/ABS/ESCAPED", "", "a\x00b", "a\nb", ".."]

RANGE_DOC = {
    "bad_json": json_edit(lambda d: "{"),
    "not_object": json_edit(lambda d: [1, 2]),
    "nan": json_edit(lambda d: {s: {c: [NAN, NAN] for c in v} for s, v in d.items()}),
    "inf": json_edit(lambda d: {s: {c: [0, float("inf")] for c in v} for s, v in d.items()}),
    "reversed": json_edit(lambda d: {s: {c: [v[c][1], v[c][0]] for c in v} for s, v in d.items()}),
    "strings": json_edit(lambda d: {s: {c: ["a", "b"] for c in v} for s, v in d.items()}),
}

CONFIG_DOC = {
    "bad_json": json_edit(lambda d: '{"run": '),
    "not_object": json_edit(lambda d: [d]),
    "nan": json_edit(lambda d: d["engine"].update(rounds=NAN) or d),
    "wrong_type": json_edit(_set("run", 5)),
    "escaping_method": json_edit(lambda d: d["methods"].update({"../x": {"base": "fedgmi"}}) or d),
}

SUMMARY = {
    "no_method_column": lambda p: p.write_text("a,b\n1,2\n"),
    "header_only": lambda p: p.write_text(p.read_text().splitlines()[0] + "\n"),
    "nan_seed": lambda p: p.write_text(p.read_text().replace(",0,0,", ",,0,", 1)),
    "escaping_method": lambda p: p.write_text(p.read_text().replace("fedgmi,", "../../x,", 1)),
}


@dataclass(frozen=True)
class Case:
    slot: str
    mutation: str
    mutate: object
    command: str
    names: str = ""  # what the one-line error must name (default: the slot's file)

    @property
    def id(self) -> str:
        return f"{self.slot.replace('runs/', '')}-{self.mutation}-{self.command}"


def corpus() -> list[Case]:
    cases = []
    for slot, readers in SLOTS.items():
        content = dict(FILE_LEVEL)
        if slot.endswith("model.safetensors"):
            content.update(MODEL)
            content.update(MODEL_PRIOR if slot.startswith(PRIOR) else MODEL_MLP)
        elif slot.endswith("prior.json"):
            content.update(PRIOR_DOC)
            for name in ESCAPES:
                content[f"method={name!r}"] = json_edit(_set("method", name))
        elif slot.endswith("valid_range.json"):
            content.update(RANGE_DOC)
        elif slot == "config.json":
            content.update(CONFIG_DOC)
        elif slot == "summary.csv":
            content.update(SUMMARY)
        elif slot.endswith("per_sensor.csv"):  # the HTML report is slow: file-level cases only
            content = {k: FILE_LEVEL[k] for k in ("fifo", "dev_zero")}
        for mutation, mutate in content.items():
            for command in readers:
                cases.append(Case(slot, mutation, mutate, command))
    # a sensor id that leaves the ONNX output folder (its checksum recomputed)
    for sid in ["../../ESCAPED", "/ABS/ESCAPED", "a\tb"]:
        edit = model_edit(lambda p, m, sid=sid: m["client_ids"].__setitem__(0, sid))
        slot = f"{GMI}/model.safetensors"
        cases.append(Case(slot, f"sensor_id={sid!r}", edit, "export_onnx", "sensor id"))
    return cases


CORPUS = corpus()


# --------------------------------------------------------------------------- checks


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: its type, and for a regular file its size and SHA-256."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest() if st.st_size < HUGE else ""
                out[str(p.relative_to(root))] = ("file", st.st_size, digest)
            else:
                out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), 0, "")
    return out


def invoke(args: list[str], limit: float = TIME_LIMIT):
    """The CLI in-process, in a daemon thread: a hang fails the test instead of blocking it."""
    box = {}

    def target() -> None:
        box["result"] = runner.invoke(app, args)

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"hung for more than {limit} s: fedcal {' '.join(args)}"
    return box["result"], time.monotonic() - start


def assert_refused(result, args: list[str], names: str = "") -> None:
    shown = f"fedcal {' '.join(map(repr, args))}\n{result.output}"
    assert result.exit_code == 2, shown  # refused input, not 0, 1 or 3 (internal)
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert "Traceback" not in result.output and "internal error" not in result.output, shown
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert names in lines[0], shown


def case_dir(pristine: Path, tmp_path: Path) -> Path:
    case = tmp_path / "case"
    shutil.copytree(pristine, case, symlinks=True)
    (case / "out").mkdir()  # outputs' parent exists: a refusal is the input's doing
    return case


# --------------------------------------------------------------------------- tests


def test_the_intact_run_serves_every_command(pristine, tmp_path):
    case = case_dir(pristine, tmp_path)
    for name, args in commands(case).items():
        result, _ = invoke(args, limit=120)
        assert result.exit_code == 0, f"{name}: {result.output}"
    assert len(list((case / "out" / "onnx").glob("*.onnx"))) == 4
    assert (case / "out" / "new" / "coefficients.csv").exists()
    assert (case / "out" / "html" / "r.html").stat().st_size > 10_000


def test_the_corpus_covers_every_slot_and_mutation():
    assert {c.slot for c in CORPUS} == set(SLOTS)
    assert len(CORPUS) >= 150
    for slot in SLOTS:
        got = {c.mutation for c in CORPUS if c.slot == slot}
        assert set(FILE_LEVEL) <= got or slot.endswith("per_sensor.csv"), slot


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.id)
def test_hostile_run_folder_file_is_refused(case: Case, pristine, tmp_path):
    case_root = case_dir(pristine, tmp_path)
    case.mutate(case_root / "run" / case.slot)
    before = snapshot(case_root)
    args = commands(case_root)[case.command]
    result, seconds = invoke(args)
    assert_refused(result, args, case.names or Path(case.slot).name)
    assert seconds < TIME_LIMIT
    assert snapshot(case_root) == before  # nothing written, nothing changed, nothing escaped
    assert not Path("/ABS").exists()


# --------------------------------------------------------------------------- outputs


def _overwrites(case: Path) -> dict[str, list[str]]:
    run, gmi = case / "run", case / "run" / GMI
    readings, new = str(case / "readings.csv"), str(case / "new_units.csv")
    (case / "link").symlink_to(run)
    os.link(case / "readings.csv", case / "hardlink.csv")
    calibrate = ["calibrate", "--data", new, "--prior"]
    predict = ["predict", str(run), "--method", "fedgmi", "--data", readings, "--out"]
    export = ["export", str(run), "--method", "fedgmi", "--out"]
    return {
        "calibrate_onto_prior_run": [*calibrate, str(run), "--out", str(run)],
        "calibrate_into_prior_run": [*calibrate, str(run), "--out", str(case / "run" / PRIOR)],
        "calibrate_onto_symlinked_run": [*calibrate, str(run), "--out", str(case / "link")],
        "calibrate_prior_file_onto_its_run": [
            *calibrate, str(case / "run" / PRIOR / "prior.json"), "--out", str(run)],
        "calibrate_around_prior_run": [*calibrate, str(run), "--out", str(case)],
        "export_onto_model": [*export, str(gmi / "model.safetensors")],
        "export_onto_summary": [*export, str(run / "summary.csv"), "--format", "json"],
        "export_onto_config_via_symlink": [*export, str(case / "link" / "config.json")],
        "export_onnx_into_run": [*export, str(gmi), "--format", "onnx"],
        "report_html_onto_summary": ["report", str(run), "--html", str(run / "summary.csv")],
        "report_html_onto_model": ["report", str(run), "--html", str(gmi / "model.safetensors")],
        "predict_onto_data": [*predict, readings],
        "predict_onto_data_other_spelling": [*predict, str(case / "out" / ".." / "readings.csv")],
        "predict_onto_data_hard_link": [*predict, str(case / "hardlink.csv")],
        "predict_onto_config": [*predict, str(run / "config.json")],
        "run_html_onto_data": ["run", "--data", readings, "--html", readings,
                               "--out", str(case / "out" / "r")],
        "run_out_holding_its_data": ["run", "--data", str(run / "summary.csv"), "--out", str(run)],
    }  # fmt: skip


def _overwrite_names() -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        case = Path(d)
        (case / "run").mkdir()
        (case / "readings.csv").write_text("")
        return list(_overwrites(case))


@pytest.mark.parametrize("name", _overwrite_names())
def test_an_output_onto_an_input_is_refused(name, pristine, tmp_path):
    case = case_dir(pristine, tmp_path)
    args = _overwrites(case)[name]
    before = snapshot(case)
    result, _ = invoke(args)
    assert_refused(result, args)
    assert snapshot(case) == before


ESCAPING_METHODS = ["../x", "../../ESCAPED", "/ABS/ESCAPED", "a/b", "..", "a\x01b"]


@pytest.mark.parametrize("name", ESCAPING_METHODS)
def test_a_method_name_that_leaves_the_run_folder_is_refused(name, pristine, tmp_path):
    case = case_dir(pristine, tmp_path)
    cfg = case / "c.toml"
    cfg.write_text(f'[methods.{json.dumps(name)}]\nbase = "fedgmi"\n[engine]\nrounds = 1\n')
    before = snapshot(case)
    for args in (
        ["run", "--config", str(cfg), "--out", str(case / "out")],
        ["run", "--methods", name, "--out", str(case / "out")],
        ["export", str(case / "run"), "--method", name, "--format", "json"],
        ["predict", str(case / "run"), "--method", name, "--data", str(case / "readings.csv"),
         "--out", str(case / "cal.csv")],
    ):  # fmt: skip
        result, _ = invoke(args)
        assert_refused(result, args)
    assert snapshot(case) == before
    assert not Path("/ABS").exists()


@pytest.mark.parametrize("mutation", ["fifo", "dev_zero", "directory", "huge", "garbage"])
def test_a_hostile_config_file_is_refused_quickly(mutation, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[engine]\nrounds = 1\n")
    FILE_LEVEL[mutation](cfg)
    before = snapshot(tmp_path)
    for args in (["methods", "--config", str(cfg)],
                 ["run", "--config", str(cfg), "--out", str(tmp_path / "out")]):  # fmt: skip
        result, _ = invoke(args)
        assert_refused(result, args)
    assert snapshot(tmp_path) == before


def test_a_real_process_refuses_a_fifo_model_in_one_line(pristine, tmp_path):
    """The console entry (not the in-process runner): exit 2, one line on stderr, no trace."""
    case = case_dir(pristine, tmp_path)
    fifo(case / "run" / GMI / "model.safetensors")
    before = snapshot(case)
    env = {**os.environ, "PYTHONPATH": SRC, "COLUMNS": "1000"}
    env.pop("FEDCAL_DEBUG", None)
    cmd = [sys.executable, "-c", "from fedcal.cli import app; app()"]
    done = subprocess.run(
        [*cmd, *commands(case)["predict_mlp"]], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "named pipe" in lines[0] and "Traceback" not in done.stderr
    assert done.stdout == "" and snapshot(case) == before

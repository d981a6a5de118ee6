"""``fedcal export`` and ``fedcal predict``: a run's per-sensor models, served."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedcal.cli.base import (
    KeyFileOpt,
    _check_mac,
    _check_out,
    _fail,
    _mac_key,
    app,
    console,
    err_console,
)
from fedcal.cli.options import (
    ExportFormatOpt,
    MethodOpt,
    RunDirArg,
    RunPointsOpt,
    RunSeedOpt,
    SensorOpt,
)
from fedcal.core.errors import ConfigError


@app.command()
def export(
    run_dir: RunDirArg,
    method: MethodOpt = None,
    seed: RunSeedOpt = 0,
    train_points: RunPointsOpt = 0,
    fmt: ExportFormatOpt = "c",
    out: Annotated[
        Path | None,
        typer.Option("--out", help="file to write (default: stdout); a directory for onnx"),
    ] = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Export every sensor's calibrated model: C header, JSON, or ONNX (one file per sensor).

    Every format carries each sensor's valid range: the span of its calibration points.
    """
    from fedcal.core.atomic import write_bytes, write_text
    from fedcal.core.paths import safe_name
    from fedcal.report.export import choose_method, to_c_header, to_json
    from fedcal.report.rundir import load_served

    key = _mac_key(key_file)
    if fmt not in ("c", "json", "onnx"):
        _fail(f"--format must be 'c', 'json' or 'onnx', got {fmt!r}")
    if fmt == "onnx" and out is None:
        _fail("--format onnx writes one file per sensor: give a directory with --out")
    if fmt == "onnx":
        _need_onnx()
    try:
        _check_out(out, run_dir, directory=fmt == "onnx")
        method = choose_method(run_dir, method)
        if key is not None:
            _check_mac([run_dir], key)
        # checked models; ONNX traces the method's torch algorithm
        fleet, ranges = load_served(run_dir, method, seed, train_points, algorithm=fmt == "onnx")
        if fmt == "onnx":
            from fedcal.report.onnx_export import to_onnx

            files = {  # a sensor id names a file: only through the sanitizer (core/paths.py)
                safe_name(sid, "sensor id"): to_onnx(fleet, sid, method, ranges.get(sid))
                for sid in sorted(fleet.params)
            }
        else:
            text = (
                to_c_header(fleet, valid_range=ranges, method=method)
                if fmt == "c"
                else to_json(fleet, valid_range=ranges, method=method)
            )
    except (FileNotFoundError, ValueError, ConfigError) as err:
        _fail(str(err))
    if fmt == "onnx":
        out.mkdir(parents=True, exist_ok=True)
        for sid, blob in files.items():
            write_bytes(out / f"{sid}.onnx", blob)
        console.print(f"wrote {len(files)} ONNX models ({{sensor}}.onnx) to {out}")
    elif out is None:
        console.out(text, highlight=False)
    else:
        write_text(out, text)
        console.print(f"wrote {len(fleet.params)} sensors' models to {out}")
        _print_footprint(fleet, method)
    _print_excluded(fleet)
    _print_without_sigma(fleet)


def _need_onnx() -> None:
    """--format onnx: onnx is an extra (pyproject.toml); one line when it is not installed."""
    import importlib.util

    if importlib.util.find_spec("onnx") is None:
        _fail("--format onnx needs the onnx package: pip install 'fedcal[onnx]'")


def _print_without_sigma(fleet) -> None:
    """One stderr line when some sensors' models state no σ: exported without one."""
    missing = fleet.without_sigma()
    if missing:
        err_console.print(
            f"[bold yellow]warning[/] no σ stated for {len(missing)} of {len(fleet.params)} "
            f"sensor(s) ({', '.join(missing)}; their interval was declined): exported without "
            "σ (C fedcal_has_std 0, JSON has_sigma false, ONNX no σ output)"
        )


def _print_excluded(fleet) -> None:
    """One stderr line per sensor the run refused: not exported (it has no model)."""
    for sensor in fleet.excluded:
        err_console.print(f"[bold yellow]warning[/] not exported: {fleet.no_model(sensor)}")


def _print_footprint(fleet, method: str) -> None:
    """The C header's constants per unit, for a model linear in a basis (docs/firmware.md)."""
    from fedcal.report.linear_export import linear_form

    form = linear_form(fleet, method)
    if form is not None:
        sigma = ", with σ" if form.has_std else ""
        if form.unstated:
            sigma += f" for {len(form.sensors) - len(form.unstated)} of {len(form.sensors)} units"
        deployed = (
            f"; + {form.deployed.bytes_per_unit()} per unit whose σ is the prior's "
            "discrepancy model"
            if form.deployed is not None
            else ""
        )
        console.print(
            f"footprint: {form.bytes_per_unit()} bytes of constants per unit "
            f"({form.terms.shape[0]} basis terms{sigma}){deployed}"
        )


@app.command()
def predict(
    run_dir: RunDirArg,
    data: Annotated[
        Path, typer.Option("--data", help="CSV/Parquet with the sensor column and the features")
    ],
    out: Annotated[
        Path, typer.Option("--out", help="CSV to write: the input rows plus the calibrated target")
    ],
    method: MethodOpt = None,
    seed: RunSeedOpt = 0,
    train_points: RunPointsOpt = 0,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="refuse readings beyond the calibrated range or of a sensor the run refused",
        ),
    ] = False,
    sensor_column: SensorOpt = None,
    key_file: KeyFileOpt = None,
) -> None:
    """Calibrate raw readings with each sensor's personalized model.

    Adds <target>_calibrated, <target>_std (when the method has a predictive σ) and
    in_range: readings beyond the sensor's calibrated span by more than 5 % of it are
    flagged in_range = False (refused with --strict), never silently extrapolated.
    Rows of a sensor the run refused (no model) are left empty and named in a warning
    (refused with --strict).
    """

    from fedcal.core.atomic import write_text
    from fedcal.data.loader import load_readings
    from fedcal.report.export import calibrate_frame, choose_method, uncalibrated_notes
    from fedcal.report.rundir import load_served

    key = _mac_key(key_file)
    try:
        _check_out(out, run_dir, inputs=[data])
        method = choose_method(run_dir, method)
        if key is not None:
            _check_mac([run_dir], key)
        fleet, ranges = load_served(run_dir, method, seed, train_points)  # checked models
        column = sensor_column or fleet.sensor_column
        # The loader's guards: regular file, size limit, checksums, finite plausible values.
        frame = load_readings(data, fleet.features, column)
        # <target>_calibrated and _std through the Python API's path, and in_range
        frame = calibrate_frame(fleet, frame, ranges, strict, column)
    except (FileNotFoundError, ValueError, KeyError, ConfigError) as err:
        _fail(str(err))
    write_text(out, frame.to_csv(index=False))
    # rows of a sensor the run refused have no value to call extrapolated (said below)
    valued = frame[f"{fleet.target}_calibrated"].notna()
    outside = int((~frame["in_range"] & valued).sum())
    console.print(f"wrote {len(frame)} calibrated rows to {out}")
    if outside:  # extrapolated values are flagged, and said
        err_console.print(
            f"[bold yellow]warning[/] {outside} row(s) beyond the calibrated range "
            "(in_range = False): extrapolated, not calibrated"
        )
    for note in uncalibrated_notes(fleet, frame, column):  # sensors the run refused
        err_console.print(f"[bold yellow]warning[/] {note}")

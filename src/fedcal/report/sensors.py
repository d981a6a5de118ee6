"""Which sensors a run's model file serves: the checks ``load_models`` (torch) and
``load_station`` (NumPy, :mod:`fedcal.report.served`) share — the file holds this method's
model, and each sensor with a non-finite model is one the run refused (left out, with the
run's reason from its per_sensor.csv) or an error. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedcal.core import runnames
from fedcal.core.arrayfile import TensorFileError
from fedcal.status import Status


def check_method(path: Path, meta: dict, method: str) -> None:
    """Refuse a model file whose metadata names another method (moved under this name)."""
    if meta.get("method", method) != method:
        raise TensorFileError(
            path, f"holds a model of method {meta.get('method')!r}, not {method!r}: moved or edited"
        )


def served_sensors(
    path: Path,
    params: dict,
    folder: Path,
    drop_diverged: bool,
    problem: Callable[[str], Exception | None],
) -> dict[str, str]:
    """Leave out of ``params`` (in place) each sensor whose model ``problem`` finds not finite,
    and return the ones the run refused ({sensor: the run's reason}, its per_sensor.csv): a
    refused sensor has no model by the method's decision; any other is the problem raised,
    unless ``drop_diverged``. Every sensor refused: a ValueError (:func:`load_models`).
    A ``fedcal calibrate`` output's units refused by the range guard have no entry in the
    model file: they are listed by its units.csv (:func:`calibrate_refused`) and excluded."""
    refused = _refused_sensors(folder / runnames.PER_SENSOR)
    excluded: dict[str, str] = {
        sensor: refused_reason(why)
        for sensor, why in calibrate_refused(folder.parent.parent).items()
        if sensor not in params
    }
    for sensor in list(params):
        err = problem(sensor)
        if err is None:
            continue
        if sensor in refused:  # no model by the method's decision, recorded by the run
            excluded[sensor] = refused[sensor]
        elif not drop_diverged:
            raise err
        del params[sensor]
    if excluded and not params and not drop_diverged:
        raise ValueError(
            f"{path}: no sensor has a model: the method refused all {len(excluded)} "
            f"({next(iter(excluded.values()))})"
        )
    return excluded


def refused_reason(reason: str) -> str:
    """ "refused (reason)": a refused sensor's entry in ``CalibratedFleet.excluded``."""
    return Status.REFUSED + (f" ({reason})" if reason else "")


def calibrate_refused(run_dir: Path) -> dict[str, str]:
    """{unit: reason} of the units a ``fedcal calibrate`` output refused (units.csv: status
    ``refused``, ``status_reason``; :func:`fedcal.prior.qa.refuse_out_of_range`); empty for
    another run folder (no units.csv)."""
    rows = _rows(run_dir / runnames.UNITS)
    return {
        str(r.get("sensor_id")): r.get("status_reason") or ""
        for r in rows
        if r.get("status") == Status.REFUSED and r.get("sensor_id") is not None
    }


def _rows(path: Path) -> list[dict]:
    """The rows of a run's CSV table as dicts (strings); none without it or unreadable."""
    import csv
    import io

    from fedcal.core.paths import read_text

    if not path.exists():
        return []
    try:  # the guarded reader (regular file, size limit), as every run file
        return list(csv.DictReader(io.StringIO(read_text(path))))
    except (OSError, ValueError, csv.Error):
        return []  # unreadable: no sensor is excused, a NaN model stays an error


def _refused_sensors(path: Path) -> dict[str, str]:
    """{sensor: "refused (reason)"} of the run's ``per_sensor.csv`` (status ``refused``);
    empty without that file or its status columns (a run before statuses)."""
    return {
        str(r.get("client")): refused_reason(r.get("status_reason") or "")
        for r in _rows(path)
        if r.get("status") == Status.REFUSED and r.get("client") is not None
    }

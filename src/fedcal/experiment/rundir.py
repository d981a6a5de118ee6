"""A run directory's files: names, atomic writes, the check that a directory holds this
run (same configuration, same data), the finished runs read back, the summary's column
order (the layout: :mod:`fedcal.experiment`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pandas as pd

from fedcal.config import ConfigError
from fedcal.core import runnames
from fedcal.core.atomic import write_text
from fedcal.core.csvfile import write_table
from fedcal.core.paths import read_json
from fedcal.data.fleet import Fleet
from fedcal.status import COUNT_COLUMNS

SUMMARY_COLUMNS = [
    "method",
    "design",
    "fleet_seed",
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
    "sensors",
    "excluded",
    *COUNT_COLUMNS.values(),  # one count per status other than ok (fedcal.status)
    "rejected",
    "failed",
]


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception as one short line (no tensor dumps, no traceback)."""
    text = str(err).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[:limit] + "…"
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


MODEL_FILE = runnames.MODEL  # (names kept: calibration and the exports import them)


CHECKPOINT_FILE = runnames.CHECKPOINT


class RunDirectoryError(ConfigError):
    """A run directory that cannot be resumed (its data changed, or a file in it is corrupt).

    A :class:`ConfigError` so that every caller reports it the same way: one line.
    """


def _write_text(path: Path, text: str) -> None:
    write_text(path, text)


def _write_csv(path: Path, frame: pd.DataFrame) -> None:
    """:func:`fedcal.core.csvfile.write_table` (atomic, chunked; torch-free)."""
    write_table(path, frame)


def _data_digest(variants: list[tuple[dict[str, Any], Fleet]]) -> str:
    """One digest of every fleet variant's content (a single fleet: its own digest)."""
    digests = [f.content_digest() for _, f in variants]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()


def _numbers_config(resolved: dict) -> dict:
    """The configuration without what cannot change the numbers ([engine] chunk_size,
    device and workers, and [data] path: the data's content is compared by its digest), so
    a run may resume in other chunks, on another device or threads, or with the same data
    by another path."""
    engine = {
        k: v
        for k, v in resolved.get("engine", {}).items()
        if k not in ("chunk_size", "device", "workers")
    }
    data = resolved.get("data", {})
    data = {k: v for k, v in data.items() if k != "path"} if isinstance(data, dict) else data
    return {**resolved, "engine": engine, "data": data}


def _check_same_run(config_path: Path, resolved: dict, digest: str, out: Path) -> None:
    """Refuse a run directory holding another configuration or made from other data."""
    try:
        saved = read_json(config_path, allow_nan=True)  # guarded: no FIFO, size limit
        saved_digest = saved.pop("data_sha256", None)
    except (OSError, ValueError, AttributeError) as e:
        raise RunDirectoryError(
            f"{config_path} is unreadable or corrupt ({type(e).__name__}); "
            f"remove {out} or choose another --out"
        ) from None
    if _numbers_config(saved) != _numbers_config(resolved):
        raise ConfigError(
            f"{out} holds a run with another configuration; choose another --out "
            "or remove it (nothing was changed)"
        )
    if saved_digest != digest:
        raise RunDirectoryError(
            f"data changed since this run started (its content differs from what {out} was "
            f"run on): remove {out} or choose another --out"
        )


def _in_place(out: Path, run_dir: Path) -> Path:
    """``run_dir`` if it is ``out``'s own folder: not reached through a symbolic link
    (``runs/`` or ``runs/<name>`` planted as one would be followed on resume, reading a
    done.json and writing models outside ``--out``: issue 36.5), else a RunDirectoryError."""
    for path in (run_dir.parent, run_dir):
        if path.is_symlink():
            raise RunDirectoryError(
                f"{path} is a symbolic link: a run folder is written in place, never through "
                f"a link; remove it (or choose another --out)"
            )
    if run_dir.exists() and run_dir.resolve().parent.parent != out.resolve():
        raise RunDirectoryError(f"{run_dir} lies outside {out}: remove it")
    return run_dir


def _read_done(done: Path, out: Path) -> dict[str, Any]:
    try:
        row = read_json(done, allow_nan=True)
        if not isinstance(row, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise RunDirectoryError(
            f"{done} is corrupt ({type(e).__name__}); remove {done.parent} to redo that run, "
            f"or remove {out} or choose another --out"
        ) from None
    return row


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    first = [c for c in SUMMARY_COLUMNS if c in frame.columns]
    rest = [c for c in frame.columns if c not in first]
    return frame[first + rest]


def _run_name(method: str, labels: dict[str, Any], tp: int, seed: int) -> str:
    return runnames.run_name(method, tp, seed, labels.get("design"), labels.get("fleet_seed"))


def _where(labels: dict[str, Any]) -> str:
    return "".join(f" {k}={v}" for k, v in labels.items())


def _provenance(variants: list[tuple[dict[str, Any], Fleet]]) -> Any:
    """fleet.json: the fleet's meta, or per swept variant its labels and meta."""
    if len(variants) == 1 and not variants[0][0]:
        return variants[0][1].meta
    return [{**labels, "meta": fleet.meta} for labels, fleet in variants]

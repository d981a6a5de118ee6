"""An optional keyed MAC over a run folder, so a site can detect an edited one.

The SHA-256 inside a model file protects against accidents, not against an editor: anyone
can recompute it. With a key (``--key-file`` or ``$FEDCAL_MAC_KEY``), ``run`` and
``calibrate`` write ``<run>/fedcal.mac``: the SHA-256 of every file the run folder holds
when it is written, and an HMAC-SHA256 (RFC 2104, the standard
library's :mod:`hmac`) over that list under the key. ``predict``, ``export`` and
``calibrate --prior`` given a key check it before reading anything else: a missing MAC
file, a wrong MAC (another key, or the list edited), a file whose digest differs, a file
gone, or a file added where fedcal reads (``config.json``, ``summary.csv``, ``fleet.json``,
anything under ``runs/``: :func:`fedcal.core.paths.run_owned`) is one :class:`MacError`
line naming the file. Without a key nothing is written or checked (docs/safety-files.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from fedcal.core.paths import RUN_FILES, RUNS_SUBDIR, PathError, read_regular, read_text

MAC_FILE = "fedcal.mac"
MAC_FORMAT = "fedcal-mac/1"
KEY_ENV = "FEDCAL_MAC_KEY"
MIN_KEY_BYTES = 16  # an HMAC key shorter than this is guessable


class MacError(ValueError):
    """A run folder that fails its MAC check, or an unusable key; ``str()`` is one line."""


def read_key(key_file: str | Path | None = None) -> bytes | None:
    """The MAC key: the bytes of ``key_file`` (a trailing newline dropped), else
    ``$FEDCAL_MAC_KEY`` (UTF-8), else None (no MAC)."""
    if key_file is not None:
        try:
            key = read_regular(key_file, max_bytes=1 << 16).rstrip(b"\r\n")
        except PathError as e:
            raise MacError(f"--key-file {e}") from None
        where = f"--key-file {key_file}"
    else:
        text = os.environ.get(KEY_ENV)
        if text is None:
            return None
        key, where = text.encode("utf-8"), f"${KEY_ENV}"
    if len(key) < MIN_KEY_BYTES:
        raise MacError(f"{where}: a MAC key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return key


def covered_files(run_dir: str | Path, everything: bool = False) -> list[str]:
    """The run folder's files fedcal reads back (relative POSIX paths, sorted): its
    :data:`RUN_FILES` and everything under ``runs/``; with ``everything``, every file of the
    folder but the MAC file (what :func:`write_mac` signs: calibrate's top-level tables
    too). Symlinks are listed as themselves (and refused when read)."""
    run_dir = Path(run_dir)
    found = [name for name in RUN_FILES if (run_dir / name).is_file()]
    top = run_dir if everything else run_dir / RUNS_SUBDIR
    for root, dirs, files in os.walk(top) if top.is_dir() else ():
        dirs.sort()
        rel = Path(root).relative_to(run_dir)
        found += [(rel / f).as_posix() for f in files]
    return sorted(set(found) - {MAC_FILE})


def _digests(run_dir: Path, names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = hashlib.sha256(read_regular(run_dir / name)).hexdigest()
        except PathError as e:
            raise MacError(str(e)) from None
    return out


def _mac(key: bytes, files: dict[str, str]) -> str:
    text = json.dumps({"format": MAC_FORMAT, "files": files}, sort_keys=True)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def write_mac(run_dir: str | Path, key: bytes) -> Path:
    """Write ``<run_dir>/fedcal.mac`` over :func:`covered_files` (atomically)."""
    from fedcal.core.atomic import write_text

    run_dir = Path(run_dir)
    files = _digests(run_dir, covered_files(run_dir, everything=True))
    doc = {"format": MAC_FORMAT, "algorithm": "hmac-sha256", "files": files}
    doc["mac"] = _mac(key, files)
    path = run_dir / MAC_FILE
    write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def check_mac(run_dir: str | Path, key: bytes) -> None:
    """Refuse a run folder whose ``fedcal.mac`` is missing or does not match ``key`` and
    its files (module doc); a MacError naming the file."""
    run_dir = Path(run_dir)
    path = run_dir / MAC_FILE
    if not path.exists() and not path.is_symlink():
        raise MacError(f"{path}: missing: this run folder carries no MAC (write it with a key)")
    try:
        doc = json.loads(read_text(path, max_bytes=1 << 24))
    except (PathError, ValueError, RecursionError) as e:
        raise MacError(f"{path}: unreadable MAC file ({type(e).__name__})") from None
    if not isinstance(doc, dict):  # JSON, but a list, a number, a string: no MAC file
        raise MacError(f"{path}: not a fedcal MAC file (expected a JSON object)")
    files = doc.get("files")
    if (
        doc.get("format") != MAC_FORMAT
        or not isinstance(files, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        or not isinstance(doc.get("mac"), str)
    ):
        raise MacError(f"{path}: not a fedcal MAC file")
    if not hmac.compare_digest(_mac(key, files), doc["mac"]):
        raise MacError(f"{path}: wrong MAC: the folder's file list was edited, or another key")
    for name in sorted(set(covered_files(run_dir)) - set(files)):  # a planted model, a seed
        raise MacError(f"{run_dir / name}: not covered by the MAC: added after the run")
    for name in sorted(files):
        if not (run_dir / name).exists() and not (run_dir / name).is_symlink():
            raise MacError(f"{run_dir / name}: covered by the MAC but missing")
        if not hmac.compare_digest(_digests(run_dir, [name])[name], files[name]):
            raise MacError(f"{run_dir / name}: MAC mismatch: edited since the run was written")

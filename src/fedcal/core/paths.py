"""What fedcal reads and writes stays where it belongs: one name sanitizer, one guarded reader.

Three rules, each in one place (see docs/safety-files.md):

* **Names become file names only through** :func:`safe_name`. A sensor id, a
  method name or a site read from a data file, a configuration or a run folder
  is refused (not rewritten) when it could leave the folder it is written in:
  empty, ``.`` or ``..`` or containing ``..``, a ``/`` or ``\\``, a control or
  format character (NUL, newline, bidi overrides), or longer than
  :data:`MAX_NAME_BYTES`. Refusing keeps file names equal to the ids the user
  sees, so no manifest is needed.
* **Files of a run folder are read only through** :func:`read_regular`: a
  regular file (checked with ``fstat`` on a descriptor opened non-blocking, so a
  FIFO is refused without waiting and ``/dev/zero`` is never read), no larger
  than :func:`max_file_bytes`. :func:`read_json` adds strict JSON (no ``NaN``
  or ``Infinity`` unless asked for).
* **No output replaces an input**: :func:`check_file_output` and
  :func:`check_dir_output` compare resolved paths and inodes, so another
  spelling, a symlink or a hard link of an input is refused too.

Every refusal is a :class:`PathError` (a ``ValueError``) with a one-line message.
"""

from __future__ import annotations

import json
import os
import stat
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedcal.core import runnames

MAX_NAME_BYTES = 200  # a file name is at most 255 bytes; room for "_tp48_seed0.onnx"
DEFAULT_MAX_BYTES = 2 * 1024**3  # a file larger than this is refused unread
# Run-folder files and configurations; data files have their own ($FEDCAL_MAX_FILE_BYTES).
MAX_BYTES_ENV = "FEDCAL_MAX_RUN_FILE_BYTES"
# What a run folder holds and fedcal reads back: no output of another command may be one.
RUN_FILES = (runnames.CONFIG, runnames.SUMMARY, runnames.FLEET)
RUNS_SUBDIR = runnames.RUNS

FILE_KINDS = {  # what a path is when it is no regular file (data and run files)
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


class PathError(ValueError):
    """A name or path fedcal refuses to read or write; ``str()`` is one line."""


def safe_name(name: object, what: str = "name") -> str:
    """``name`` unchanged if it is safe as one file-name component, else a PathError.

    ``what`` says where the name came from (``"sensor id"``, ``"method name in
    prior.json"``) and starts the message.
    """
    if not isinstance(name, str):
        raise PathError(f"{what} {name!r}: expected a string")
    problem = None
    if not name:
        problem = "is empty"
    elif "/" in name or "\\" in name:
        problem = "contains a path separator ('/' or '\\')"
    elif ".." in name or name == ".":
        problem = "contains '..' or is '.'"
    elif any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") for c in name):
        problem = "contains a control or invisible character"
    elif len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        problem = f"is longer than {MAX_NAME_BYTES} bytes"
    if problem:
        raise PathError(f"{what} {name!r} {problem}: it cannot name a file")
    return name


def byte_limit(env: str, default: int) -> int:
    """A size limit in bytes: ``$env`` if set (a positive whole number), else ``default``."""
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${env} must be a whole number of bytes, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"${env} must be positive, got {value}")
    return value


def max_file_bytes() -> int:
    """A run-folder file's size limit: ``$FEDCAL_MAX_RUN_FILE_BYTES``, else 2 GiB."""
    return byte_limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)


def read_regular(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of ``path`` if it is a regular file within the size limit, else a PathError.

    Opened non-blocking and checked with ``fstat`` on the descriptor, so a FIFO
    is refused without waiting for a writer and a file swapped between check
    and read cannot slip through; at most ``limit + 1`` bytes are ever read (a
    file growing while read is refused too).
    """
    path = Path(path)
    limit = max_file_bytes() if max_bytes is None else max_bytes
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise PathError(f"{path}: file not found") from None
    except OSError as e:
        raise PathError(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise PathError(f"{path}: not a regular file ({kind})")
        if st.st_size > limit:
            raise PathError(
                f"{path}: {st.st_size} bytes, over the limit of {limit} bytes "
                f"(set ${MAX_BYTES_ENV} to raise it)"
            )
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise PathError(f"{path}: grew beyond the limit of {limit} bytes while being read")
        return b"".join(chunks)
    except OSError as e:
        raise PathError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def read_text(path: str | Path, max_bytes: int | None = None) -> str:
    """:func:`read_regular`, decoded as UTF-8 (a binary file is a PathError)."""
    try:
        return read_regular(path, max_bytes).decode("utf-8")
    except UnicodeDecodeError:
        raise PathError(f"{path}: not a text (UTF-8) file") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def read_json(path: str | Path, allow_nan: bool = False) -> Any:
    """The JSON value in ``path`` (read by :func:`read_text`); ``NaN``/``Infinity`` refused.

    ``allow_nan`` admits them (a summary row of a diverged run holds NaN).
    """
    text = read_text(path)
    try:
        if allow_nan:
            return json.loads(text)
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise PathError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None
    except RecursionError:  # [[[[…]]]] 100,000 deep: no fedcal file nests beyond a few levels
        raise PathError(f"{path}: not a fedcal file (JSON nested too deeply)") from None


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name the same file: resolved spelling, or the same inode."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _within(inner: Path, outer: Path) -> bool:
    inner, outer = inner.resolve(), outer.resolve()
    return inner == outer or outer in inner.parents


def run_owned(path: str | Path, run_dir: str | Path) -> bool:
    """Whether ``path`` is a file the run folder ``run_dir`` holds and fedcal reads back.

    Those are :data:`RUN_FILES` at its top and everything under ``runs/``; any
    other file in it (a report next to the run) is the user's.
    """
    path, run_dir = Path(path), Path(run_dir)
    if not _within(path, run_dir):
        # a hard link elsewhere to a run's file is that file
        return (
            any(_same(path, run_dir / name) for name in RUN_FILES if (run_dir / name).exists())
            and path.exists()
        )
    rel = path.resolve().relative_to(run_dir.resolve()).parts
    return not rel or rel[0] == RUNS_SUBDIR or (len(rel) == 1 and rel[0] in RUN_FILES)


def check_file_output(
    out: str | Path,
    option: str,
    inputs: Iterable[str | Path] = (),
    run_dirs: Iterable[str | Path] = (),
) -> None:
    """Refuse a file to write that is one of ``inputs`` or a file of a run folder read.

    Another spelling, a symlink or a hard link of an input counts as the input.
    """
    out = Path(out)
    for src in inputs:
        if _same(out, Path(src)):
            raise PathError(f"{option} {out} is the input {src}: it would be overwritten")
    for run in run_dirs:
        if run_owned(out, run):
            raise PathError(
                f"{option} {out} is a file of the run folder {run} being read: "
                "write it somewhere else"
            )


def check_dir_output(
    out: str | Path,
    option: str,
    run_dirs: Iterable[str | Path] = (),
    inputs: Iterable[str | Path] = (),
    contain: bool = True,
) -> None:
    """Refuse a directory to write that is, is inside (or, with ``contain``, holds) a run read.

    ``inputs`` (files read) must not lie inside it either, when ``contain``.
    """
    out = Path(out)
    for run in run_dirs:
        run = Path(run)
        if _within(out, run) or (contain and _within(run, out)):
            raise PathError(
                f"{option} {out} overlaps the run folder {run} being read: "
                "write the new run folder somewhere else"
            )
    for src in inputs if contain else ():
        if _within(Path(src), out):
            raise PathError(f"{option} {out} holds the input {src}: choose another directory")


def run_folders_of(path: str | Path) -> list[Path]:
    """The run folders a file belongs to: ``<run>/runs/<name>/file`` → both; else none.

    A file outside a run folder (a prior.json kept on its own) is protected as an
    input file (``check_dir_output(inputs=…)``), not its whole folder.
    """
    path = Path(path)
    if path.parent.parent.name == RUNS_SUBDIR:
        return [path.parent, path.parent.parent.parent]
    return []


def mapped_name(name: str) -> str:
    """``name`` mapped to a safe file-name stem, for ids that must not be refused (Flower sites).

    Letters, digits, ``-``, ``_`` and ``.`` are kept, anything else becomes ``_``, a
    ``..`` becomes ``__`` and an empty or ``.`` name ``_``; the result always passes
    :func:`safe_name` (up to its length limit). Many-to-one: callers check that the
    names they write do not collide.
    """
    out = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).replace("..", "__")
    return "_" if out in ("", ".") else out

"""A fedcal tensor file read into NumPy arrays, without torch (issue 37.1).

The reader of :func:`fedcal.core.tensorfile.save_trees`'s files for an environment without
torch (a calibration station): the same safetensors bytes (``safetensors.numpy``), the same
checksum verified (SHA-256 over each tensor's name, torch dtype name, shape and bytes, then
the metadata), the same errors (:class:`TensorFileError`, naming the file). Equal to
:func:`fedcal.core.tensorfile.load_trees` value for value (tests/core/test_arrayfile.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedcal.core.paths import PathError, read_regular

FORMAT = "fedcal-trees/1"  # the model files' format (core/tensorfile.py writes it too)
META_KEY = "fedcal"
BLOB = "__blob__/"


class TensorFileError(ValueError):
    """A model or checkpoint file that cannot be used; ``str()`` names the file."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self):
        return (type(self), (self.path, self.problem))


def torch_dtype_name(array: np.ndarray) -> str:
    """The name torch gives ``array``'s dtype (``torch.float64``): the checksum hashes it."""
    return f"torch.{array.dtype.name}"


def digest(arrays: Mapping[str, np.ndarray], meta_text: str) -> str:
    """The SHA-256 a model file carries: the metadata, then each array's name, dtype (as torch
    names it), shape and bytes in name order — both writers' (core/tensorfile.py, the
    calibrate folder's) and the reader's."""
    h = hashlib.sha256(meta_text.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{torch_dtype_name(a)}|{tuple(int(n) for n in a.shape)}|".encode())
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes() if a.size else b"")
    return h.hexdigest()


def _rebuild(skeleton: Mapping, flat: Mapping[str, np.ndarray]) -> dict:
    return {
        k: _rebuild(v, flat) if isinstance(v, Mapping) else flat[v] for k, v in skeleton.items()
    }


def load_arrays(path: str | Path) -> tuple[dict[str, dict], dict[str, Any], dict[str, Any]]:
    """``(trees, meta, blobs)`` of a file written by ``save_trees``, leaves as NumPy arrays;
    verifies its checksum. Every problem is a :class:`TensorFileError` naming ``path``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    path = Path(path)
    try:  # a regular file within the size limit: a FIFO or /dev/zero is refused unread
        data = read_regular(path)
    except PathError as e:
        raise TensorFileError(path, str(e).removeprefix(f"{path}: ")) from None
    try:
        flat = load(data)
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
    except (SafetensorError, ValueError, OSError, RuntimeError, TypeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TensorFileError(
            path, f"not a fedcal tensor file, or truncated/corrupt ({first})"
        ) from None
    meta_text = header.get(META_KEY)
    if meta_text is None:
        raise TensorFileError(path, "not a fedcal tensor file (no fedcal metadata)")
    if header.get("sha256") != digest(flat, meta_text):
        raise TensorFileError(path, "corrupt: checksum mismatch (the file was altered or damaged)")
    try:
        info = json.loads(meta_text)
        if info.get("format") != FORMAT:
            raise TensorFileError(path, f"unsupported format {info.get('format')!r}")
        trees = {name: _rebuild(sk, flat) for name, sk in info["structure"].items()}
        blobs = {
            name.removeprefix(BLOB): json.loads(bytes(a).decode())
            for name, a in flat.items()
            if name.startswith(BLOB)
        }
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TensorFileError(path, f"corrupt metadata ({type(e).__name__}: {e})") from None
    if not isinstance(info["meta"], dict):
        raise TensorFileError(path, "corrupt metadata (meta is not a JSON object)")
    return trees, info["meta"], blobs

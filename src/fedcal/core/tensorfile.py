"""Trees of tensors on disk without pickle: safetensors plus JSON metadata and a checksum.

Model files and checkpoints are written with :func:`save_trees` and read with
:func:`load_trees`. The format is `safetensors <https://huggingface.co/docs/safetensors>`_
(chosen over ``torch.save``: reading a safetensors file parses a JSON header
and copies raw bytes, so a planted file can never run code, whereas
``torch.load`` unpickles). On top of it:

* trees (nested ``dict[str, Tensor]``) are flattened to ``"<tree>/<a>/<b>"``
  keys; the nesting, including empty sub-trees, is kept in the metadata;
* the caller's metadata is JSON; large JSON-able payloads (a run's history)
  go in ``blobs``, stored as uint8 tensors so the header stays small;
* a SHA-256 over every tensor's bytes and the metadata is stored and
  verified on read, so a bit flip anywhere in the data is a clear error
  rather than silently different numbers.

Every problem reading a file is a :class:`TensorFileError` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcal.core.arrayfile import (  # TensorFileError re-exported
    FORMAT,
    META_KEY,
    TensorFileError,
    digest,
    load_arrays,
)
from fedcal.core.atomic import write_bytes
from fedcal.core.tree import Tree

_BLOB = "__blob__/"


def _skeleton(tree: Mapping, prefix: str, flat: dict[str, Tensor]) -> dict:
    """The nesting of ``tree`` (leaves → their flat key) and its leaves, into ``flat``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or "/" in key:
            raise TypeError(f"tree keys must be str without '/', got {key!r}")
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out[key] = _skeleton(value, name, flat)
        elif isinstance(value, Tensor):
            # A fresh contiguous copy: safetensors refuses views and shared storage.
            flat[name] = value.detach().contiguous().clone()
            out[key] = name
        else:
            raise TypeError(f"tree leaf {name!r} is {type(value).__name__}, not a Tensor")
    return out


def _digest(tensors: Mapping[str, Tensor], meta_text: str) -> str:
    """The file's SHA-256: :func:`fedcal.core.arrayfile.digest` (the one checksum, what the
    reader verifies) of the tensors' NumPy views."""
    return digest({name: t.numpy() for name, t in tensors.items()}, meta_text)


def save_trees(
    path: str | Path,
    trees: Mapping[str, Tree],
    meta: Mapping[str, Any] | None = None,
    blobs: Mapping[str, Any] | None = None,
) -> None:
    """Write named trees, JSON metadata and JSON blobs to ``path``, atomically."""
    from safetensors.torch import save

    flat: dict[str, Tensor] = {}
    structure = {name: _skeleton(tree, name, flat) for name, tree in trees.items()}
    for name, value in (blobs or {}).items():
        data = json.dumps(value, allow_nan=True).encode()
        flat[_BLOB + name] = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    meta_text = json.dumps({"format": FORMAT, "structure": structure, "meta": dict(meta or {})})
    header = {META_KEY: meta_text, "sha256": _digest(flat, meta_text)}
    write_bytes(path, save(flat, metadata=header))


def load_trees(path: str | Path) -> tuple[dict[str, Tree], dict[str, Any], dict[str, Any]]:
    """``(trees, meta, blobs)`` of a file written by :func:`save_trees`; verifies its checksum.

    Read by :func:`fedcal.core.arrayfile.load_arrays` (the one reader: the same guards,
    checksum and one-line errors with or without torch), leaves as torch tensors."""
    trees, meta, blobs = load_arrays(path)
    return {name: _as_tensors(tree) for name, tree in trees.items()}, meta, blobs


def _as_tensors(tree: Mapping) -> Tree:
    # a copy: the reader's arrays may sit on a read-only buffer
    return {
        k: _as_tensors(v) if isinstance(v, Mapping) else torch.from_numpy(np.array(v))
        for k, v in tree.items()
    }


def check_finite(path: str | Path, trees: Mapping[str, Tree], what: str = "") -> None:
    """Refuse a tree with a NaN or infinite value, naming the file and the field.

    ``what`` prefixes each top-level key in the message (``"sensor "``).
    """

    def walk(tree: Mapping, name: str) -> None:
        for key, value in tree.items():
            field = f"{name}/{key}" if name else f"{what}{key!r}"
            if isinstance(value, Mapping):
                walk(value, field)
            elif (
                isinstance(value, Tensor)
                and value.is_floating_point()
                and not bool(torch.isfinite(value).all())
            ):
                raise TensorFileError(
                    path, f"{field} holds NaN or infinite values (a diverged or tampered model)"
                )

    walk(trees, "")

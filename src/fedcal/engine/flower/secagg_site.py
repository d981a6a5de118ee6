"""The site's side of SecAgg+ (:mod:`~fedcal.engine.flower.secagg`): its keys and shares
for steps 1, 2 and 4 (kept in its own secrets file between messages), and step 3, the
round message's statistics replaced by their masked fixed-point sum.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedcal.engine.flower.kinds import REFUSED, Stage
from fedcal.engine.flower.secagg import (
    SECAGG,
    Layout,
    _fernet_key,
    _pair_key,
    encode,
    pair_mask,
    prg,
)

if TYPE_CHECKING:
    from flwr.app import RecordDict


def _secrets_path(node_cfg: Mapping, run_id: int) -> Path:
    from fedcal.engine.flower.nodes import safe_name

    site = safe_name(str(node_cfg["site-id"]))
    return Path(str(node_cfg["state-dir"])) / f"{site}-run{run_id}-secagg.json"


def _save(path: Path, secrets: dict) -> None:
    from fedcal.core.atomic import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in secrets.items()})
    old = os.umask(0o177)  # the site's secrets: readable by its own user only
    try:
        write_text(path, text)
    finally:
        os.umask(old)


def _load(path: Path, t: int, stage: str) -> dict:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeError(f"secure aggregation: {stage} of round {t} before its setup") from None
    if raw.get("round") != t:
        raise RuntimeError(
            f"secure aggregation: {stage} of round {t}, setup was round {raw.get('round')}"
        )
    hexed = ("sk1", "pk1", "sk2", "pk2", "seed")
    return {k: bytes.fromhex(v) if k in hexed else v for k, v in raw.items()}


def site_stage(content: RecordDict, node_cfg: Mapping, run_id: int, node_id: int) -> RecordDict:
    """A site's answer to a setup, share-keys or unmask message (step 1, 2 or 4)."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common.secure_aggregation.crypto.shamir import create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt
    from flwr.supercore.primitives.asymmetric import (
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    cfg = content[SECAGG]
    stage, t = str(cfg["stage"]), int(cfg["round"])
    path = _secrets_path(node_cfg, run_id)
    if stage == Stage.SETUP:
        (sk1, pk1), (sk2, pk2) = generate_key_pairs(), generate_key_pairs()
        s = {
            "round": t,
            "me": node_id,
            "threshold": int(cfg["threshold"]),
            "neighbours": [int(n) for n in cfg["neighbours"]],
            "sk1": private_key_to_bytes(sk1),
            "pk1": public_key_to_bytes(pk1),
            "sk2": private_key_to_bytes(sk2),
            "pk2": public_key_to_bytes(pk2),
        }
        _save(path, s)
        return RecordDict({SECAGG: ConfigRecord({"pk1": s["pk1"], "pk2": s["pk2"]})})
    s = _load(path, t, stage)
    if stage == Stage.SHARE:
        ids = [int(n) for n in cfg["ids"]]
        keys = dict(zip(ids, zip(cfg["pk1"], cfg["pk2"], strict=True), strict=True))
        if keys.get(s["me"]) != (s["pk1"], s["pk2"]):
            raise ValueError("secure aggregation: the server relayed a wrong key for this site")
        if not set(ids) <= set(s["neighbours"]):
            raise ValueError(
                "secure aggregation: keys of sites that are not this site's neighbours"
            )
        if len(ids) < s["threshold"]:
            raise ValueError(
                f"secure aggregation: {len(ids)} neighbours, threshold {s['threshold']}"
            )
        if len({k for pair in keys.values() for k in pair}) != 2 * len(keys):
            raise ValueError("secure aggregation: two sites relayed with the same public key")
        seed = os.urandom(32)
        seed_shares = create_shares(seed, s["threshold"], len(ids))
        sk1_shares = create_shares(s["sk1"], s["threshold"], len(ids))
        dsts, ctxts, held = [], [], {}
        for n, b, k in zip(ids, seed_shares, sk1_shares, strict=True):
            if n == s["me"]:
                held[str(n)] = [b.hex(), k.hex()]
                continue
            plain = json.dumps({"src": s["me"], "dst": n, "b": b.hex(), "sk1": k.hex()}).encode()
            dsts.append(n)
            ctxts.append(encrypt(_fernet_key(s["sk2"], keys[n][1]), plain))
        s.update(
            seed=seed, keys={str(n): [a.hex(), b.hex()] for n, (a, b) in keys.items()}, held=held
        )
        _save(path, s)
        return RecordDict({SECAGG: ConfigRecord({"dsts": dsts, "ctxts": ctxts})})
    if stage == Stage.UNMASK:
        active = [int(n) for n in cfg["active"]]
        dead = [int(n) for n in cfg["dead"]]
        if set(active) & set(dead):
            raise ValueError(
                f"secure aggregation: {sorted(set(active) & set(dead))} both active and dead"
            )
        if len(active) < s["threshold"]:
            raise ValueError(
                f"secure aggregation: {len(active)} active neighbours, threshold {s['threshold']}"
            )
        held = s.get("held", {})
        missing = [n for n in active + dead if str(n) not in held]
        if missing:
            raise ValueError(f"secure aggregation: holds no share of sites {missing}")
        shares = [bytes.fromhex(held[str(n)][0]) for n in active]
        shares += [bytes.fromhex(held[str(n)][1]) for n in dead]
        path.unlink(missing_ok=True)  # the round is over for this site
        return RecordDict({SECAGG: ConfigRecord({"ids": active + dead, "shares": shares})})
    raise ValueError(f"secure aggregation: unknown stage {stage!r}")


def site_round(content: RecordDict, node_cfg: Mapping, run_id: int, run) -> RecordDict:
    """Step 3: the round message run by ``run`` (the site's round handler), its sensors'
    statistics replaced by their masked fixed-point sum.

    A sensor whose statistics or new private state are not finite is left out of the
    sum (as the server leaves such a reply out in a plain run); the others' indices
    travel in the clear (the server knows whom it asked to train).
    """
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt

    from fedcal.engine.flower.wire import join_parts, split_parts, to_numpy

    cfg = content[SECAGG]
    t = int(cfg["round"])
    s = _load(_secrets_path(node_cfg, run_id), t, Stage.COLLECT)
    if "seed" not in s:
        raise RuntimeError(f"secure aggregation: collect of round {t} before its key shares")
    keys = {int(n): (bytes.fromhex(a), bytes.fromhex(b)) for n, (a, b) in s["keys"].items()}
    held = dict(s["held"])
    sources = [int(n) for n in cfg["srcs"]]
    for src, ctxt in zip(sources, cfg["ctxts"], strict=True):
        shared = json.loads(decrypt(_fernet_key(s["sk2"], keys[src][1]), ctxt))
        if shared["src"] != src or shared["dst"] != s["me"]:
            raise ValueError(f"secure aggregation: a share from {shared['src']} relayed as {src}'s")
        held[str(src)] = [shared["b"], shared["sk1"]]
    if len(sources) + 1 < s["threshold"]:
        raise ValueError(
            f"secure aggregation: {len(sources)} neighbours left, threshold {s['threshold']}"
        )
    inner = RecordDict({k: v for k, v in content.items() if k != SECAGG})
    reply = run(inner, node_cfg, run_id)
    if REFUSED in reply:
        return reply
    layout = Layout.from_json(str(cfg["layout"]))
    parts, common, _ = split_parts(reply)
    included, stats = [], []
    for index in sorted(parts):
        part = parts[index]
        if "reply" not in part:
            continue
        leaves = {k: to_numpy(v) for k, v in part["reply"].items()}
        finite = all(np.isfinite(v).all() for v in leaves.values())
        if finite and part["info"].get("state-finite", True) is not False:
            included.append(int(index))
            stats.append(leaves)
        del part["reply"]  # the statistics leave the site only inside the masked sum
    vector = encode(layout, stats).view(np.uint64)
    with np.errstate(over="ignore"):
        vector = vector + prg(s["seed"], layout.size)
        for src in sources:  # the neighbours that shared keys with this site
            vector = vector + pair_mask(
                s["me"], src, _pair_key(s["sk1"], keys[src][0]), layout.size
            )
    s["held"] = held
    _save(_secrets_path(node_cfg, run_id), s)
    common = dict(common)
    common[SECAGG] = ConfigRecord({"included": included, "round": t})
    common[f"{SECAGG}-masked"] = ArrayRecord({"y": Array(np.ascontiguousarray(vector))})
    return join_parts(parts, common)

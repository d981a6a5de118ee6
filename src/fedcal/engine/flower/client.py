"""The client side of the Flower adapter: a site runs the client step for all its sensors at once.

A SuperNode serves a site (:mod:`~fedcal.engine.flower.nodes`): any number of
sensors. The handshake brings the run once — the algorithm's specification
(:mod:`~fedcal.engine.flower.spec`), the seed and the dtype — and the site keeps it
in ``<state-dir>/<site>-run<id>.json``; every round message builds the algorithm
from that file, so the round messages carry only the round. Round message
``t`` (see :mod:`~fedcal.engine.flower.server`) asks the site to

1. commit or roll back its last training round: the message says, per
   sensor, the last round whose reply the server used; a sensor whose pending
   state is from another round (reply lost, malformed or screened out) keeps
   its state from before that round — as the simulator does for a rejected
   reply;
2. evaluate round ``t − 1`` (if asked): ``personalize`` for all its sensors as
   one cohort, with the seeds of round ``t − 1``;
3. train round ``t`` for the sensors the message names: ``client_update`` on
   that cohort with each sensor's own seeds (:mod:`fedcal.engine.schedule`),
   exactly as the simulator runs its cohort (a cohort equals each client
   alone: the contract tests).

The reply holds one part per sensor (:func:`~fedcal.engine.flower.wire.join_parts`).
Private state never leaves the site: it lives in one file per site and run,
``<state-dir>/<site>-run<id>.safetensors``, written atomically after every
message (committed state, the pending state of the last training round,
personalized models and their evaluation). A SuperNode that crashes or
restarts resumes from it; a site with no file for this run (round 0, or a
site that joins late) starts from ``client_init`` of the broadcast it
received, i.e. the current global state.

The node decides what leaves it: a method whose declared uploads its node
config does not allow (:mod:`~fedcal.engine.flower.policy`) is answered with a
``refused`` record; nothing is trained and no state is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcal.core import hooks
from fedcal.data.scaling import needs_moments
from fedcal.engine.flower.kinds import CONTROL, REFUSED, SITE
from fedcal.engine.flower.nodes import SiteData, load_for_node, safe_name
from fedcal.engine.flower.policy import NodePolicy
from fedcal.engine.flower.spec import AlgorithmSpec
from fedcal.engine.flower.wire import (
    client_row,
    join_parts,
    metrics_to_record,
    record_to_tree,
    tree_to_record,
)

if TYPE_CHECKING:
    from flwr.app import RecordDict

    from fedcal.core.data import ClientData
    from fedcal.data.scaling import Scaler

STATE_FORMAT = "fedcal-site-state/1"
RUN_FORMAT = "fedcal-site-run/1"
_TREES = ("state", "pending", "personal")  # stacked (site sensors, ...); the last two optional


def answer_handshake(content: RecordDict, node_cfg: Mapping, run_id: int) -> RecordDict:
    """Per sensor: identity, train-row count and (only if scaling needs them) its sums.

    The handshake brings the run: the algorithm's specification, the seed and the
    dtype. The site keeps them in its run file (:func:`run_path`) for the round
    messages of this run, which do not repeat them.
    """
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    site = load_for_node(node_cfg)
    ctl = content[CONTROL]
    run = {
        "format": RUN_FORMAT,
        "algorithm": AlgorithmSpec.from_json(str(ctl["algorithm"])).to_json(),
        "seed": int(ctl["seed"]),
        "dtype": str(ctl["dtype"]),
    }
    policy = NodePolicy.from_node_config(node_cfg)  # a misconfigured node fails here, early
    mode = str(ctl["scaling"])
    moments = needs_moments(site.features, site.target, mode, not site.classification)
    if moments and policy.refuses_kind("statistics"):
        why = (
            "refused to send its scaling sums (n, Σx, Σx²): statistics not allowed by its "
            f"node config ({policy.describe('allow-uploads')})"
        )
        return RecordDict({REFUSED: ConfigRecord({"reason": why, "site-id": site.site_id})})
    parts = {}
    for k, (sensor, index) in enumerate(zip(site.sensor_ids, site.client_indices, strict=True)):
        info = {
            "sensor-id": sensor,
            "client-index": index,
            "num-clients": site.num_clients,
            "num-train": site.num_train[k],
            "features": json.dumps(list(site.features)),
            "target": site.target,
            "classification": site.classification,
            "num-classes": site.num_classes,
        }
        part = RecordDict({"info": ConfigRecord(info)})
        if moments:
            part["moments"] = ArrayRecord({n: Array(v) for n, v in site.moments(k).items()})
        parts[index] = part
    save_run(run_path(node_cfg["state-dir"], site.site_id, run_id), run)
    return join_parts(parts, {SITE: ConfigRecord({"site-id": site.site_id})})


# ----------------------------------------------------------------------------
# the site's run file (from the handshake) and state file (after every message)
# ----------------------------------------------------------------------------
def run_path(state_dir: str | Path, site_id: str, run_id: int) -> Path:
    return Path(state_dir) / f"{safe_name(site_id)}-run{run_id}.json"


def save_run(path: Path, run: Mapping[str, Any]) -> None:
    from fedcal.core.atomic import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(run, sort_keys=True))


def load_run(path: Path) -> tuple[AlgorithmSpec, int, str]:
    """``(algorithm spec, seed, dtype)`` of a run, as its handshake told the site."""
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise RuntimeError(
            f"{path}: no run file; the site got a round message before this run's handshake"
        ) from None
    if not isinstance(run, dict) or run.get("format") != RUN_FORMAT:
        raise ValueError(f"{path}: not a fedcal site run file")
    return AlgorithmSpec.from_json(run["algorithm"]), int(run["seed"]), str(run["dtype"])


def state_path(state_dir: str | Path, site_id: str, run_id: int) -> Path:
    return Path(state_dir) / f"{safe_name(site_id)}-run{run_id}.safetensors"


def save_state(path: Path, trees: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Write atomically, tensors and JSON only (:mod:`fedcal.core.tensorfile`, no pickle)."""
    from fedcal.core.tensorfile import save_trees

    path.parent.mkdir(parents=True, exist_ok=True)
    kept = {k: v for k, v in trees.items() if v is not None}
    save_trees(path, kept, {"format": STATE_FORMAT, **meta})


def load_state(path: str | Path) -> dict:
    """A site's state: its meta plus ``state``/``pending``/``personal`` trees (None if absent).

    A damaged or foreign file is a ValueError naming it.
    """
    from fedcal.core.tensorfile import load_trees

    trees, meta, _ = load_trees(path)
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{path}: not a fedcal site state file")
    return {**meta, **{k: trees.get(k) for k in _TREES}}


# ----------------------------------------------------------------------------
# a round message
# ----------------------------------------------------------------------------
def _cohort_data(
    rows, scaler: Scaler, dtype, indices: tuple[int, ...], branch=None, time=None
) -> ClientData:
    from dataclasses import replace

    from fedcal.core.data import ClientData

    # The same NumPy ops on the same float64 rows as engine.simulation.prepare; ``branch``
    # the rows' sweep signs from the site file (None without a direction column), ``time``
    # their times (None without a time column; unscaled, as the simulator's).
    scaled = [(scaler.x(x), scaler.y(y)) for x, y in rows]
    data = ClientData.from_arrays(scaled, dtype=dtype, branch=branch, time=time)
    return replace(data, index=indices)


def _refused(site: SiteData, reason: str, t: int) -> RecordDict:
    from flwr.app import ConfigRecord, RecordDict

    record = {"reason": reason, "site-id": site.site_id, "round": t}
    return RecordDict({REFUSED: ConfigRecord(record)})


@dataclass
class _SiteState:
    """A site's private trees and bookkeeping between messages (its state file)."""

    state: Any  # committed private state, one row per sensor
    pending: Any  # the last training round's new state, until the server's verdict
    pending_round: list[int]  # per sensor: round of its row of "pending" (-1: none)
    trained: list[int]  # per sensor: last round whose update is in "state"
    personal: Any  # personalized models of the last evaluation
    personal_round: int
    evals: list[dict]  # per sensor: the last evaluation's metrics
    joined: int  # the round the site joined at


def run_round(content: RecordDict, node_cfg: Mapping, run_id: int) -> RecordDict:
    """A site's work on round message ``t``: commit ``t − 1``, evaluate it, train ``t``.

    Returns the reply content: one part per sensor (``info`` always; ``eval``
    if evaluated; ``reply`` and ``train`` if trained) and a ``site`` record.
    """
    import torch
    from flwr.app import ConfigRecord

    from fedcal.data.scaling import Scaler
    from fedcal.engine.simulation import DTYPES

    torch.set_num_threads(1)
    ctl = content[CONTROL]
    t, eval_round = int(ctl["round"]), int(ctl["eval-round"])
    site = load_for_node(node_cfg)
    spec, seed, dtype = load_run(run_path(node_cfg["state-dir"], site.site_id, run_id))
    method, dtype = spec.method, DTYPES[dtype]
    scaler = Scaler.from_dict(json.loads(str(ctl["scaler"])))
    alg = hooks.with_scaler(spec.build(len(site.features), site.num_classes), scaler)
    # The node decides what leaves it, whatever the server asks (see policy.py): a refused
    # request trains nothing, sends nothing of the data and leaves the state untouched.
    refusal = NodePolicy.from_node_config(node_cfg).refusal(method, alg.name, type(alg).uploads)
    if refusal is not None:
        return _refused(site, refusal, t)
    indices = site.client_indices
    train_indices = [int(i) for i in ctl["train"]]
    foreign = [i for i in train_indices if i not in indices]
    if foreign:
        raise ValueError(f"site {site.site_id}: asked to train clients {foreign}, not its sensors")
    down = record_to_tree(content["down"])
    path = state_path(node_cfg["state-dir"], site.site_id, run_id)
    st = _site_state(path, site, t, alg, down)
    # 1. The server's verdict on the last training round: keep what it used, drop the rest.
    _commit(st, dict(zip(ctl["accepted-index"], ctl["accepted-round"], strict=True)), indices)
    parts: dict[int, dict] = {i: {} for i in indices}  # one RecordDict for all, at the end
    train_data = _cohort_data(
        site.train, scaler, dtype, indices, site.train_branch, site.train_time
    )
    # 2. Evaluate round t − 1: the broadcast of message t is the server after round t − 1.
    finite = None
    if eval_round >= 0:
        test_data = _cohort_data(
            site.test, scaler, dtype, indices, site.test_branch, site.test_time
        )
        evaluated = (down, train_data, test_data, scaler, seed, eval_round)
        finite = _evaluate(st, alg, evaluated, indices, parts)
    # 3. Train round t for the sensors asked; the new state stays pending until the verdict.
    state_ok = _train(st, alg, down, train_data, train_indices, indices, seed, t, parts)
    for k, index in enumerate(indices):
        info: dict[str, Any] = {
            "sensor-id": site.sensor_ids[k],
            "client-index": index,
            "round": t,
            "num-train": site.num_train[k],
        }
        if index in state_ok:
            info["state-finite"] = state_ok[index]
        if eval_round >= 0:
            info["personal-finite"] = bool(finite[k])
        parts[index]["info"] = ConfigRecord(info)
    meta = {
        "run_id": int(run_id),
        "site_id": site.site_id,
        "sensor_ids": list(site.sensor_ids),
        "client_indices": list(indices),
        "method": method,
        "message_round": t,
        "joined": st.joined,
        "trained_round": st.trained,  # per sensor: last round whose update is in "state"
        "pending_round": st.pending_round,  # per sensor: round of its row of "pending" (-1: none)
        "personal_round": st.personal_round,
        "eval": st.evals,
    }
    trees = {"state": st.state, "pending": st.pending, "personal": st.personal}
    save_state(path, trees, meta)
    return join_parts(parts, {SITE: ConfigRecord({"site-id": site.site_id, "round": t})})


def _site_state(path: Path, site: SiteData, t: int, alg, down) -> _SiteState:
    """The private trees: from the site's file, else new from this broadcast (round 0 or
    late)."""
    from fedcal.core.tree import expand

    n = len(site.client_indices)
    if not path.exists():
        state = alg.client_init(expand(down, n))
        return _SiteState(state, None, [-1] * n, [-1] * n, None, -1, [{}] * n, t)
    saved = load_state(path)
    if list(saved["sensor_ids"]) != list(site.sensor_ids):
        raise ValueError(f"{path}: holds sensors {saved['sensor_ids']}, not this site's")
    if int(saved["message_round"]) >= t:
        raise RuntimeError(
            f"site {site.site_id}: got round {t} after round {saved['message_round']} "
            "(out of order)"
        )
    return _SiteState(
        saved["state"],
        saved["pending"],
        list(saved["pending_round"]),
        list(saved["trained_round"]),
        saved["personal"],
        int(saved["personal_round"]),
        list(saved["eval"]),
        int(saved["joined"]),
    )


def _commit(st: _SiteState, last_used: Mapping[int, int], indices: list[int]) -> None:
    """Step 1: the pending rows of the round the server used become the state; the others
    are dropped (the state from before that round stays)."""
    import torch

    from fedcal.core.tree import gather, scatter

    if st.pending is None:
        return
    n = len(indices)
    keep = [k for k in range(n) if 0 <= st.pending_round[k] == last_used.get(indices[k], -1)]
    if keep:
        rows = torch.tensor(keep)
        st.state = scatter(st.state, rows, gather(st.pending, rows))
        for k in keep:
            st.trained[k] = st.pending_round[k]
    st.pending, st.pending_round = None, [-1] * n


def _evaluate(st: _SiteState, alg, evaluated: tuple, indices: list[int], parts: dict) -> Any:
    """Step 2: every sensor's personalized model after round ``eval_round`` scored (and its
    per-unit columns); the parts' ``eval`` (and ``units``) records; each model's finite flag."""
    import torch

    from fedcal.engine.evaluation import evaluate_cohort
    from fedcal.engine.schedule import personalize_seeds

    down, train_data, test_data, scaler, seed, eval_round = evaluated
    seeds = personalize_seeds(seed, eval_round, indices)
    scored = evaluate_cohort(alg, down, st.state, train_data.with_seeds(seeds), test_data, scaler)
    st.personal, finite = scored.personal, scored.finite
    st.evals = []
    for k, index in enumerate(indices):
        row = {f"test_{name}": float(v[k]) for name, v in scored.test.items()}
        row.update({f"train_{name}": float(v[k]) for name, v in scored.train.items()})
        parts[index]["eval"] = metrics_to_record(row)
        st.evals.append(row)
    if isinstance(alg, hooks.UnitColumns):  # e.g. fedprior_drift's recalibrate_at
        with torch.no_grad():
            columns = alg.unit_columns(st.personal, train_data)
        for k, index in enumerate(indices):
            per_unit = {name: float(v[k]) for name, v in columns.items()}
            parts[index]["units"] = metrics_to_record(per_unit)
    st.personal_round = eval_round
    return finite


def _train(
    st: _SiteState,
    alg,
    down,
    train_data: ClientData,
    train_indices: list[int],
    indices: list[int],
    seed: int,
    t: int,
    parts: dict,
) -> dict[int, bool]:
    """Step 3: round ``t``'s client update of the sensors asked; the new state pending, the
    parts' ``reply`` and ``train`` records; per sensor trained, whether its state is finite."""
    import torch

    from fedcal.core.aggregation import finite_rows
    from fedcal.core.tree import expand, gather, scatter
    from fedcal.engine.schedule import train_seeds

    state_ok: dict[int, bool] = {}
    if not train_indices:
        return state_ok
    position = {index: k for k, index in enumerate(indices)}
    rows = torch.tensor([position[i] for i in train_indices])
    seeds = train_seeds(seed, t, train_indices)
    data = train_data.select(rows).with_seeds(seeds)
    result = alg.client_update(expand(down, len(train_indices)), gather(st.state, rows), data)
    st.pending = scatter(st.state, rows, result.state)
    ok = finite_rows(result.state)
    for j, index in enumerate(train_indices):
        st.pending_round[position[index]] = t
        parts[index]["reply"] = tree_to_record(client_row(result.reply, j))
        parts[index]["train"] = metrics_to_record({m: v[j] for m, v in result.metrics.items()})
        state_ok[index] = bool(ok[j]) if ok.numel() else True
    return state_ok

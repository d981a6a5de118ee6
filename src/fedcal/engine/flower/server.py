"""The server side of the Flower adapter: sites in, one federation of sensors out.

A run is a handshake followed by ``rounds + 1`` round messages. The handshake
asks each SuperNode which sensors its site serves (identity, train-row count
and, only if scaling needs them, each sensor's sums). Message ``t``
(``t = 0 … rounds``) carries the broadcast of the current server tree and
asks each site to evaluate round ``t − 1`` for all its sensors (when the
simulator would, :func:`fedcal.engine.schedule.evaluates`) and to train round
``t`` for those of its sensors in the round's cohort
(:func:`fedcal.engine.schedule.cohort`). It also tells the site, per sensor,
the last round whose reply the server used, so the site commits those updates
and rolls the others back (:mod:`~fedcal.engine.flower.client`).

The server splits each site's reply into per-sensor parts, checks each part
against what an honest client would send
(:mod:`~fedcal.engine.flower.validation`), stacks the good ones in client-index
order across sites and calls the simulator's aggregation step (screening,
clipping, the algorithm's ``server_update``) with the train-row counts as
weights: the simulator's numbers, however the sensors are spread over sites.

Nodes come and go. A site that fails a message (crash, timeout) sits out that
round only and is asked again the next; its state is on its disk. A node
that connects after round 0 is greeted with the handshake at the next round
and its sensors join from ``client_init`` of the then-current global state. A
node that *refuses* the method (its policy) is left out for the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedcal.core.hooks import UnitColumns, before_round, with_scaler  # fedprior's hooks
from fedcal.data.scaling import scaler_from_moments
from fedcal.engine.flower.kinds import CONTROL, REFUSED
from fedcal.engine.flower.wire import tree_to_record

if TYPE_CHECKING:
    from flwr.app import RecordDict

    from fedcal.core.aggregation import AggregationPolicy
    from fedcal.engine.flower.secagg import Layout, SecureAggregation, SecureSum
    from fedcal.engine.flower.spec import AlgorithmSpec


@dataclass(frozen=True)
class Member:
    """A sensor as the handshake told the server: which node (site) serves it."""

    node_id: int
    sensor_id: str
    client_index: int
    num_train: int


@dataclass
class Federation:
    """The server's side of a run: handshake → messages per round → aggregation.

    Transport-free: the ServerApp delivers what :meth:`messages` returns and
    hands the replies to :meth:`absorb`; tests can do the same in-process.
    It runs a built algorithm: ``spec`` (sent to every site in the handshake) and
    the aggregation ``policy``; the schedule is the simulator's
    (:class:`fedcal.engine.settings.EngineSettings`' fields). The application
    that reads a configuration builds them (:mod:`fedcal.apps.flower_server`).
    """

    spec: AlgorithmSpec
    policy: AggregationPolicy
    scaling: str  # the data's scaling mode (fedcal.data.scaling)
    seed: int = 0
    rounds: int = 50
    dtype: str = "float32"
    eval_every: int | str = 1  # or "auto" ([engine] eval_every: by the units registered)
    participation: float = 1.0
    min_replies: int = 1  # fewer train replies in a round → the run fails
    # more of a round's replies refused than this share → the run fails ([engine], issue 36.4)
    max_rejected_share: float = 0.5
    # SecAgg+ of the summed statistics (fedcal.engine.flower.secagg); None: plain replies
    secure: SecureAggregation | None = None
    members: dict[int, Member] = field(default_factory=dict)  # by client index
    history: list[dict] = field(default_factory=list)
    log: list[dict] = field(default_factory=list)
    # message round → client index → why it did not take part (its node failed or refused)
    failed: dict[str, dict[int, str]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # node id → why (refused the method)
    # message round → client index → why its reply (or part of it) was not used
    rejected: dict[str, dict[int, str]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # handshake refusals, by node id
    handshake_rejected: dict[str, str] = field(default_factory=dict)  # malformed, by node id
    joined: dict[str, int] = field(default_factory=dict)  # node id → round it joined at

    def __post_init__(self) -> None:
        self._train_metrics: dict[int, dict[int, dict]] = {}
        self._final: list[dict] = []  # final_row of each client evaluated after the last round
        # the algorithm's per-unit columns of that evaluation (unit_columns: recalibrate_at)
        self._units: dict[int, dict[str, float]] = {}
        self.last_used: dict[int, int] = {}  # client index → last round its reply was used
        self.rejected_rounds: dict[int, int] = {}  # client index → rounds screened out
        self.num_clients = 0
        self.num_features = 0
        self.shape: dict[str, Any] = {}
        self.server = None
        self.algorithm = None
        self.scaler = None
        self.secure_sum: SecureSum | None = None  # the round's unmasked sum (secure runs)
        self.secure_sums: dict[int, SecureSum] = {}  # by round: what the server learned

    @property
    def method(self) -> str:
        return self.spec.method

    # -- handshake ----------------------------------------------------------
    def handshake_content(self) -> RecordDict:
        from flwr.app import ConfigRecord, RecordDict

        ctl = {
            "scaling": self.scaling,
            "algorithm": self.spec.to_json(),
            "seed": self.seed,
            "dtype": self.dtype,
        }
        return RecordDict({CONTROL: ConfigRecord(ctl)})

    def known_nodes(self) -> set[int]:
        """Nodes that answered a handshake (members, refusing or rejected ones)."""
        known = {m.node_id for m in self.members.values()}
        return known | {int(n) for n in (*self.refused, *self.handshake_rejected)}

    def _read_handshakes(self, replies: Mapping[int, RecordDict]) -> dict[int, list]:
        """Node id → [(client index, its part)] of usable handshakes; the rest is recorded."""
        from fedcal.engine.flower.handshakes import read_handshakes

        return read_handshakes(replies, self.scaling, self.refused, self.handshake_rejected)

    def _admit(self, nid: int, parts: list, online: set[int] | None) -> str | None:
        """Add a node's sensors as members; why not, if they cannot be."""
        mine = [{k: part["info"][k] for k in self.shape} for _, part in parts]
        if any(m != self.shape for m in mine):
            return f"node {nid} holds different data ({mine[0]}) than the run ({self.shape})"
        for index, _ in parts:
            held = self.members.get(index)
            if (
                held is not None
                and held.node_id != nid
                and (online is None or held.node_id in online)
            ):
                return (
                    f"client index {index} claimed by node {nid} and node {held.node_id}: "
                    "each sensor belongs to one site"
                )
        for index, part in parts:  # a sensor whose node went away may move to this node
            info = part["info"]
            self.members[index] = Member(nid, str(info["sensor-id"]), index, int(info["num-train"]))
        self.members = dict(sorted(self.members.items()))
        return None

    def register(self, replies: Mapping[int, RecordDict]) -> None:
        """The first handshake: map sensors to nodes, fit the scaler, initialise the server.

        A node that refuses (its scaling sums) or sends a malformed handshake
        is left out of the run and reported (:attr:`refused`,
        :attr:`handshake_rejected`).
        """
        import torch

        from fedcal.engine.flower.handshakes import fleet_moments
        from fedcal.engine.simulation import DTYPES

        if not replies:
            raise RuntimeError("no SuperNode answered the handshake")
        usable = self._read_handshakes(replies)
        if not usable:
            raise RuntimeError(
                "no usable handshake: "
                + "; ".join([*self.refused.values(), *self.handshake_rejected.values()])
            )
        first = next(iter(usable.values()))[0][1]["info"]
        keys = ("features", "target", "classification", "num-classes", "num-clients")
        self.shape = {k: first[k] for k in keys}
        claimed: dict[int, int] = {}
        for nid, parts in usable.items():
            for index, _ in parts:
                if index in claimed:
                    raise RuntimeError(
                        f"client index {index} claimed by nodes {claimed[index]} and {nid}: "
                        "each sensor belongs to one site (one site file per SuperNode)"
                    )
                claimed[index] = nid
            why = self._admit(nid, parts, None)
            if why is not None:
                raise RuntimeError(why)
            self.joined[str(nid)] = 0
        self.num_clients = int(self.shape["num-clients"])
        features = tuple(json.loads(str(self.shape["features"])))
        target, classification = str(self.shape["target"]), bool(self.shape["classification"])
        refusals = [*self.refused.values(), *self.handshake_rejected.values()]
        columns = (features, target, classification)
        moments = fleet_moments(
            usable, self.members, self.scaling, columns, self.policy.dp, self.num_clients, refusals
        )
        self.scaler = scaler_from_moments(
            features, target, moments, self.scaling, not classification
        )
        algorithm = self.spec.build(len(features), self.shape["num-classes"])
        self.algorithm = with_scaler(algorithm, self.scaler)  # e.g. fedprior's raw_map
        if self.secure is not None:
            from fedcal.engine.flower.secagg import refusal

            why = refusal(self.algorithm, self.policy, self.secure)
            if why is not None:
                raise RuntimeError(why)
        if self.algorithm.one_shot:  # closed form: one round, as the simulator runs it
            self.rounds = 1
        self.num_features = len(features)
        gen = torch.Generator().manual_seed(self.seed)
        params = self.algorithm.task.model.init(gen, DTYPES[self.dtype])
        self.server = self.algorithm.server_init(params)

    def admit(self, t: int, replies: Mapping[int, RecordDict], online: set[int]) -> list[int]:
        """A later handshake (a node that connected after round 0); returns the admitted nodes.

        Its sensors take part from message ``t`` on; the scaler stays the one of
        round 0. A node claiming a sensor another online node serves is rejected.
        """
        admitted = []
        for nid, parts in self._read_handshakes(replies).items():
            why = self._admit(nid, parts, online)
            if why is not None:
                self.handshake_rejected[str(nid)] = why
            else:
                self.joined[str(nid)] = t
                admitted.append(nid)
        return admitted

    # -- rounds ---------------------------------------------------------------
    def evaluates(self, t: int) -> bool:
        """Whether round ``t`` (0-based) is evaluated (as the simulator decides)."""
        from fedcal.engine.schedule import evaluates

        return evaluates(t, self.rounds, self.eval_every, self.num_clients)  # "auto": by units

    def eval_round(self, t: int) -> int:
        """The round message ``t`` evaluates (-1: none)."""
        return t - 1 if t > 0 and self.evaluates(t - 1) else -1

    def cohort(self, t: int) -> list[int]:
        from fedcal.engine.schedule import cohort

        return cohort(self.seed, t, self.num_clients, self.participation).tolist()

    def sites(self) -> dict[int, list[int]]:
        """Node id → client indices of the sensors it serves (sorted)."""
        out: dict[int, list[int]] = {}
        for index, m in self.members.items():
            out.setdefault(m.node_id, []).append(index)
        return out

    def messages(self, t: int, online: set[int] | None = None) -> dict[int, RecordDict]:
        """Round message ``t`` for each targeted site (``t == rounds``: evaluation only)."""
        from flwr.app import ConfigRecord, RecordDict

        training = set(self.cohort(t)) if t < self.rounds else set()
        eval_round = self.eval_round(t)
        self.server = before_round(self.algorithm, self.server, t, self.rounds, self.num_clients)
        down = tree_to_record(self.algorithm.broadcast(self.server))
        common = {
            "round": t,
            "eval-round": eval_round,
            "scaler": json.dumps(self.scaler.to_dict()),
        }
        out = {}
        for nid, indices in self.sites().items():
            if str(nid) in self.dropped or (online is not None and nid not in online):
                continue
            train = [i for i in indices if i in training]
            if t == 0 or train or eval_round >= 0:
                ctl = {
                    **common,
                    "train": train,
                    "accepted-index": indices,
                    "accepted-round": [self.last_used.get(i, -1) for i in indices],
                }
                out[nid] = RecordDict({CONTROL: ConfigRecord(ctl), "down": down})
        return out

    def secure_layout(self) -> Layout:
        """The summed vector of this round's statistics (secure runs): the honest reply's
        leaves and shapes (:func:`~fedcal.engine.flower.validation.expected_reply`)."""
        from fedcal.engine.flower.secagg import MAX_SENSORS, Layout
        from fedcal.engine.flower.validation import expected_reply
        from fedcal.engine.simulation import DTYPES

        if len(self.members) > MAX_SENSORS:
            raise RuntimeError(
                f"secure aggregation sums at most {MAX_SENSORS} sensors exactly in 64 bits; "
                f"this run has {len(self.members)}"
            )
        spec = expected_reply(
            self.algorithm, self.server, self.scaler, self.num_features, DTYPES[self.dtype]
        )
        return Layout.of({k: shape for k, (_, shape) in spec.leaves.items()}, self.secure)

    def absorb(
        self,
        t: int,
        sent: Mapping[int, RecordDict],
        replies: Mapping[int, RecordDict],
        failures: Mapping[int, str],
    ) -> None:
        """Fold in the replies to message ``t``: evaluation rows of ``t − 1``, then training.

        A site that failed sits out this round only; one that refuses the method
        is left out for the run. Every sensor's part is checked against
        :func:`expected_reply` first; a malformed one (or its malformed part) is
        left out of this round only and recorded in :attr:`rejected`. A sensor's
        weight is the train-row count it claims, capped at the count it declared
        at the handshake.
        """
        from fedcal.engine.flower.replies import claimed_rows, site_parts
        from fedcal.engine.flower.validation import expected_reply
        from fedcal.engine.simulation import DTYPES

        failures = dict(failures)
        for nid, rep in replies.items():
            if REFUSED in rep:
                failures[nid] = f"node {nid} {rep['refused'].get('reason', 'refused')}"
                self.dropped[str(nid)] = failures[nid]
        sites = self.sites()
        self.failed[str(t)] = {i: why for n, why in failures.items() for i in sites.get(n, [])}
        rejected: dict[int, str] = {}
        parts = site_parts(replies, failures, sites, self.members, rejected)
        claimed = claimed_rows(parts, rejected)
        parts = {i: p for i, p in parts.items() if i in claimed}
        spec = expected_reply(
            self.algorithm, self.server, self.scaler, self.num_features, DTYPES[self.dtype]
        )
        if self.eval_round(t) >= 0:
            self._absorb_eval(self.eval_round(t), parts, spec, rejected)
        if t >= self.rounds:
            if rejected:
                self.rejected[str(t)] = rejected
            return
        asked = sorted(i for n in sent for i in sent[n][CONTROL]["train"])
        if self.secure is not None:
            self._absorb_secure(t, asked, parts, claimed, rejected)
        else:
            self._absorb_train(t, asked, parts, claimed, spec, rejected)

    def _absorb_eval(
        self, eval_round: int, parts: Mapping[int, RecordDict], spec, rejected: dict[int, str]
    ) -> None:
        """Round ``eval_round``'s evaluation rows into the history (and the final rows and
        per-unit columns after the last round); a malformed one is rejected."""
        from fedcal.engine.flower.replies import eval_row
        from fedcal.engine.schedule import final_row, history_row

        trained = self._train_metrics.get(eval_round, {})
        names = list(dict.fromkeys(k for mets in trained.values() for k in mets))
        last = eval_round == self.rounds - 1
        columns = last and isinstance(self.algorithm, UnitColumns)
        for index in sorted(parts):
            m = self.members[index]
            row, units, why = eval_row(parts[index], spec, index, m.sensor_id, columns)
            if why is not None:
                rejected[index] = why
                continue
            if columns:
                self._units[index] = units
            rejected_rounds = self.rejected_rounds.get(index, 0)
            self.history.append(
                history_row(row, eval_round + 1, rejected_rounds, trained.get(index, {}), names)
            )
            if last:
                self._final.append(final_row(row, rejected_rounds))

    def _logged(self, t: int, entry: dict[str, Any], rejected: Mapping[int, str]) -> None:
        """The round's log entry, with its rejections (also in :attr:`rejected`)."""
        if rejected:
            self.rejected[str(t)] = rejected
            entry["rejected"] = {str(i): why for i, why in sorted(rejected.items())}
        self.log.append(entry)

    def _absorb_secure(
        self, t: int, asked: list[int], parts: Mapping, claimed, rejected: dict[int, str]
    ) -> None:
        """Round ``t``'s training from the unmasked sum (:func:`replies.secure_update`)."""
        from fedcal.engine.flower.replies import secure_update

        entry: dict[str, Any] = {"round": t, "asked": asked}
        self._logged(t, entry, rejected)
        out = self.secure_sum
        if out is None:
            raise RuntimeError(f"round {t}: a secure run without its secure sum")
        self.secure_sums[t] = out
        self.server, done, left = secure_update(
            self.algorithm, self.server, out, self.sites(), claimed, t, entry
        )
        for i in done:
            self.last_used[i] = t
        for i in left:  # its group was left out: its site rolls its state back
            self.rejected_rounds[i] = self.rejected_rounds.get(i, 0) + 1
        self._check_replies(t, done + left, rejected)
        self._check_refused(t, asked, rejected, set(left))
        self._train_metrics[t] = {i: dict(parts[i]["train"]) for i in done + left if i in parts}

    def _absorb_train(
        self,
        t: int,
        asked: list[int],
        parts: Mapping[int, RecordDict],
        claimed: Mapping[int, int],
        spec,
        rejected: dict[int, str],
    ) -> None:
        """Round ``t``'s checked replies aggregated (the simulator's step) into the server;
        each reply used or screened out, as the round's log says."""
        import torch

        from fedcal.core.data import client_round_seed
        from fedcal.core.tree import num_bytes
        from fedcal.engine.flower.replies import aggregate, checked_uploads, stack_padded
        from fedcal.engine.flower.validation import capped_weight
        from fedcal.engine.settings import refused_clients
        from fedcal.engine.simulation import AGGREGATION

        uploads = checked_uploads(asked, parts, spec, self.members, self.sites(), rejected)
        done = sorted(uploads)
        entry: dict[str, Any] = {"round": t, "asked": asked, "trained": done}
        self._logged(t, entry, rejected)
        self._check_replies(t, done, rejected)
        if not done:
            return
        self._train_metrics[t] = {i: dict(parts[i]["train"]) for i in done}
        stacked = stack_padded([uploads[i] for i in done])
        weights = torch.tensor(
            [capped_weight(self.members[i].num_train, claimed[i]) for i in done],
            dtype=torch.float64,
        )
        eligible = torch.tensor(
            [parts[i]["info"].get("state-finite", True) is not False for i in done]
        )
        seed = client_round_seed(self.seed, t, 0, AGGREGATION)
        record: list[dict] = []
        self.server, accepted, agg = aggregate(
            self.algorithm, self.server, stacked, weights, self.policy, seed, eligible, record
        )
        entry["aggregation"] = agg
        if record:  # why each reply was screened out: client, reason, ratio vs threshold
            entry["screening"] = [
                {**{k: v for k, v in r.items() if k != "client"}, "client": done[r["client"]]}
                for r in record
            ]
        screened = [i for i, ok in zip(done, accepted.tolist(), strict=True) if not ok]
        for i, ok in zip(done, accepted.tolist(), strict=True):
            if ok:  # its site commits this round's state at the next message
                self.last_used[i] = t
            else:  # its site rolls its state back (as the simulator does)
                self.rejected_rounds[i] = self.rejected_rounds.get(i, 0) + 1
        if screened:
            entry["screened"] = screened
        entry["bytes_up"] = num_bytes(stacked, per_client_axis=True) * len(done)
        self._check_refused(t, asked, rejected, {done[i] for i in refused_clients(record)})

    def _check_refused(
        self, t: int, asked: list[int], rejected: Mapping[int, str], screened: set[int]
    ) -> None:
        """Stop the run (one line) when the server refused more than ``max_rejected_share``
        of the round's replies: malformed or inconsistent ones and those its checks screened
        out or down-weighted (:func:`fedcal.engine.settings.mostly_refused`); a site that
        failed or is offline is not refused, it is missing (``min_replies``)."""
        from fedcal.engine.settings import mostly_refused

        failed = self.failed.get(str(t), {})
        replied = [i for i in asked if i not in failed]
        refused = {i for i in replied if i in rejected} | screened
        mostly_refused(t, len(refused), len(replied), self.max_rejected_share)

    def _check_replies(self, t: int, done: list[int], rejected: Mapping[int, str]) -> None:
        """Required: min-replies out of the round's cohort (:func:`replies.enough_replies`)."""
        from fedcal.engine.flower.replies import enough_replies

        planned = [i for i in self.cohort(t) if i in self.members]
        failed = self.failed[str(t)]
        enough_replies(t, done, planned, self.members, failed, rejected, self.min_replies)

    def final_rows(self) -> list[dict]:
        """The last evaluation per client (the simulator's ``final``, the same columns)."""
        return list(self._final)

    def unit_columns(self) -> dict[int, dict[str, float]]:
        """Per client index, the algorithm's per-unit columns at the last evaluation
        (:class:`~fedcal.core.hooks.UnitColumns`, e.g. ``recalibrate_at``:
        what ``fedcal run`` adds to per_sensor.csv), as its site computed them."""
        return {i: dict(v) for i, v in sorted(self._units.items())}

    def sensors(self) -> dict[str, str]:
        return {str(i): m.sensor_id for i, m in self.members.items()}

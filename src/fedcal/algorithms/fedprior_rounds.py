"""The fleet prior's rounds at a manufacturer's scale (issue 36.1): what travels when.

Three settings of :class:`~fedcal.algorithms.fedprior.FedPrior` decide which of a round's
uploads a unit computes and sends; every one of them is 0 / "every" by default (every
candidate every round, the hold-out every round, a fixed number of rounds: the run as before).

R1. **The basis chosen once** (``select_patience`` = k > 0, with ``select = "bic"``). The
    candidates' EMs run as before, every candidate's statistics in every unit's upload, until
    the server's BIC choice has been the same candidate for k rounds in a row. Then the
    choice is frozen: the server drops the candidates' states (``cand``), the broadcast and
    the uploads carry the chosen basis's prior and statistics only (16 KB a unit instead of
    215 KB at orders (4, 3): 20 candidates), and the chosen candidate's EM goes on from its
    own iterate. The chosen EM's M-step is the candidate path's (its masked design metric,
    its own σ²), so the numbers after the freeze are those of the every-round run whenever
    that run keeps the same choice to its end (tested on a small fleet).
    With ``select_units`` = S > 0 the candidates' E-steps run on a sample: a unit computes
    and uploads them only when its own draw u_i (:func:`unit_draw`, from the bits of its
    Φᵀy: no seed, nobody else's data) is below the broadcast rate min(1, S / N) (N the
    fleet's units, from the engine before the first round, else the first round's count);
    the others upload zeros and ``unit`` 0. The candidates' M-steps and the BIC use the
    sample's sums, its n and its count N_s (the BIC's log N_s). At N ≤ S every unit draws
    (the run as without it); above, the choice is the sample's BIC choice (measured against
    the whole fleet's at 10,000 units, docs/benchmarks.md) and the chosen EM then runs on
    every unit.
R2. **The hold-out once** (``holdout = "final"``, with ``interval = "calibrated"``). I2 and
    I4's fits and counts (the calibrated interval's hold-out: a posterior per unit and per
    own fold, its rows counted against 142 τ² values) are computed only in the round the
    server marks (``holdout_now``): the engine's last round (:meth:`RoundSchedule.before`),
    or the round after the prior has converged (R3). Every round still uploads the probe
    design (its inputs' span positions: the server's choice of the probe, a few hundred
    bytes) and the residual terms of I1 (σ²'s sums). The τ² of the final model is the
    every-round run's: both are learned in the last round, against the same broadcast
    prior and the same probe. Between hold-outs the server keeps the τ² it had (0 before
    the first), so an intermediate evaluation states the model's own interval.
R3. **Rounds to convergence** (``converge_tol`` = ε > 0). After each M-step the server
    measures the prior's change, δ = max(‖μ' − μ‖ / ‖μ‖, ‖Σ' − Σ‖_F / ‖Σ‖_F, |σ'² − σ²| / σ²),
    once the basis is frozen (or without selection); the first round with δ < ε marks the
    next round for the hold-out (R2), and after that round the run is finished
    (:meth:`RoundSchedule.finished`: the simulator stops there and evaluates; ``rounds``
    stays the cap). Opt-in, off in the shipped preset: measured (docs/benchmarks.md, "Issue
    36.1"), σ² converges sublinearly (its change per round decays like 1/t, not ρ^t), so no
    rate bound holds after the stop, and on a fleet of 12 campaign + 4 3x2 units the stop at
    ε = 1e-4 (round 11) kept τ² = 0 where the 30-round run learns 1.4e-9 (of the order of
    σ² itself): the interval of the few-point units changed. SQUAREM on the chosen basis's EM
    (``accelerate = "squarem"``, :mod:`~fedcal.algorithms.fedprior_accel`, opt-in) reaches the
    50-round fleet likelihood and σ² in 30–40 rounds, not the few-point units' predictions
    and τ² (docs/benchmarks.md, session 14): no stop is built on it.

:class:`RoundSchedule` is a part of FedPrior (``rounds_schedule``), declared by those three
settings; its functions read and write only the server's bookkeeping keys
(:data:`SCHEDULE_KEYS`) and the prior (μ, Σ, σ²).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_accel import accelerated, unchecked_reverted
from fedcal.algorithms.fedprior_interval_parts import span_positions
from fedcal.core.bayes import F64
from fedcal.core.data import ClientData
from fedcal.core.tree import Tree

# The server's bookkeeping: rounds the choice has stayed, the last change δ of the prior,
# whether the next round holds out (R2) and whether the run is finished (R3).
SCHEDULE_KEYS = ("choice_stable", "prior_change", "holdout_now", "finished")


def prior_change(old: Tree, new: Tree) -> float:
    """δ of R3: the largest relative change of μ, Σ (Frobenius) and σ² over one round."""
    out = 0.0
    for key in ("mu", "sigma", "noise_var"):
        a, b = old[key].to(F64), new[key].to(F64)
        scale = float(a.norm())
        out = max(out, float((b - a).norm()) / scale if scale > 0 else float(b.norm()))
    return out


@dataclass(frozen=True)
class RoundSchedule:
    """R1–R3 of the module doc, declared by ``select_patience``, ``holdout``,
    ``converge_tol`` and whether the basis is selected by its candidates' EMs."""

    select_patience: int
    holdout: str
    converge_tol: float
    candidates: bool  # select = "bic" with select_by = "candidates"
    select_units: int = 0  # R1: the candidates' sample of about this many units (0: every unit)
    accelerate: str = "off"  # "squarem": the one EM's extrapolation (fedprior_accel, A1–A4)
    floor: float = 1e-12  # Σ's eigenvalue floor (the M-step's), for the extrapolated Σ

    @property
    def active(self) -> bool:
        """Whether the server keeps the schedule's bookkeeping (any of R1–R3 on)."""
        return bool(
            self.select_patience
            or self.holdout == "final"
            or self.converge_tol
            or self.sampling
            or self.accelerate != "off"
        )

    @property
    def sampling(self) -> bool:
        """Whether the candidates run on a sample of the units (R1, ``select_units``)."""
        return bool(self.select_units and self.candidates)

    def sampled(self, down: Tree, own: Tensor) -> Tensor | None:
        """(clients,) bool: the units whose own draw (:func:`unit_draw` of ``own``, (clients,
        m)) falls below the broadcast rate, or None when every unit runs the candidates."""
        if "cand_rate" not in down:
            return None
        rate = down["cand_rate"].to(F64).reshape(-1)
        if bool((rate >= 1.0).all()):
            return None
        return unit_draw(own) < rate

    def unsampled(self, down: Tree) -> Tree:
        """The broadcast of a unit outside the candidates' sample (R1): without the
        candidates' priors and rate, so its reply holds no candidate terms at all (the
        engine's streamed round sends it instead of ``down``; the unit's own draw would
        give it zeros there)."""
        return {k: v for k, v in down.items() if k not in ("cand", "cand_rate")}

    def init(self) -> Tree:
        """The bookkeeping's start (empty when every setting is off: the earlier state)."""
        if not self.active:
            return {}
        zero = torch.tensor(0.0, dtype=F64)
        rate = {"cand_rate": torch.tensor(1.0, dtype=F64)} if self.sampling else {}
        return {
            **rate,
            "choice_stable": zero.clone(),
            "prior_change": torch.tensor(float("inf"), dtype=F64),
            "holdout_now": zero.clone(),
            "finished": zero.clone(),
        }

    def holds_out(self, down: Tree) -> bool:
        """Whether this round's units fit and count the hold-out (I2, I4)."""
        if self.holdout != "final" or "holdout_now" not in down:
            return True
        return bool((down["holdout_now"] > 0).any())  # one flag, broadcast to each unit

    def before(self, server: Tree, t: int, rounds: int, units: int) -> Tree:
        """The server before round ``t`` of an engine's ``rounds`` over ``units`` units: the
        last round holds out (R2); the candidates' rate is select_units / units from the
        first round on (R1; without this hook, from the second, by the first's count)."""
        out = dict(server)
        if self.holdout == "final" and t == rounds - 1:
            out["holdout_now"] = torch.tensor(1.0, dtype=F64)
        if self.sampling and "cand_rate" in server and units > 0:
            out["cand_rate"] = torch.tensor(min(1.0, self.select_units / units), dtype=F64)
        if self.accelerate != "off":  # A4: no extrapolation into the engine's last round
            out["accel_last_next"] = tensor_flag(t == rounds - 2)
        return out

    def finished(self, server: Tree) -> bool:
        """Whether the run is done (R3): the round after convergence held out."""
        return float(server.get("finished", 0.0)) > 0

    def after(self, old: Tree, new: Tree, units: Tensor, loglik: Tensor | None = None) -> Tree:
        """The bookkeeping after a server update ``old`` → ``new`` (R1's freeze and sample
        rate from the ``units`` of this round, R3's test); with ``loglik`` (Σ_i ℓ_i of the
        broadcast, the one EM's round) and ``accelerate``, SQUAREM's step (fedprior_accel)."""
        if not self.active:
            return new
        if self.accelerate != "off" and loglik is not None and "cand" not in new:
            new = accelerated(old, new, loglik, self.floor)
            if float(old.get("accel_last_next", 0.0)) > 0:  # A4: the last round's θ is plain
                new = unchecked_reverted(new)
        out = dict(new)
        cand = "cand" in new
        if cand and self.sampling:  # R1: about select_units units draw the candidates
            out["cand_rate"] = torch.tensor(min(1.0, self.select_units / float(units)), dtype=F64)
        if cand:  # R1: rounds in a row with this choice (0 in the first round)
            same = "cand" in old and int(old["choice"]) == int(new["choice"])
            stable = float(old["choice_stable"]) + 1 if same else 0.0
            out["choice_stable"] = torch.tensor(stable, dtype=F64)
            if self.select_patience and stable + 1 >= self.select_patience:
                out.pop("cand")  # frozen: the chosen candidate's EM goes on alone
                out.pop("cand_rate", None)
        held = float(old.get("holdout_now", 0.0)) > 0
        change = prior_change(old, new) if not cand else float("inf")
        out["prior_change"] = torch.tensor(change, dtype=F64)
        converged = bool(self.converge_tol) and change < self.converge_tol
        # R3: converged → the next round holds out; a round that held out after convergence
        # (or, without R3, any that held out) ends the bookkeeping's run
        done = held and float(old.get("prior_change", float("inf"))) < self.converge_tol
        out["finished"] = tensor_flag(done)
        # (once converged every round holds out: an engine that does not stop still ends
        # on a round that held out against its prior)
        out["holdout_now"] = tensor_flag(converged)
        return unchecked_reverted(out) if converged else out  # A4 (fedprior_accel)


def unit_draw(values: Tensor) -> Tensor:
    """Each unit's own uniform draw in [0, 1) from its data, (clients,): the bits of its row of
    ``values`` (clients, m) float64 (fedprior: Φᵀy, which its own readings fix) folded through
    splitmix64's finalizer. The same unit draws the same number every round and on any
    machine, and needs nobody else's data or a shared seed."""
    bits = values.to(F64).reshape(values.shape[0], -1).contiguous().view(torch.int64)
    h = torch.zeros(values.shape[0], dtype=torch.int64)
    for j in range(bits.shape[1]):
        h = _mix(h ^ bits[:, j])
    return ((h >> 11) & ((1 << 53) - 1)).to(F64) / float(1 << 53)


def _mix(h: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 (wrapping products; logical shifts by masking)."""
    h = h + -7046029254386353131  # the golden-ratio increment 0x9E3779B97F4A7C15
    for shift, mult in ((30, -4658895280553007687), (27, -7723592293110705685)):
        h = (h ^ ((h >> shift) & ((1 << (64 - shift)) - 1))) * mult
    return h ^ ((h >> 31) & ((1 << 33) - 1))


def probe_design(u: Tensor, branch: Tensor, n: Tensor, probe_rows: int) -> Tree:
    """A unit's candidate probe of I2, uploaded every round (R2): its inputs' span positions
    ``u`` and directions if it has at most ``probe_rows`` rows (zeros otherwise), and its row
    count (0 otherwise)."""
    c, rows = branch.shape
    own = (n <= probe_rows).to(F64)
    r = min(rows, probe_rows)
    probe_x = torch.zeros(c, probe_rows, u.shape[-1], dtype=F64)
    probe_x[:, :r] = u[:, :r] * own.reshape(-1, 1, 1)
    probe_b = torch.zeros(c, probe_rows, dtype=F64)
    probe_b[:, :r] = branch[:, :r] * own.unsqueeze(1)
    return {"x": probe_x, "b": probe_b, "n": n * own}


def small_probe(data: ClientData, probe_rows: int, counts: tuple[int, bool] | None = None) -> Tree:
    """:func:`probe_design` in a round without the hold-out (R2), computed on the units with
    at most ``probe_rows`` rows alone (their inputs' span positions, ``span_positions``); the
    others' upload is zeros, as probe_design's. The same numbers as probe_design of every
    unit, without every unit's span (at 100,000 units of 444 rows, most of a plain round's
    interval cost). ``counts`` (grid, own folds): a round that holds out where no unit can,
    with its zero counts (:func:`nothing_held`)."""
    if counts is not None:
        return {**small_probe(data, probe_rows), **nothing_held(data.num_clients, *counts)}
    n = data.count.to(F64)
    c, rows = data.mask.shape
    out = {
        "x": torch.zeros(c, probe_rows, data.x.shape[-1], dtype=F64),
        "b": torch.zeros(c, probe_rows, dtype=F64),
        "n": n * (n <= probe_rows).to(F64),
    }
    small = torch.nonzero(n <= probe_rows)[:, 0]
    if not small.numel():
        return out
    sub = data.select(small)
    mask = sub.mask.to(F64)
    branch = torch.zeros(len(small), rows, dtype=F64) if sub.branch is None else sub.branch
    part = probe_design(span_positions(sub.x.to(F64), mask), branch.to(F64), n[small], probe_rows)
    for key in ("x", "b"):
        out[key][small] = part[key]
    return out


def nothing_held(clients: int, grid: int, own: bool) -> Tree:
    """I2's (and with ``own``, I4's) counts of a round that holds out where no unit can (no
    probe yet, or none with twice its rows): zeros per unit, (clients, grid) and (clients,)."""
    out = {"inside": torch.zeros(clients, grid, dtype=F64), "held": torch.zeros(clients, dtype=F64)}
    if own:
        out.update(inside_own=out["inside"].clone(), held_own=out["held"].clone())
    return out


def carried_interval(server: Tree, fresh: Tree) -> Tree:
    """I3 in a round without the hold-out (R2): the τ² values and the decline the server had,
    the probe and the residual degrees of freedom of this round (``fresh``)."""
    out = dict(fresh)
    for key in ("disc_var", "disc_own"):
        if key in server:
            out[key] = server[key]
    code = float(server["declined"])
    if float(fresh["dof"]) < 1.0:  # I1's decline is this round's
        code = 1.0
    elif code == 1.0:
        code = 0.0
    out["declined"] = torch.tensor(code, dtype=F64)
    return out


def tensor_flag(value: bool) -> Tensor:
    """A bookkeeping flag as the server's float64 scalar."""
    return torch.tensor(float(value), dtype=F64)

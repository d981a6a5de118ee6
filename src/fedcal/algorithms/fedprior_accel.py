"""SQUAREM on the fleet prior's EM (issue 36.1, ``accelerate = "squarem"``): fewer rounds.

One round of :class:`~fedcal.algorithms.fedprior.FedPrior` is a map θ ↦ F(θ) of the prior
θ = (μ, Σ, σ²): the units' E-step under the broadcast θ, the server's M-step from their sums.
Plain EM iterates F, and F's rate is slow where Σ's small eigenvalues shrink toward the
floor and σ² takes their share (docs/benchmarks.md, session 14, "rounds to convergence").
The server accelerates it alone, from what it already holds: the protocol (only sums leave
a unit) and the E-step are unchanged; each unit adds one number to its upload, its
log-evidence ℓ_i(θ) = log p(y_i | θ) under the broadcast (the posterior's ``loglik``).

A1. **Coordinates.** u(θ) = (μ, log Σ, log σ²), log Σ the matrix logarithm (eigenvalues'
    logs in Σ's eigenvectors): any u maps back to a positive-definite Σ and a positive σ²,
    and a variance decaying geometrically toward the floor moves linearly there.
A2. **The step** (Varadhan & Roland 2008, SqS3): from θ0, θ1 = F(θ0), θ2 = F(θ1),

        r = u1 − u0,   v = u2 − 2u1 + u0,   α = −‖r‖ / ‖v‖  clipped to [−α_max, −1],
        u' = u0 − 2α r + α² v,

    with one α per block of u (μ, log Σ, log σ²: they converge at different rates), and
    θ' = u⁻¹(u') with Σ's eigenvalues floored as the M-step floors them (α = −1 gives θ2,
    plain EM). α_max starts at 1 and is multiplied by ``GROWTH`` each time an α reaches it.
A3. **Rounds.** A cycle is two rounds: the round that broadcasts θ0 returns F(θ0) = θ1 and
    ℓ(θ0); the round that broadcasts θ1 returns θ2 and ℓ(θ1); the server then broadcasts θ'.
    The round at θ' returns F(θ') and ℓ(θ'): if ℓ(θ') ≥ ℓ(θ1) the extrapolation is kept and
    θ' is the next cycle's θ0 (its F already known: the cycle goes on with one round);
    otherwise (or when θ' is not finite) the server falls back to θ2 = F(θ1), the plain EM
    iterate, and divides α_max by ``GROWTH`` (not below 1). So the likelihood of the kept
    iterates never decreases, and a rejected extrapolation costs one round.
A4. **The last round** (and the round that holds out after convergence, R2/R3 of
    :mod:`~fedcal.algorithms.fedprior_rounds`) never starts from an unchecked θ': the round
    before it broadcasts θ2 instead (decided in that round's update, from the flag its
    ``before`` set, so that Flower's evaluation, sent with the next round's message, reads
    the same server as the simulator's), and the model and τ² are learned at a plain EM
    iterate.

Measured on ``make run``'s fleet (4 seeds): the 50-round run's fleet likelihood and σ² in
30–40 rounds, but not its few-point units' predictions or τ² (the likelihood is flat along
the directions that move them): opt-in, off in the shipped preset. A hostile unit's
log-evidence can only make the server keep or drop an extrapolation (it enters the sums
with the unit's robust weight): a kept θ' is a valid prior, and the M-step, so EM's fixed
point, is unchanged.

The server's bookkeeping (:data:`ACCEL_KEYS`): the cycle's phase (0: θ0 next, 1: θ1 next,
2: θ' broadcast), α_max, the reference ℓ, θ0 and the fall-back θ2. Pure functions of the
server's trees; used by :class:`~fedcal.algorithms.fedprior_rounds.RoundSchedule`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcal.core.bayes import F64
from fedcal.core.tree import Tree

PRIOR = ("mu", "sigma", "noise_var")
ACCEL_KEYS = (
    "accel_phase",
    "accel_step",
    "accel_ll",
    "accel_from",
    "accel_back",
    "accel_last_next",
)
GROWTH = 4.0  # α_max's growth when α reaches it (SQUAREM's default "mstep")


def prior_of(tree: Tree) -> Tree:
    """θ = (μ, Σ, σ²) of a server tree, as float64 copies."""
    return {k: tree[k].to(F64).clone() for k in PRIOR}


def coordinates(theta: Tree) -> Tensor:
    """u(θ) of A1: μ, the matrix logarithm of Σ and log σ², one vector."""
    vals, vecs = torch.linalg.eigh(0.5 * (theta["sigma"] + theta["sigma"].T))
    log_sigma = (vecs * vals.clamp_min(torch.finfo(F64).tiny).log()) @ vecs.T
    noise = theta["noise_var"].reshape(1).clamp_min(torch.finfo(F64).tiny).log()
    return torch.cat([theta["mu"], log_sigma.reshape(-1), noise])


def from_coordinates(u: Tensor, p: int, floor: float) -> Tree | None:
    """θ = u⁻¹(u) of A1, Σ's eigenvalues floored at ``floor``; None when not finite."""
    if not bool(torch.isfinite(u).all()):
        return None
    log_sigma = u[p : p + p * p].reshape(p, p)
    vals, vecs = torch.linalg.eigh(0.5 * (log_sigma + log_sigma.T))
    sigma = (vecs * vals.exp().clamp_min(floor)) @ vecs.T
    noise = u[-1].exp()
    if not (bool(torch.isfinite(sigma).all()) and bool(torch.isfinite(noise))):
        return None
    return {"mu": u[:p].clone(), "sigma": 0.5 * (sigma + sigma.T), "noise_var": noise}


def squarem_point(
    theta0: Tree, theta1: Tree, theta2: Tree, step_max: float, floor: float
) -> tuple[Tree | None, float]:
    """(θ', α) of A2 from θ0, θ1 = F(θ0), θ2 = F(θ1), α the blocks' largest step; θ' None
    when not finite."""
    u0, u1, u2 = coordinates(theta0), coordinates(theta1), coordinates(theta2)
    r, v = u1 - u0, u2 - 2.0 * u1 + u0
    p = theta0["mu"].shape[0]
    u, largest = u0.clone(), -1.0
    for block in (slice(0, p), slice(p, p + p * p), slice(p + p * p, None)):  # μ, log Σ, log σ²
        r_norm, v_norm = float(r[block].norm()), float(v[block].norm())
        alpha = -r_norm / v_norm if v_norm > 0 else (-step_max if r_norm > 0 else -1.0)
        alpha = max(-step_max, min(-1.0, alpha))
        u[block] = u0[block] - 2.0 * alpha * r[block] + alpha * alpha * v[block]
        largest = min(largest, alpha)
    return from_coordinates(u, p, floor), largest


def accelerated(old: Tree, new: Tree, loglik: Tensor, floor: float) -> Tree:
    """The server after a round (A3): ``old`` the server that broadcast θ, ``new`` its plain
    M-step F(θ), ``loglik`` Σ_i ℓ_i(θ); θ of the result replaced by θ' or θ2 as A3 says."""
    out = dict(new)
    ll = loglik.to(F64).reshape(())
    phase = int(old.get("accel_phase", torch.tensor(0.0)))
    step = float(old.get("accel_step", torch.tensor(1.0)))
    if phase == 0:  # θ0 was broadcast: remember it and ℓ(θ0); F(θ0) = θ1 goes out
        return _book(out, 1, step, ll, prior_of(old), None)
    if phase == 1:  # θ1 was broadcast: extrapolate from θ0, θ1, θ2 = F(θ1)
        back = prior_of(new)
        point, alpha = squarem_point(old["accel_from"], prior_of(old), back, step, floor)
        if point is None:  # not finite: plain EM, a new cycle from θ2
            return _book(out, 0, max(1.0, step / GROWTH), ll, None, None)
        out.update(point)
        step = step * GROWTH if alpha <= -step else step
        return _book(out, 2, step, ll, old["accel_from"], back)
    if bool(ll >= old["accel_ll"]):  # θ' kept: it is the next cycle's θ0, F(θ') = θ1
        return _book(out, 1, step, ll, prior_of(old), None)
    out.update(old["accel_back"])  # θ' lowered the fleet's likelihood: back to θ2
    return _book(out, 0, max(1.0, step / GROWTH), old["accel_ll"], None, None)


def _book(
    out: Tree, phase: int, step: float, ll: Tensor, start: Tree | None, back: Tree | None
) -> Tree:
    """``out`` with the bookkeeping of A3 (θ0 and θ2 only while a cycle needs them)."""
    out["accel_phase"] = torch.tensor(float(phase), dtype=F64)
    out["accel_step"] = torch.tensor(step, dtype=F64)
    out["accel_ll"] = ll.clone()
    for key, value in (("accel_from", start), ("accel_back", back)):
        out.pop(key, None)
        if value is not None:
            out[key] = value
    return out


def unchecked_reverted(server: Tree) -> Tree:
    """A4: the server after the round before a last (or holding-out) one, an unchecked θ'
    replaced by the plain θ2."""
    if int(server.get("accel_phase", torch.tensor(0.0))) != 2:
        return server
    out = {**server, **server["accel_back"]}
    return _book(out, 0, 1.0, server["accel_ll"], None, None)

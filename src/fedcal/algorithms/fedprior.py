"""Fleet-prior calibration: federated empirical Bayes over per-sensor coefficients (ours).

Units of one design differ, but not arbitrarily: their calibration
coefficients vary around a fleet mean along a few directions. The federation
learns that distribution without pooling anyone's data, and a unit with a
handful of chamber points is calibrated by placing itself in it
(empirical Bayes; docs/calibration-guide.md). The model is linear in its parameters:

    y_i = φ(x)ᵀ c_i + ε,   ε ~ N(0, σ_i²),   c_i ~ N(μ, Σ),

with φ a Legendre-product basis of the scaled inputs (:func:`legendre_products`):
the tensor product up to ``orders`` for a two-input pressure sensor (the
inputs are scaled by their fixed physical ranges), or every product up to a
total ``degree`` for any other set of named features.

One round is one ECME iteration (:mod:`fedcal.core.bayes`):

1. **E-step, client i** (closed form, float64): from its moments
   (Φ_iᵀΦ_i, Φ_iᵀy_i, y_iᵀy_i, n_i) and the broadcast (μ, Σ, σ²), the posterior
   N(m_i, V_i) of its coefficients. It uploads only what the server's sums
   need: m_i, S_i = m_i m_iᵀ + V_i, the GLS terms Φ_iᵀC_i⁻¹Φ_i and
   Φ_iᵀC_i⁻¹(y_i − Φ_iμ), its expected residual sum of squares r_i, n_i, and how
   far its own points determine each direction (for the identification check).
   With ``noise = "sensor"`` (for fleets whose units differ in noise) it keeps
   a private noise variance
   σ_i² = (r_i + ν σ²)/(n_i + ν): its own residuals shrunk toward the fleet's by
   ν pseudo-points (the MAP under a scaled-inverse-χ² prior centred on σ²), so a
   noisy unit is not trusted like a clean one and a unit with three points is
   not trusted on its own noise.
2. **M-step, server**: μ by generalized least squares, Σ by EM's update
   (1/N) Σ_i E[(c_i − μ)(c_i − μ)ᵀ], then shrunk toward its diagonal by
   ``shrinkage``, optionally factored as ``rank`` factors plus a diagonal, and
   its eigenvalues floored (:func:`fedcal.core.bayes.regularize`);
   σ² = Σ_i r_i / Σ_i n_i (with ``interval = "calibrated"``: on residual degrees of
   freedom, I1 of :mod:`~fedcal.algorithms.fedprior_interval`). Only sums over clients
   enter, in a canonical order.
   With ``robust = "full"`` (issue 21, :mod:`fedcal.core.robust`) an upload that
   contradicts its declared count or the broadcast prior is rejected by the aggregation,
   and each unit's terms enter the sums times a weight from its leave-one-out distance to
   the other units (1 inside the cut-off; docs/safety.md).
3. **Personal model** (``personalize``): the posterior mean m_i, which is a
   precision-weighted interpolation between the unit's own least-squares fit
   and the fleet mean, with its covariance V_i: every prediction carries the
   predictive variance φ(x)ᵀV_iφ(x) + σ_i² (:meth:`FedPrior.predictive_std`).

Identification. A direction of coefficient space that no unit's data
determine (e.g. curvature in temperature when every unit saw only two
temperatures) cannot be learned. The server counts, per direction of the
basis, how many units' own points determine it (the eigenvalues of
Σ_i [I − (I + s²G_i/σ_i²)⁻¹], s = ``init_scale``); along directions informed by
fewer than ``min_informed`` units it keeps the vague start (μ unchanged,
variance s²) instead of an estimate from one or two units, so predictions
that lean on them carry a wide predictive σ rather than a confident number,
and the run reports them as weakly identified (:meth:`PriorStatus.identification`,
in the run's output and the exported prior). When every unit has fewer points
than the basis has terms, lower the orders: the prior cannot be learned from
such a fleet (measured in docs/results/fleet-prior.md).

Every option around the model is a part, a frozen dataclass declared by the settings it
reads, built once (:mod:`~fedcal.algorithms.fedprior_parts`, whose module doc lists them):
the complexity chosen by the fleet's evidence (``select = "bic"``: every candidate's EM runs
in the same federation, its E- and M-steps this module's, run on each candidate's terms by
:mod:`~fedcal.algorithms.fedprior_candidates`, C1–C4), the chamber's sweep direction
(``branch_orders``: the design [φ, b·ψ], :mod:`~fedcal.algorithms.fedprior_basis`), the
noise model (N1–N7), the calibrated interval (I1–I4), the time-respecting choice, the
extrapolation guard, client-level DP's bounds, the robust sums and the streamed round.

One idea per file: this module is the model and its federated EM (the E-step in
``client_update``, the M-step in ``_prior_update`` and ``server_update``, the personal model);
its settings are :class:`~fedcal.algorithms.fedprior_settings.FedPriorSettings`; the engine's
optional hooks (core/hooks.py) are its parts' methods (:class:`Delegate`) or a few lines here
that call them. The table of parts, what each owns and may import: docs/design.md, "The
flagship algorithms, one idea per file".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from fedcal.algorithms.fedprior_basis import model_mask, unit_noise
from fedcal.algorithms.fedprior_choice import SIMPLE
from fedcal.algorithms.fedprior_deploy import deploy_state
from fedcal.algorithms.fedprior_deployed import deploy_shapes, deployed_var
from fedcal.algorithms.fedprior_interval import INTERVAL_KEYS
from fedcal.algorithms.fedprior_interval_parts import residual_terms
from fedcal.algorithms.fedprior_noise import sensor_noise
from fedcal.algorithms.fedprior_parts import (
    Delegate,
    FedPriorParts,
    build_parts,
    phi_terms,
    psi_terms,
)
from fedcal.algorithms.fedprior_robust import capped_noise, weighted
from fedcal.algorithms.fedprior_select import _masked
from fedcal.algorithms.fedprior_select import term_name as term_name  # re-exported
from fedcal.algorithms.fedprior_settings import FedPriorSettings
from fedcal.algorithms.fedprior_stream import canonical_order
from fedcal.core.algorithm import ClientResult, SettingError
from fedcal.core.bayes import (
    F64,
    Moments,
    Posterior,
    data_support,
    m_step,
    moments,
    posterior,
    predictive_var,
    regularize,
)
from fedcal.core.data import ClientData
from fedcal.core.privacy import Statistic
from fedcal.core.task import Task
from fedcal.core.tree import Tree
from fedcal.models.basis import any_beyond, legendre_products


@dataclass(frozen=True)
class FedPrior(FedPriorSettings):
    @property
    def uses_local_epochs(self) -> bool:  # closed form (EM)
        return False

    name = "fedprior"
    # per_sensor.csv's fallback column: codes on the wire, these names in the tables
    unit_labels: ClassVar[dict[str, tuple[str, ...]]] = {"fallback": ("prior", *SIMPLE)}
    # m_i is the unit's posterior mean (its calibration); the rest are sufficient statistics.
    uploads = ("model", "statistics")

    reply_aggregation = "sum"  # sums of per-unit sufficient statistics
    reads_seeds = False  # a closed-form E-step: no minibatches, no draws
    # Measured (studies/poisoning.py): a coordinate-wise median of the second moments
    # is not positive definite (Cholesky fails) and a trimmed mean costs 24× on a clean
    # fleet; screening, clipping and Krum keep the statistics whole.
    robust_rules = ("mean", "krum")
    # With select = "bic" every candidate's statistics travel under "cand/"; the server
    # judges a client (screening, Krum) by the chosen candidate's statistics only: a
    # sub-basis that misfits the fleet has large statistics for honest units too.
    # "gram" (the design's ΦᵀΦ, inputs only) is judged by the consistency check (PSD,
    # G_00 = n: core/robust.py), not by size: per row it is a moment of the unit's inputs
    # (x⁴ for a quadratic), which honest units differ in by 10²–10³ (pollution episodes,
    # docs/statuses.md); every statistic the prior is fitted from is still size-screened.
    unscreened_replies = ("cand/", "interval/", "noise/", "gram", "select", "choice/")

    def check_task(self, task: Task) -> None:
        self.terms  # noqa: B018 — the basis against the model's inputs
        if self.branch_orders and len(self.branch_orders) != self.num_inputs:
            raise SettingError(
                "branch_orders",
                f"{list(self.branch_orders)} needs one order >= 0 per input "
                f"({self.num_inputs} inputs), or [] for no direction term",
            )
        if self.own_folds == 1:  # I4 (fedprior_interval): a fold needs other rows to fit from
            raise SettingError("own_folds", "1: use 0 (off) or >= 2 folds")

    # ---- the basis ---------------------------------------------------------
    @property
    def num_inputs(self) -> int:
        return int(getattr(self.task.model, "in_features", 2))

    @cached_property  # built once per instance: the fields are frozen
    def terms(self) -> tuple[tuple[int, ...], ...]:
        """Exponent tuples of the basis functions (constant first; :func:`phi_terms`)."""
        return phi_terms(self.basis, self.orders, self.degree, self.num_inputs)

    @cached_property
    def branch_terms(self) -> tuple[tuple[int, ...], ...]:
        """Exponent tuples of ψ, the direction term's basis (empty when off)."""
        return psi_terms(self.branch_orders, self.num_inputs)

    @property
    def num_features(self) -> int:
        """Columns of the design: φ's terms, then ψ's (the prior is over both)."""
        return len(self.terms) + len(self.branch_terms)

    # ---- the parts (fedprior_parts), each declared by the settings it reads ----
    @cached_property  # built once: the fields are frozen (not a field: configured_repr as it was)
    def parts(self) -> FedPriorParts:
        """Every part, built by :func:`~fedcal.algorithms.fedprior_parts.build_parts`."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return build_parts(settings, self.num_inputs, self.terms, self.branch_terms)

    design_basis = Delegate("parts")  # the design [φ, b·ψ], the predictive form
    selection = Delegate("parts")  # the candidate bases and the basis in use
    noise_model = Delegate("parts")  # σ²(x) in the inputs, Student-t or trimmed rows (N1–N7)
    support_box = Delegate("parts")  # the extrapolation guard over φ
    branch_pins = Delegate("parts")  # ψ's coordinates the fleet's data do not identify
    rounds_schedule = Delegate("parts")  # the choice frozen, the hold-out once, the stop (R1–R3)
    candidate_ems = Delegate("parts")  # every candidate's EM and the fleet's BIC choice (C1–C4)
    prior_status = Delegate("parts")  # identification, each unit's status, the exported prior
    calibrated = Delegate("parts")  # the calibrated interval (I1–I4)
    time_choice = Delegate("parts")  # the time-respecting choice, no harm, its forward interval
    private_statistics = Delegate("parts")  # the uploaded statistics' DP maps and bounds
    streamed = Delegate("parts")  # whether and how the M-step runs from the replies' sums
    robust_uploads = Delegate("parts")  # the consistency check and the outlier weights

    # ---- the hooks (core/hooks.py) and attributes that are a part's ----
    candidates = Delegate("selection")  # the bases select = "bic" chooses from
    masks = Delegate("selection")  # (candidates, features): each candidate's terms
    before_round = Delegate("rounds_schedule", "before")  # R2's last round holds out; R1's rate
    finished = Delegate("rounds_schedule")  # R3: the run is done before the engine's rounds
    unsampled_broadcast = Delegate("rounds_schedule", "unsampled")  # outside R1's sample
    design = Delegate("design_basis")  # [φ(x), b·ψ(x)]
    variance_design = Delegate("design_basis")  # z(x) = [φ(x), ψ(x)]
    # (Q, s): the predictive variance z(x)ᵀQ z(x) + s, the single place that predictive_std
    # and the firmware/JSON exports read
    variance_form = Delegate("design_basis")
    beyond_support = Delegate("support_box", "beyond")  # (clients, rows): beyond the unit's box
    outlier_weights = Delegate("robust_uploads")  # each client's M-step weight (or None)
    outlier_inputs = Delegate("streamed")  # a streamed round's per-unit leaves (StreamsSums)
    picked_leaves = Delegate("streamed")
    pick_inputs = Delegate("streamed")
    pick_reply = Delegate("streamed")
    interval_note = Delegate("calibrated", "note")  # why no interval is stated for some units
    weak_units = Delegate("calibrated")  # I3's declined units

    def personal_shapes(self) -> dict[str, tuple[int, ...]]:
        """One sensor's :meth:`personalize` tree: shapes a loaded model file must have."""
        p = self.num_features
        # box: the unit's input support (lo, hi per input), the extrapolation guard's
        shapes = {"coef": (p,), "cov": (p, p), "noise_var": (), "box": (2, self.num_inputs)}
        if self.interval == "calibrated":  # τ_i² and whether the unit's interval is declined
            shapes.update(disc_var=(), declined=())
        if self.noise_shape == "inputs":  # γ of σ²(x) = σ_i² exp(γᵀx) (fedprior_noise)
            shapes["noise_gamma"] = (self.num_inputs,)
        if self.choose != "off":  # the no-harm fall-back and the validation MSE (fedprior_choice)
            shapes.update(fallback=(), val_mse=(), sigma_scale=(), target_sd=())
            shapes.update(
                self.time_choice.forward.shapes()
            )  # κ, ρ/T after calibration (fedprior_forward)
        if self.deploy_rows:  # the unit's design for the prior's discrepancy σ (fedprior_deploy)
            shapes.update(deploy_shapes(self.deploy_rows, self.num_inputs, len(self.terms)))
        return shapes

    # ---- the contract --------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        p = self.num_features
        start = {
            "mu": torch.zeros(p, dtype=F64),
            "sigma": self.init_scale**2 * torch.eye(p, dtype=F64),
            "noise_var": torch.tensor(self.init_noise**2, dtype=F64),
            "support": torch.zeros(p, p, dtype=F64),
        }
        if self.interval == "calibrated":
            start.update(self.calibrated.init())
        start.update(self.noise_model.init(self.num_inputs))  # γ, the tail's test (N2–N6)
        if self.branch_orders:  # ψ coordinates out of the model (none yet): BranchPins.unidentified
            start["pinned"] = torch.zeros(p, dtype=F64)
        if self.time_choice.on:  # fedprior_choice's pooled lines and summed scores
            start.update(self.time_choice.init())
        start.update(self.rounds_schedule.init())  # R1–R3's bookkeeping (none when off)
        # the selection's (fedprior_candidates C1): round 0 screens with the largest candidate
        return {**start, "box": self.support_box.open_box(), **self.candidate_ems.init(start)}

    def broadcast(self, server: Tree) -> Tree:
        down = {k: server[k] for k in ("mu", "sigma", "noise_var")}
        if "box" in server:  # the fleet's input support (extrapolation guard)
            down["box"] = server["box"]
        down.update({k: server[k] for k in INTERVAL_KEYS if k in server})
        noise_keys = ("noise_gamma", "noise_gamma_fit", "noise_student")
        down.update({k: server[k] for k in noise_keys if k in server})
        if "pinned" in server:  # ψ coordinates out of the model (BranchPins.unidentified)
            down["pinned"] = server["pinned"]
        if self.select != "none":
            down["mask"] = server["mask"]
        if "pooled_ok" in server:  # the fleet's pooled lines (fedprior_choice), once summed
            keys = self.time_choice.forward.broadcast_keys
            down.update({k: server[k] for k in keys if k in server})
        if "holdout_now" in server:  # fedprior_rounds R2: whether this round holds out
            down["holdout_now"] = server["holdout_now"]
        down.update(self.candidate_ems.broadcast(server))  # (fedprior_candidates C1)
        return down

    def client_init(self, down: Tree) -> Tree:
        return {"noise_var": down["noise_var"].clone(), **self.candidate_ems.client_init(down)}

    def _noise(self, down: Tree, state: Tree) -> Tensor:
        return unit_noise(self.noise, down, state)

    def derive(self, data: ClientData) -> dict[str, Tensor] | None:
        """The units' unweighted moments of step 1, which their data alone fix, formed once
        by the engine (``ClientData.derived``; :meth:`DesignBasis.derived`) instead of every
        round (issue 25.1). None with row weights (fedprior_noise): those depend on the
        broadcast."""
        return None if self.noise_model.weighted else self.design_basis.derived(data)

    def _moments(self, data: ClientData, down: Tree | None = None) -> Moments:
        """The unit's moments of the design [φ, b·ψ] (module doc, step 1), its rows weighted
        by the noise model under ``down`` (:meth:`DesignBasis.moments`)."""
        return self.design_basis.moments(data, self.noise_model, down)

    def _posterior(self, down: Tree, state: Tree, full: Moments) -> tuple[Moments, Posterior]:
        """The posterior under the broadcast prior; with selection, the chosen candidate's."""
        mask = self._model_mask(down)
        stats = full if mask is None else _masked(full, mask)
        return stats, posterior(stats, down["mu"], down["sigma"], self._noise(down, state))

    _model_mask = staticmethod(model_mask)  # the features in the model (fedprior_basis)

    def _sensor_noise(self, rss: Tensor, n: Tensor, fleet: Tensor) -> Tensor:
        """σ_i² = (r_i + ν σ²)/(n_i + ν): the MAP under a scaled-inv-χ²(ν, σ²) prior."""
        return sensor_noise(rss, n, fleet, self.noise_prior_points)

    def _client_moments(self, down: Tree, data: ClientData) -> Moments:
        """The moments the E-step uses (fedprior_drift whitens them by its drift)."""
        return self._moments(data, down)

    def _personal_moments(self, down: Tree, data: ClientData) -> Moments:
        """The moments of a unit's personalized posterior (fedprior_drift: its walk's)."""
        return self._client_moments(down, data)

    # ---- step 1, the E-step (module doc) ----
    def client_update(self, down: Tree, state: Tree, data: ClientData) -> ClientResult:
        design, rw = None, None
        # select_by = "marginal": the EM runs on the full basis (without the ψ coordinates J
        # out of the model), whatever candidate is chosen: its E-step and noise model too
        marginal = self.select != "none" and not self.candidate_ems.on
        em = {k: v for k, v in down.items() if k != "mask"} if marginal else down
        if (
            self.noise_model.weighted
        ):  # rows weighted by 1/σ²(x) and t-weights (fedprior_noise, N1/N4)
            design = self.design(data.x, data.branch)
            rw = self.noise_model.row_weights(em, data, design)
            full = self.noise_model.moments(design, data, rw)
        else:
            full = self._client_moments(down, data)  # once: candidates' are masks of these
        # With selection the chosen candidate's E-step is also in the batch below, but is
        # computed on its own: with noise = "sensor" its σ_i² is last round's choice's (not
        # always this round's); with one fleet σ² the batched one differs in the last bits
        # (measured: taking it from the batch saved 4 % of a client update).
        stats, post = self._posterior(em, state, full)
        reml = full.n if self.interval == "calibrated" else None
        chosen = self._e_step_sums(post, stats.gram, self._noise(down, state), reml)
        # The reply's leaf order is part of its wire format (and of DP's noise draws).
        reply = {key: chosen[key] for key in ("mean", "second", "gls_gram", "gls_rhs", "rss")}
        # The design's own Gram ΦᵀΦ (the input box's sums, the row-count check), unweighted.
        gram = full.gram if rw is None else moments(design, data.y[..., 0], data.mask).gram
        reply.update(n=full.n, gram=gram, support=chosen["support"])
        if self.branch_orders:  # the whole design's, whatever J: BranchPins.unidentified's input
            reply["branch_support"] = data_support(gram, self._noise(down, state), self.init_scale)
        if self.interval == "calibrated" and "probe_x" in down:
            # Unscreened ("interval/"): a unit's residual terms scale with its rows.
            reply["interval"] = {
                "dof": chosen["dof"],
                "fit": chosen["fit"],
                **self.calibrated.heldout(
                    down, state, data, rw, self.rounds_schedule.holds_out(down)
                ),
            }
        if self.noise_shape == "inputs":  # γ's score, information and evidence (N2)
            reply["noise"] = self.noise_model.uploads(em, data, design, post, rw[1])
        if self.noise_tail == "auto":  # the tail's evidence d_i (N6)
            reply.setdefault("noise", {})["tail_ratio"] = self.noise_model.tail_ratio(
                em, data, design
            )
        own = self._sensor_noise(post.rss, full.n, down["noise_var"])
        new_state = {"noise_var": own if self.noise == "sensor" else state["noise_var"]}
        if marginal:
            reply["select"] = self.selection.marginal_scores(down, self._noise(down, state), full)
        cand, cand_state = self.candidate_ems.uploads(down, state, full, self._e_step_sums)
        if cand is not None:  # every candidate's E-step (fedprior_candidates C2)
            reply["cand"] = cand
        new_state.update(cand_state)
        if "pooled_ok" in down and self.time_choice.choosing(data):  # forward scores
            args = (down, state, data, gram, chosen["mean"])
            reply["choice"] = self.time_choice.uploads(self, *args)
        fit_mse = post.rss / full.n.clamp_min(1.0)
        # jitter: the relative jitter a near-singular factorization needed (0: none; 1: an
        # eigenvalue floor), per unit and round in the run's metrics (core.bayes.safe_cholesky).
        metrics = {"train_loss": fit_mse, "loglik": post.loglik, "jitter": post.jitter}
        return ClientResult(reply, new_state, metrics)

    def _e_step_sums(
        self, post: Posterior, gram: Tensor, noise: Tensor, n: Tensor | None = None
    ) -> Tree:
        """A unit's terms of the M-step sums (module doc, step 1): m_i, m_i m_iᵀ + V_i, the
        GLS terms, the expected RSS, its log-evidence and its data support."""
        return {
            "mean": post.mean,
            "second": post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov,
            "gls_gram": post.gls_gram,
            "gls_rhs": post.gls_rhs,
            "rss": post.rss,
            "loglik": post.loglik,
            "support": data_support(gram, noise, self.init_scale),
            **({} if n is None else residual_terms(post, gram, noise, n)),
        }

    def sampled_clients(self, down: Tree, data: ClientData) -> Tensor | None:
        """The units that run the candidates this round (fedprior_rounds R1, by their own
        draws), None: every unit the same reply (engine.streamed.SamplesClients)."""
        if not self.candidate_ems.running(down) or self.noise_model.weighted:
            return None
        if "pooled_ok" in down and self.time_choice.choosing(data):  # (reads the candidates)
            return None
        return self.rounds_schedule.sampled(down, self._client_moments(down, data).rhs)

    # ---- step 2, the M-step (module doc) ----
    def _prior_update(
        self,
        old_mu: Tensor,
        total: dict,
        count: Tensor,
        metric: Tensor,
        old_noise: Tensor,
        pinned: Tensor | None = None,
    ):
        """One M-step from client sums: (μ, Σ, σ², support) (module doc, step 2); the ψ
        coordinates ``pinned`` out of the model (:meth:`BranchPins.unidentified`)."""
        if pinned is not None and bool(pinned.any()):  # the M-step of the model without them
            args = (old_mu, total, count, metric, old_noise, pinned)
            return self.branch_pins.pinned_update(self._prior_update, *args)
        mu, sigma_hat = m_step(
            total["gls_gram"],
            total["gls_rhs"],
            total["mean"],
            total["second"],
            count,
            old_mu,
            self.mean_scale,
        )
        # λ = ν0/(N + ν0): ν0 pseudo-units of an inverse-Wishart hyperprior, so a small
        # fleet is shrunk more than a large one; in the fleet's design metric.
        lam = self.shrinkage_units / (float(count) + self.shrinkage_units)
        sigma = regularize(sigma_hat, lam, self.floor, self.rank or None, metric)
        # Directions that too few units' points determine are not learned: they keep the
        # vague start (μ as it was, variance init_scale²), so predictions that lean on
        # them carry a wide σ instead of a guess from one or two units (see module doc).
        vals, vecs = torch.linalg.eigh(0.5 * (total["support"] + total["support"].T))
        weak = vecs[:, vals < self.min_informed]
        if weak.shape[1]:
            proj_weak = weak @ weak.T
            proj_seen = torch.eye(mu.shape[0], dtype=F64) - proj_weak
            sigma = proj_seen @ sigma @ proj_seen + self.init_scale**2 * proj_weak
            mu = proj_seen @ mu + proj_weak @ old_mu
        noise_var = total["rss"] / total["n"].clamp_min(1.0)
        if "dof" in total:  # σ² = Σ‖y − Φm‖² / Σ(n − tr(GV)/σ²); none left: kept, declined
            dof = total["dof"]
            noise_var = torch.where(dof >= 1.0, total["fit"] / dof.clamp_min(1.0), old_noise)
        return mu, sigma, noise_var

    def server_update(
        self, server: Tree, replies: Tree, weights: Tensor, units: Tensor | None = None
    ) -> Tree:
        # ``units``: N when the replies are already summed (fedprior_stream), else their count.
        # Every unit counts once (a hierarchical model's units are its samples);
        # sums in a canonical order so the rounding does not depend on arrival order.
        order = canonical_order(replies["mean"])
        robust = self.outlier_weights(server, replies)
        if robust is not None and bool((robust.weights != 1).any()):  # all 1: the plain sums
            replies = weighted(replies, robust.weights)
        if self.robust != "off":  # residual sums: a bounded pull on σ², not a size screen
            replies = capped_noise(replies)
        skip = ("cand", "interval", "noise", "choice")
        forward = None
        if "choice" in replies:  # per unit unless already summed (fedprior_stream)
            choice = (replies["choice"], order, replies["gram"], units is None)
            forward = self.time_choice.update(*choice)
        total = {k: v[order].sum(0) for k, v in replies.items() if k not in skip}
        pinned = self.branch_pins.unidentified(total.pop("branch_support", None))
        if "interval" in replies:  # the restricted noise update's sums (module doc, I1)
            total.update({k: replies["interval"][k][order].sum(0) for k in ("dof", "fit")})
        count = torch.tensor(float(replies["mean"].shape[0]), dtype=F64) if units is None else units
        if robust is not None:  # Σ w_i units (exactly N when every weight is 1)
            count = robust.weights[order].sum() if bool((robust.weights != 1).any()) else count
        metric = total["gram"] / total["n"].clamp_min(1.0)
        args = RoundSums(server, replies, order, total, count, metric, pinned, forward)
        if not self.candidate_ems.running(replies):  # (R1: the choice frozen)
            return self.rounds_schedule.after(server, self._one_em_update(args), count)
        return self.rounds_schedule.after(server, self._candidates_update(args), count)

    def _one_em_update(self, sums: RoundSums) -> Tree:
        """The server update of one EM: without selection, under ``select_by = "marginal"``,
        or the chosen candidate's once the choice is frozen (fedprior_rounds R1)."""
        server, replies, order, total, count, metric, pinned, forward = sums
        frozen = self.candidate_ems.on  # R1: the chosen EM alone, in its own design metric
        if frozen:
            metric = self.candidate_ems.frozen_metric(server, metric)
        mu, sigma, noise_var = self.branch_pins.restart(
            server, pinned, total["gram"]
        ) or self._prior_update(server["mu"], total, count, metric, server["noise_var"], pinned)
        new = {"mu": mu, "sigma": sigma, "noise_var": noise_var, "support": total["support"]}
        new["box"] = self.support_box.fleet_box(total["gram"])
        if frozen:  # the choice as frozen
            new.update(self.candidate_ems.frozen(server))
        elif self.select != "none":  # select_by = "marginal": the noisy-BIC choice
            new.update(self.selection.marginal_choice(total["select"], count, pinned))
        if "noise" in replies:  # γ's step and test, the tail's test (fedprior_noise, N2–N6)
            noise = replies["noise"]
            new.update(self.noise_model.updates(server, noise, order, total["n"], replies["n"]))
        new.update(self.time_choice.kept(server, forward))
        if self.branch_orders:  # the features in use, without the ψ coordinates out of it
            new["mask"] = new.get("mask", self.selection.masks[-1]) * (~pinned).to(F64)
            new["pinned"] = pinned.to(F64)
        new.update(self.calibrated.update(server, replies, order, total))
        return new

    def _candidates_update(self, sums: RoundSums) -> Tree:
        """The server update while every candidate's EM runs (``select = "bic"``): each
        candidate's M-step and the fleet's BIC choice."""
        server, replies, order, total, count, metric, pinned, forward = sums
        cand = {k: v[order].sum(0) for k, v in replies["cand"].items()}
        args = (server, cand, total, count, metric, pinned, self._prior_update)
        stacked = self.candidate_ems.m_steps(*args)  # C3, then C4 (fedprior_candidates)
        scores, choice, same = self.candidate_ems.choice(cand, count, pinned)
        if forward is not None and float(forward["forward_scored"]) > 0:  # by each unit's future
            choice = self.time_choice.pick(
                torch.where(same, math.inf, forward["forward_scores"][:-3])
            )
        new = {
            **self.time_choice.kept(server, forward),
            **{key: v[choice] for key, v in stacked.items()},
            "box": self.support_box.fleet_box(total["gram"]),
            "mask": self.selection.masks[choice] * (~pinned).to(F64),
            **({"pinned": pinned.to(F64)} if self.branch_orders else {}),
            "choice": torch.tensor(choice),
            "scores": scores,
            "cand": stacked,
            **self.calibrated.update(server, replies, order, total),
            **(
                self.noise_model.updates(server, replies["noise"], order, total["n"], replies["n"])
                if "noise" in replies
                else {}
            ),
        }
        return new

    # ---- step 3, the personal model (module doc) ----
    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        """The unit's posterior model (:meth:`_personal`), or its best simple fit where that
        predicted its own future better (fedprior_choice, no harm)."""
        out = self._personal(down, state, data)
        if self.choose == "off":
            return out
        return self.time_choice.no_harm(self, down, state, data, out)

    def _personal(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        _, post = self._posterior(down, state, self._personal_moments(down, data))
        coef, cov = post.mean, post.cov
        m = self._model_mask(down)
        if m is not None:  # terms outside the chosen basis (or J) are not in the model (0, no σ)
            coef, cov = coef * m, cov * m.unsqueeze(-1) * m.unsqueeze(-2)
        out = {"coef": coef, "cov": cov, "noise_var": self._noise(down, state)}
        out.update(self.calibrated.personal(down, cov, out["noise_var"], data))  # τ², I3
        out["box"] = self.support_box.unit_box(down.get("box"), data)
        if self.noise_shape == "inputs":  # σ²(x) = σ_i² exp(γᵀx) (fedprior_noise)
            gamma = down.get("noise_gamma", torch.zeros(self.num_inputs, dtype=F64))
            out["noise_gamma"] = gamma.to(F64).expand(data.num_clients, -1).clone()
        return out

    def predict(self, params: Tree, x: Tensor) -> Tensor:
        """ψ(x)ᵀm_c (ψ = φ inside the support box, its tangent-plane continuation beyond):
        with a direction term, the branch average (the field's b is unknown)."""
        p = len(self.terms)
        phi, _ = self.support_box.guarded(params, x)
        value = (phi * params["coef"][..., :p].to(F64).unsqueeze(1)).sum(-1)
        return value.unsqueeze(-1).to(x.dtype)

    def predictive_std(self, params: Tree, x: Tensor) -> Tensor:
        """√(z(x)ᵀQ z(x) + s [+ g(x)²]) per row (clients, rows, 1), scaled.

        z, Q, s: :meth:`variance_form`. Beyond the unit's support box the prediction is
        the basis's tangent-plane continuation (:meth:`predict`); the gap g(x) between
        the polynomial and that continuation is added as model-form variance there.
        """
        q, s = self.variance_form(params)
        var = predictive_var(self.variance_design(x), q, s)
        excess = self.noise_model.excess(params, x)  # σ_i²(exp(γᵀg(x)) − 1): σ²(x) at the query
        if excess is not None:
            var = var + excess
        if "gp_x" in params:  # the prior's design-dependent error (fedprior_deploy, D2–D4)
            var = deployed_var(self, params, x, var)
        phi, beyond = self.support_box.guarded(params, x)
        if any_beyond(beyond):  # beyond the support: + (polynomial − linearized)² (model form)
            coef = params["coef"][..., : len(self.terms)].to(F64).unsqueeze(1)
            gap = ((legendre_products(x, self.terms) - phi) * coef).sum(-1)
            var = var + torch.where(beyond, gap * gap, 0.0)
        return var.sqrt().unsqueeze(-1).to(x.dtype)

    def interval_halfwidth(self, params: Tree, x: Tensor, std: Tensor | None = None) -> Tensor:
        """The central 95 % interval's half-width per row (clients, rows, 1), scaled.

        Without a direction term 1.96 σ. With one, the field's sweep b = ±1 is unknown
        (equal odds), so the error of the branch-average prediction is the mixture
        ½N(ψᵀm_h, s²) + ½N(−ψᵀm_h, s²), s² = σ(x)² − (ψᵀm_h)² (:meth:`predictive_std`'s
        variance less the direction term's mean part); its interval
        (:func:`~fedcal.core.bayes.mixture_halfwidth`) is narrower than 1.96 σ, which
        treats ±ψᵀm_h as Gaussian. ``std``: σ(x) if given (fedprior_drift's σ at each row's
        time), else :meth:`predictive_std`.
        """
        std = (self.predictive_std(params, x) if std is None else std).to(F64)
        return self.design_basis.halfwidth(params, x, std).to(x.dtype)

    # ---- client-level DP (fedprior_dp) ----
    def dp_statistics(self, down: Tree) -> dict[str, Statistic]:
        """Client-level DP: each uploaded statistic's public map and bound (core/privacy;
        :class:`~fedcal.algorithms.fedprior_dp.PrivateStatistics`); a ValueError for the
        settings DP does not cover (:meth:`PrivateStatistics.refusal`)."""
        why = self.private_statistics.refusal()
        if why is not None:
            raise ValueError(why)
        return self.private_statistics.statistics(down)

    # ---- a hostile site or unit (issue 21; fedprior_robust) ----
    def screen_view(
        self, replies: dict[str, Tensor], rows: Tensor, broadcast: Tree
    ) -> dict[str, Tensor]:
        """What the server's size screen judges (:meth:`RobustUploads.screen_view`)."""
        return self.robust_uploads.screen_view(replies, rows)

    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """Clients whose upload contradicts its declared rows or the broadcast prior, with
        the reason (:meth:`RobustUploads.inconsistent`); None when off."""
        frames = self.robust_uploads.frames(server, self._gram_counts_rows(server))
        return self.robust_uploads.inconsistent(frames, replies, weights, accepted)

    def consistency_check(self, server: Tree) -> Callable[..., dict[int, str] | None]:
        """:meth:`inconsistent_replies` bound to one round's ``server``, called as
        ``check(replies, weights, accepted)``, its priors' frames formed once, not once per
        chunk of a streamed round; a subclass's own :meth:`inconsistent_replies`
        (fedprior_drift adds checks) bound as it is."""
        if type(self).inconsistent_replies is not FedPrior.inconsistent_replies:
            return partial(self.inconsistent_replies, server)
        frames = self.robust_uploads.frames(server, self._gram_counts_rows(server))
        return partial(self.robust_uploads.inconsistent, frames)

    def _gram_counts_rows(self, server: Tree) -> bool:
        """Whether the uploaded Gram is the design's ΦᵀΦ, whose constant term is the unit's
        row count (a consistency check); fedprior_drift's whitened Gram is not."""
        return True

    # ---- a round streamed chunk by chunk (engine/streamed.py; fedprior_stream) ----
    def server_update_sums(self, server: Tree, sums: Tree, count: Tensor) -> Tree:
        """``server_update`` from Σ_i reply_i (``sums``, no clients axis) and N (``count``)."""
        one = self.streamed.as_cohort(sums)
        return self.server_update(server, one, torch.ones(1, dtype=torch.float64), units=count)

    def streaming_refused(self) -> str | None:
        """None when :meth:`server_update_sums` equals ``server_update``; else why not."""
        own = type(self).server_update is not FedPrior.server_update
        return self.streamed.refused(self.name, own)

    # ---- the time-respecting choice's hooks (fedprior_choice, fedprior_forward) ----
    def with_scaler(self, scaler: Any) -> FedPrior:
        """``raw_map`` from the run's scaler (``raw_input`` ≥ 0; :meth:`TimeChoice.raw_map_of`)."""
        if self.raw_input < 0:
            return self
        return dataclasses.replace(self, raw_map=self.time_choice.raw_map_of(scaler))

    def predictive_std_timed(self, params: Tree, data: ClientData) -> Tensor | None:
        """:meth:`predictive_std` at each row's time: after the unit's calibration, the
        fleet's forward variance (:meth:`ForwardInterval.std`)."""
        return self.time_choice.forward.std(params, data, self.predictive_std(params, data.x))

    def client_status(self, server: Tree, personal: Tree, x: Tensor, mask: Tensor) -> dict:
        """PriorStatus's flags, and ``weak`` for an implausible unit (fedprior_choice)."""
        flags = self.prior_status.client_status(server, personal, x, mask)
        if self.choose != "off":
            medians = server.get("status_medians")  # over the whole fleet (a chunked judge)
            args = (self, personal, x, mask, medians)
            flags["weak"] = flags["weak"] | self.time_choice.implausible_units(*args)
        return flags

    def status_values(self, personal: Tree, x: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """The values the implausible rule compares (:meth:`TimeChoice.status_values`)."""
        return self.time_choice.status_values(self, personal, x, mask)

    def unit_columns(self, params: Tree, train: ClientData) -> dict:
        """Per unit: the no-harm fall-back and σ factors (:meth:`TimeChoice.unit_columns`)."""
        return self.time_choice.unit_columns(params)

    def export_state(self, server: Tree) -> dict:
        """The fleet prior (:meth:`PriorStatus.export_state`) with the time choice's record."""
        state = self.prior_status.export_state(server, self.interval_note(server))
        record = self.time_choice.record(server)
        if record is not None:  # the time-respecting choice (fedprior_choice)
            selection = state.setdefault("selection", {"rule": "none", "chosen": {}})
            if self.candidate_ems.on:
                selection["rule"] = "forward"
            selection["forward"] = record
        return state

    def deploy_state(self, server: Tree, data: ClientData) -> dict | None:
        """The prior's design-dependent error model, prior.json's ``"discrepancy"``, or None
        (:func:`~fedcal.algorithms.fedprior_deploy.deploy_state`: when it is learned)."""
        return deploy_state(self, server, data)


class RoundSums(NamedTuple):
    """One round's server-side sums, as both M-step paths (one EM, every candidate) read them."""

    server: Tree
    replies: Tree
    order: Tensor
    total: dict
    count: Tensor
    metric: Tensor
    pinned: Tensor
    forward: Tree | None

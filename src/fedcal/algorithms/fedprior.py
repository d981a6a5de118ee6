"""Fleet-prior calibration: federated empirical Bayes over per-sensor coefficients (ours).

Units of one design differ, but not arbitrarily: their calibration coefficients vary around a
fleet mean along a few directions. The federation learns that distribution without pooling
anyone's data, and a unit with a handful of chamber points is calibrated by placing itself in
it (empirical Bayes; docs/calibration-guide.md). The model is linear in its parameters:

    y_i = φ(x)ᵀ c_i + ε,   ε ~ N(0, σ_i²),   c_i ~ N(μ, Σ),

with φ a Legendre-product basis of the scaled inputs (:func:`legendre_products`): the tensor
product up to ``orders`` for a two-input pressure sensor (the inputs are scaled by their fixed
physical ranges), or every product up to a total ``degree`` for any other set of features.

One round is one ECME iteration (:mod:`fedcal.core.bayes`):

1. **E-step, client i** (closed form, float64): from its moments (Φ_iᵀΦ_i, Φ_iᵀy_i, y_iᵀy_i,
   n_i) and the broadcast (μ, Σ, σ²), the posterior N(m_i, V_i) of its coefficients. It
   uploads only what the server's sums need: m_i, S_i = m_i m_iᵀ + V_i, the GLS terms
   Φ_iᵀC_i⁻¹Φ_i and Φ_iᵀC_i⁻¹(y_i − Φ_iμ), its expected residual sum of squares r_i, n_i, and
   how far its own points determine each direction (for the identification check). With
   ``noise = "sensor"`` it keeps a private σ_i² = (r_i + ν σ²)/(n_i + ν): its residuals shrunk
   toward the fleet's by ν pseudo-points (the MAP under a scaled-inverse-χ² prior centred on
   σ²), so a noisy unit is not trusted like a clean one, nor a unit with three points on its
   own noise.
2. **M-step, server**: μ by generalized least squares, Σ by EM's update
   (1/N) Σ_i E[(c_i − μ)(c_i − μ)ᵀ], shrunk toward its diagonal (``shrinkage_units``), optionally
   ``rank`` factors plus a diagonal, its eigenvalues floored (core.bayes.regularize);
   σ² = Σ_i r_i / Σ_i n_i (``interval = "calibrated"``: on residual degrees of freedom, I1 of
   :mod:`~fedcal.algorithms.fedprior_interval`). Only sums over clients enter, in a canonical
   order; with ``robust = "full"`` (issue 21, docs/safety.md) an upload that contradicts its
   declared count or the broadcast prior is rejected, and each unit's terms enter times a
   weight from its leave-one-out distance to the other units.
3. **Personal model** (``personalize``): the posterior mean m_i, a precision-weighted
   interpolation between the unit's own least-squares fit and the fleet mean, with its
   covariance V_i: every prediction carries the predictive variance φ(x)ᵀV_iφ(x) + σ_i²
   (:meth:`FedPrior.predictive_std`).

Identification. A direction of coefficient space that no unit's data determine (e.g.
curvature in temperature when every unit saw only two temperatures) cannot be learned. The
server counts, per direction, how many units' own points determine it (the eigenvalues of
Σ_i [I − (I + s²G_i/σ_i²)⁻¹], s = ``init_scale``); along directions informed by fewer than
``min_informed`` units it keeps the vague start (μ unchanged, variance s²), so predictions that
lean on them carry a wide σ rather than a confident number, and the run reports them as weakly
identified (:meth:`PriorStatus.identification`). When every unit has fewer points than the
basis has terms, lower the orders (measured in docs/results/fleet-prior.md).

This module is the model and its federated EM (the E-step in ``client_update``, the M-step in
``_prior_update`` and ``server_update``, the personal model); its settings are
:class:`~fedcal.algorithms.fedprior_settings.FedPriorSettings`. Every option around it is a
part with declared state, built once (:mod:`~fedcal.algorithms.fedprior_parts`, whose doc
lists them: the basis chosen by the fleet's evidence, every candidate's EM running these
equations on its terms, the noise model, the calibrated interval, the time choice, ...); the
server's trees around the M-step are :mod:`~fedcal.algorithms.fedprior_state`'s; the engine's
optional hooks (core/hooks.py) are the parts' methods (``Delegate``) or a few lines here (the
table of parts: docs/design.md, "The flagship algorithms, one idea per file").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, ClassVar

import torch
from torch import Tensor

from fedcal.algorithms import fedprior_state
from fedcal.algorithms.fedprior_basis import model_mask, phi_terms, psi_terms, unit_noise
from fedcal.algorithms.fedprior_choice import SIMPLE
from fedcal.algorithms.fedprior_declared import settings_of
from fedcal.algorithms.fedprior_deploy import deploy_state
from fedcal.algorithms.fedprior_deployed import deployed_var
from fedcal.algorithms.fedprior_interval_parts import residual_terms
from fedcal.algorithms.fedprior_noise import sensor_noise
from fedcal.algorithms.fedprior_parts import Delegate, FedPriorParts, build_parts
from fedcal.algorithms.fedprior_select import _masked
from fedcal.algorithms.fedprior_select import term_name as term_name  # re-exported
from fedcal.algorithms.fedprior_settings import FedPriorSettings
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
from fedcal.core.task import Task
from fedcal.core.tree import Tree


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
    # Measured (studies/poisoning.py): a coordinate-wise median of the second moments is not
    # PD (Cholesky fails), a trimmed mean costs 24× on a clean fleet; Krum keeps them whole.
    robust_rules = ("mean", "krum")
    # Not size-screened: every candidate's statistics ("cand/"; a client is judged by the
    # chosen candidate's: a misfit sub-basis has large ones for honest units too), and "gram"
    # (ΦᵀΦ: per row a moment of the unit's inputs, which honest units differ in by 10²–10³,
    # docs/statuses.md), judged by the consistency check (PSD, G_00 = n: core/robust.py).
    unscreened_replies = ("cand/", "interval/", "noise/", "gram", "select", "choice/", "loglik")

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
        args = (self.num_inputs, self.terms, self.branch_terms)
        return build_parts(settings_of(self), *args)

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
    variance_form = Delegate("design_basis")  # (Q, s): σ² = zᵀQz + s, the exports' too
    beyond_support = Delegate("support_box", "beyond")  # (clients, rows): beyond the unit's box
    outlier_weights = Delegate("robust_uploads")  # each client's M-step weight (or None)
    screen_view = Delegate("robust_uploads")  # what the server's size screen judges
    # client-level DP: each statistic's public map and bound (or a ValueError: not covered)
    dp_statistics = Delegate("private_statistics", "checked")
    unit_columns = Delegate("time_choice")  # per unit: the no-harm fall-back and σ factors
    outlier_inputs = Delegate("streamed")  # a streamed round's per-unit leaves (StreamsSums)
    picked_leaves = Delegate("streamed")
    pick_inputs = Delegate("streamed")
    pick_reply = Delegate("streamed")
    interval_note = Delegate("calibrated", "note")  # why no interval is stated for some units
    weak_units = Delegate("calibrated")  # I3's declined units

    def personal_shapes(self) -> dict[str, tuple[int, ...]]:
        """One sensor's :meth:`personalize` tree: shapes a loaded model file must have."""
        return fedprior_state.personal_shapes(self.parts, self.deploy_rows)

    # ---- the contract --------------------------------------------------------
    def server_init(self, params: Tree) -> Tree:
        """The vague start and each part's state (fedprior_state.server_start)."""
        return fedprior_state.server_start(self.parts, self.init_scale, self.init_noise)

    def broadcast(self, server: Tree) -> Tree:
        """The prior (μ, Σ, σ²) and each part's keys (fedprior_state.broadcast)."""
        return fedprior_state.broadcast(self.parts, server)

    def client_init(self, down: Tree) -> Tree:
        return {"noise_var": down["noise_var"].clone(), **self.candidate_ems.client_init(down)}

    def _noise(self, down: Tree, state: Tree) -> Tensor:
        return unit_noise(self.noise, down, state)

    def derive(self, data: ClientData) -> dict[str, Tensor] | None:
        """The units' unweighted moments of step 1, which their data alone fix, formed once by
        the engine (``ClientData.derived``; :meth:`DesignBasis.derived`), not every round
        (issue 25.1). None with row weights (fedprior_noise): they depend on the broadcast."""
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
        """Step 1 (module doc): the unit's posterior under the broadcast prior, its terms of
        the M-step sums (:meth:`_e_step_sums`) and each part's uploads."""
        design, rw = None, None
        # select_by = "marginal": the EM runs on the full basis (without the ψ coordinates J
        # out of the model), whatever candidate is chosen: its E-step and noise model too
        marginal = self.select != "none" and not self.candidate_ems.on
        em = {k: v for k, v in down.items() if k != "mask"} if marginal else down
        if self.noise_model.weighted:  # rows weighted by 1/σ²(x), t-weights (N1/N4)
            design = self.design(data.x, data.branch)
            rw = self.noise_model.row_weights(em, data, design)
            full = self.noise_model.moments(design, data, rw)
        else:
            full = self._client_moments(down, data)  # once: candidates' are masks of these
        # With selection the chosen candidate's E-step is also in the batch below, but is run
        # on its own: with noise = "sensor" its σ_i² is last round's choice's; with one fleet
        # σ² the batched one differs in the last bits (taking it saved 4 % of an update).
        stats, post = self._posterior(em, state, full)
        reml = full.n if self.interval == "calibrated" else None
        chosen = self._e_step_sums(post, stats.gram, self._noise(down, state), reml)
        # The reply's leaf order is part of its wire format (and of DP's noise draws).
        reply = {key: chosen[key] for key in ("mean", "second", "gls_gram", "gls_rhs", "rss")}
        # The design's own Gram ΦᵀΦ (the input box's sums, the row-count check), unweighted.
        gram = full.gram if rw is None else moments(design, data.y[..., 0], data.mask).gram
        reply.update(n=full.n, gram=gram, support=chosen["support"])
        if self.accelerate != "off":  # ℓ_i(θ) at the broadcast, SQUAREM's check (fedprior_accel)
            reply["loglik"] = chosen["loglik"]
        if self.branch_orders:  # the whole design's, whatever J: BranchPins.unidentified's input
            reply["branch_support"] = data_support(gram, self._noise(down, state), self.init_scale)
        if self.interval == "calibrated" and "probe_x" in down:
            # Unscreened ("interval/"): a unit's residual terms scale with its rows.
            holds = self.rounds_schedule.holds_out(down)  # R2
            held = self.calibrated.heldout(down, state, data, rw, holds)
            reply["interval"] = {"dof": chosen["dof"], "fit": chosen["fit"], **held}
        if self.noise_shape == "inputs":  # γ's score, information and evidence (N2)
            reply["noise"] = self.noise_model.uploads(em, data, design, post, rw[1])
        if self.noise_tail == "auto":  # the tail's evidence d_i (N6)
            ratio = self.noise_model.tail_ratio(em, data, design)
            reply.setdefault("noise", {})["tail_ratio"] = ratio
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
        # jitter (core.bayes.safe_cholesky): 0 none, 1 an eigenvalue floor; per unit and round
        metrics = {"train_loss": fit_mse, "loglik": post.loglik, "jitter": post.jitter}
        return ClientResult(reply, new_state, metrics)

    def _e_step_sums(
        self, post: Posterior, gram: Tensor, noise: Tensor, n: Tensor | None = None
    ) -> Tree:
        """A unit's terms of the M-step sums (module doc, step 1): m_i, m_i m_iᵀ + V_i, the
        GLS terms, the expected RSS, its log-evidence and its data support."""
        return {
            "mean": post.mean,
            "second": (post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2)).add_(post.cov),
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
        moments_sums = (total["gls_gram"], total["gls_rhs"], total["mean"], total["second"])
        mu, sigma_hat = m_step(*moments_sums, count, old_mu, self.mean_scale)
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
        """Step 2 (module doc): the sums in a canonical order, each unit once, times its outlier
        weight (``units``: N when the replies are already summed, fedprior_stream), then
        :meth:`_prior_update` per EM and each part's update (fedprior_state)."""
        robust = self.outlier_weights(server, replies)
        sums = fedprior_state.round_sums(self.parts, server, replies, units, robust)
        new = fedprior_state.next_server(self.parts, sums, self._prior_update)
        loglik = sums.total.get("loglik")  # ℓ of the broadcast: the one EM's SQUAREM step (A1)
        return self.rounds_schedule.after(server, new, sums.count, loglik)

    # ---- step 3, the personal model (module doc) ----
    def personalize(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        """The unit's posterior model (:meth:`_personal`), or its best simple fit where that
        predicted its own future better (fedprior_choice, no harm)."""
        out = self._personal(down, state, data)
        if self.choose == "off":
            return out
        return self.time_choice.no_harm(self, down, state, data, out)

    def _personal(self, down: Tree, state: Tree, data: ClientData) -> Tree:
        """Step 3: the posterior N(m_i, V_i) in the model's terms, σ_i² and each part's keys."""
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
        gap = self.support_box.gap_var(params, x)  # beyond the support: g(x)² (model form)
        if gap is not None:
            var = var + gap
        return var.sqrt().unsqueeze(-1).to(x.dtype)

    def interval_halfwidth(self, params: Tree, x: Tensor, std: Tensor | None = None) -> Tensor:
        """The central 95 % interval's half-width per row (clients, rows, 1), scaled: 1.96 σ,
        or with a direction term (the field's sweep b = ±1 unknown) that of the mixture
        ½N(ψᵀm_h, s²) + ½N(−ψᵀm_h, s²), s² = σ(x)² − (ψᵀm_h)² (:meth:`DesignBasis.halfwidth`).
        ``std``: σ(x) if given (fedprior_drift's at each row's time), else :meth:`predictive_std`.
        """
        std = (self.predictive_std(params, x) if std is None else std).to(F64)
        return self.design_basis.halfwidth(params, x, std).to(x.dtype)

    # ---- a hostile site or unit (issue 21; fedprior_robust) ----
    def inconsistent_replies(
        self, server: Tree, replies: Tree, weights: Tensor, accepted: Tensor
    ) -> dict[int, str] | None:
        """Clients whose upload contradicts its declared rows or the broadcast prior, with
        the reason (:meth:`RobustUploads.inconsistent`); None when off."""
        frames = self.robust_uploads.frames(server, self._gram_counts_rows(server))
        return self.robust_uploads.inconsistent(frames, replies, weights, accepted)

    def consistency_check(self, server: Tree) -> Callable[..., dict[int, str] | None]:
        """:meth:`inconsistent_replies` bound to one round's ``server`` (``check(replies,
        weights, accepted)``), its frames formed once, not once per chunk of a streamed round;
        a subclass's own (fedprior_drift adds checks) bound as it is."""
        if type(self).inconsistent_replies is not FedPrior.inconsistent_replies:
            return partial(self.inconsistent_replies, server)
        frames = self.robust_uploads.frames(server, self._gram_counts_rows(server))
        return partial(self.robust_uploads.inconsistent, frames)

    def _gram_counts_rows(self, server: Tree) -> bool:
        """Whether the uploaded Gram is ΦᵀΦ, its constant term the row count (not drift's)."""
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
        """σ at each row's time: after calibration, the fleet's (:meth:`ForwardInterval.std`)."""
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

    def export_state(self, server: Tree) -> dict:
        """The fleet prior with the time choice's record (fedprior_state.export_state)."""
        return fedprior_state.export_state(self.parts, server, self.interval_note(server))

    def deploy_state(self, server: Tree, data: ClientData) -> dict | None:
        """prior.json's ``"discrepancy"`` (fedprior_deploy.deploy_state), or None."""
        return deploy_state(self, server, data)

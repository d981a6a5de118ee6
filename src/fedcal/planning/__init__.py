"""Choose a new unit's chamber points from the fleet prior (``fedcal plan``).

A fleet prior N(μ, Σ) over a unit's coefficients, with noise σ², is a
Gaussian linear model (:mod:`fedcal.algorithms.fedprior`). For such a model
the posterior covariance of a unit measured at the design D (its points'
features Φ_D, rows [φ(x), b·ψ(x)], b = +1 up, −1 down)

    V(D) = (Φ_Dᵀ Φ_D / σ² + Σ⁻¹)⁻¹

does not depend on the readings: before a unit enters the chamber, the prior
says how well each candidate design will calibrate it.

Criterion (I-optimality, integrated predictive variance). A calibrated unit
is used over its operating range R (the chamber's pressure range × the
temperature range the fleet was calibrated over), at a point x uniform over R
with an unknown sweep direction. Its expected squared error there is the
expected predictive variance

    J(D) = E_{x∼U(R)} E_y[ s²(x | D, y) ],
    s²(x | D, y) = φ(x)ᵀ V_cc φ(x) + σ² + τ²(D) + ψ(x)ᵀ (m_h m_hᵀ + V_hh) ψ(x)

(fedprior's predictive variance with the direction term, m_h the posterior
mean of the hysteresis coefficients, and with ``interval = "calibrated"`` the
discrepancy τ² the fleet's hold-out learned for designs of fewer than twice the
probe's points, 0 for larger ones: fedprior "Intervals", I2–I3). A design
smaller than the probe gets no stated interval from the model (declined); the
criterion still scores it with the probe's τ² (the greedy construction passes
through such designs) and :class:`Expected` says ``declined``. Averaged over the readings the unit
will give, E_y[m_h m_hᵀ + V_hh] = μ_h μ_hᵀ + Σ_hh (law of total variance), so
E_y s² is the predictive σ² ``calibrate`` states
(:func:`fedcal.prior.posterior.predictive_std`) evaluated at the posterior of the design
(:func:`fedcal.prior.posterior.calibrate_units`, ``calibrate``'s own function, on readings
equal to the prior mean, which leave the mean at μ) with the h-block of its covariance
set to the prior's Σ_hh (:mod:`fedcal.prior.plan`, NumPy). This module never writes the
variance formula itself: any term ``calibrate`` adds to its predictive variance flows in.
A prior that path does not cover (:func:`fedcal.prior.posterior.unsupported`) is
forecast by ``calibrate``'s torch path instead (:mod:`fedcal.planning_torch`,
``fedcal[neural]``).
The direction still matters: a point swept up sees c + h along ψ, one swept
down c − h, and the joint prior splits them; what h adds in the field does
not shrink with the design (its sign is unknown there).

R is the chamber's pressure range × the temperature range the fleet was
calibrated over (the prior's ``input_range``), whatever set points the
chamber can reach.

Why I-optimality: the figure a user is judged by is the RMSE over the range
(√J is its expected value's root); D-optimality would spend points on
coefficients that barely move the prediction inside R. The worst case over
the range, max_x s(x), is reported beside it (a minimax design would chase the
corners, where the range is rarely used). J is evaluated on a regular (P, T)
Gauss–Legendre product rule of R (:data:`QUADRATURE` nodes in P × T, exact for
polynomials of degree < 2·nodes in each; the worst case on a regular grid,
:data:`GRID`); the response input (frequency) of a chamber point
(P, T) is the one the prior-mean unit gives there (φ(x)ᵀμ_c = P solved by
bisection), so a design needs no unit's data.

Over the fleet's units. Under a Gaussian prior with one fleet noise level the
predictive variance is the same for every unit; units differ in their actual
error. A unit's mean squared error over R is

    MSE = E_x[(φᵀ e_c)² + (ψᵀh)²] + (the rest of s²),   (e_c, h) ∼ N((0, μ_h), C)

with e_c = c − m_c its posterior error and C the covariance above (V_cc, V_ch
and Σ_hh): a quadratic form of a Gaussian. Its distribution is drawn
(:data:`QUANTILE_DRAWS` fixed-seed draws) and shifted so that its mean is J
exactly; the design's figures are then E[√MSE] (the fleet's mean RMSE) and
its ``quantile`` (default 0.95, the 95th percentile: the "worst" of 20
units). With ``noise = "sensor"`` the stored prior does not hold the spread of
the units' noise levels, so every unit is given the fleet's σ² (said, not
hidden).

Optimizer. A design is K plateau temperatures (from the chamber's feasible
set points) and N points (a plateau, a pressure step, a direction), every
plateau at least one point. Greedy construction (add the point that lowers J
most; a new plateau is opened while fewer than K are) then a best-improvement
exchange (Fedorov 1972): each pass evaluates, in one batch, every move of one
plateau to another set point and of one point to another (plateau, pressure,
direction), and applies the best if it lowers J. Exchange starts from the
greedy design and from the standard grid (and from a given start); the best
is returned, so the result is never worse than any start.

Chamber time: K·plateau_minutes + N·point_minutes.

The modules, top down (each imports only those below it; an import contract):

    prepare     a stored prior made ready (:func:`planner`, its forecaster), :func:`plan_design`
    search      the optimizer (:func:`optimize`, :func:`cheapest`)
    sequential  a unit part-way through: done, or its next points (:func:`unit_next`)
    tables      named designs compared, a design's σ over the range
    forecast    a design's expected posterior, the criterion J, its expected figures
    chamber     the chamber, a design, the standard grids
"""

from fedcal.planning.chamber import (
    DEFAULT_PRESSURES,
    DESIGN_COLUMNS,
    Chamber,
    Design,
    check_design,
    default_chamber,
    grid_design,
    standard_grids,
)
from fedcal.planning.forecast import (
    BATCH,
    GRID,
    QUADRATURE,
    Expected,
    Planner,
    criterion,
    evaluate,
    expected_variance,
    features,
    meets,
    pack,
    posteriors,
)
from fedcal.planning.prepare import forecaster, plan_design, planner
from fedcal.planning.search import MAX_PASSES, Plan, cheapest, exchange, greedy, optimize
from fedcal.planning.sequential import NextStep, as_design, next_points, unit_next
from fedcal.planning.tables import compare, sigma_map
from fedcal.prior.plan import prior_base

__all__ = [
    "BATCH",
    "DEFAULT_PRESSURES",
    "DESIGN_COLUMNS",
    "GRID",
    "MAX_PASSES",
    "QUADRATURE",
    "Chamber",
    "Design",
    "Expected",
    "NextStep",
    "Plan",
    "Planner",
    "as_design",
    "cheapest",
    "check_design",
    "compare",
    "criterion",
    "default_chamber",
    "evaluate",
    "exchange",
    "expected_variance",
    "features",
    "forecaster",
    "greedy",
    "grid_design",
    "meets",
    "next_points",
    "optimize",
    "pack",
    "plan_design",
    "planner",
    "posteriors",
    "prior_base",
    "sigma_map",
    "standard_grids",
    "unit_next",
]

"""The σ of a unit calibrated from the prior's discrepancy model, for the firmware exports.

A unit calibrated later (``fedcal calibrate``) whose σ is the prior's design-dependent
error model (:mod:`fedcal.prior.discrepancy`, D2–D4; parameters ``gp_*`` of
:mod:`fedcal.algorithms.fedprior_deployed`) has, at scaled inputs z with unguarded basis
terms φ(z) (the form's terms, branch terms included),

    v(z) = κ²s_i²(t/1.96)² [β (φᵀQφ + s − σ_i²) + σ_i² + a² q(z)],
    q(z) = 1 − 2 g(z)ᵀk_D(z) + g(z)ᵀK_DD g(z),  g(z) = A φ(z)  (A zero on branch terms),

with (Q, s) the unit's :meth:`~fedcal.algorithms.fedprior.FedPrior.variance_form`. Since
g is linear in φ, gᵀK_DD g = φᵀ(AᵀK_DD A)φ, so with c = κ²s_i²(t/1.96)² (D4's factor):

    v(z) = φᵀ W φ + w₀ − Σ_n k(z, d_n) (B φ)_n,
    W = c (β Q + a² AᵀK_DD A),  w₀ = c (β (s − σ_i²) + σ_i² + a²),  B = 2 c a² A,

k(z, d) = exp(−½ Σ_j ((z_j − d_j)/ℓ_j)²) and d_n the unit's K design points (scaled). W is
p×p (T×T with branch terms), B is K×T: K_DD is folded into W, so no K×K matrix is
stored. The whole of v is carried in double (the form's float factor of the unit is 0).
The clamps of :func:`~fedcal.algorithms.fedprior_deployed.deployed_var` (q ≥ 0, v_c ≥ 0)
only cut rounding: q is a variance (of δ(z) − gᵀδ_D) and φᵀQφ ≥ 0, so v is the same
(checked to 1e-9 relative by :func:`fedcal.report.linear_export.check_form`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedcal.prior.deployment import GP_LEAVES

BYTES = 8  # every stored number of this block is a double


@dataclass(frozen=True)
class DeployedSigma:
    """Per deployed unit (G of them, K design-point rows padded to the largest)."""

    rows: np.ndarray  # (S,) int: the unit's row in this block, −1 if its σ is not this one
    quad: np.ndarray  # (G, T, T) W
    const: np.ndarray  # (G,) w₀
    lengths: np.ndarray  # (G, F) ℓ
    points: np.ndarray  # (G, K, F) the design points d_n (scaled inputs), 0 on padding
    cross: np.ndarray  # (G, K, T) B, 0 on padding
    count: np.ndarray  # (G,) int K_i

    def subset(self, used: np.ndarray) -> DeployedSigma:
        """The block over the form's used terms (the others are 0 in W and B)."""
        return DeployedSigma(
            self.rows,
            self.quad[:, used][:, :, used],
            self.const,
            self.lengths,
            self.points,
            self.cross[:, :, used],
            self.count,
        )

    @property
    def used_terms(self) -> np.ndarray:
        """(T,) terms W or B uses."""
        return np.any(self.quad != 0, (0, 1)) | np.any(self.cross != 0, (0, 1))

    def variance(self, row: int, z: np.ndarray, phi: np.ndarray) -> np.ndarray:
        """v(z) (module docstring) at scaled inputs z (rows, F), basis terms φ (rows, T)."""
        k = self.count[row]
        d = (z[:, None, :] - self.points[row, None, :k]) / self.lengths[row]
        kern = np.exp(-0.5 * (d * d).sum(-1))  # (rows, K)
        quad = np.einsum("rt,ts,rs->r", phi, self.quad[row], phi)
        return quad + self.const[row] - (kern * (phi @ self.cross[row, :k].T)).sum(-1)

    def bytes_per_unit(self) -> int:
        """Bytes of one deployed unit's rows (W packed, w₀, ℓ, d, B, K as one byte)."""
        _, k, t = self.cross.shape
        f = self.lengths.shape[-1]
        return BYTES * (t * (t + 1) // 2 + 1 + f + k * f + k * t) + 1


def deployed_sigma(params: dict, q, s) -> DeployedSigma | None:
    """The block of the units whose σ is the discrepancy model's (``gp_amp`` > 0 and a
    stated σ), from the stacked float64 ``params`` and the (Q, s) of ``variance_form``
    (tensors, or NumPy arrays: :mod:`fedcal.report.served`); None when no unit has one."""
    if "gp_amp" not in params:
        return None
    params = {k: np.asarray(params[k]) for k in (*GP_LEAVES, "noise_var")}
    q, s = np.asarray(q), np.asarray(s)
    amp = params["gp_amp"]
    which = np.flatnonzero((amp > 0) & np.isfinite(s))
    if len(which) == 0:
        return None
    rows = np.full(len(amp), -1)
    rows[which] = np.arange(len(which))
    mask = params["gp_mask"] > 0
    count = mask.sum(1)[which]
    k, p, t = int(count.max()), params["gp_a"].shape[-1], q.shape[-1]
    f = params["gp_x"].shape[-1]
    quad, const = np.zeros((len(which), t, t)), np.zeros(len(which))
    points, cross = np.zeros((len(which), k, f)), np.zeros((len(which), k, t))
    lengths = params["gp_len"][which]
    for g, i in enumerate(which):
        c, beta, a2 = (float(params[n][i]) for n in ("gp_scale", "gp_beta", "gp_amp"))
        noise = float(params["noise_var"].reshape(-1)[i])
        xd = params["gp_x"][i][mask[i]]
        a = params["gp_a"][i][mask[i]]  # (K_i, p)
        d = (xd[:, None, :] - xd[None, :, :]) / lengths[g]
        k_dd = np.exp(-0.5 * (d * d).sum(-1))
        quad[g] = c * beta * q[i]
        quad[g, :p, :p] += c * a2 * (a.T @ k_dd @ a)
        const[g] = c * (beta * (s[i] - noise) + noise + a2)
        points[g, : count[g]] = xd
        cross[g, : count[g], :p] = 2.0 * c * a2 * a
    return DeployedSigma(rows, quad, const, lengths, points, cross, count)


def carried(params: dict, q, s) -> tuple[np.ndarray, np.ndarray, DeployedSigma | None]:
    """(Q, s, block) for the export: the units whose σ is the discrepancy model's are
    carried whole by :func:`deployed_sigma`'s block, so their basis factor is 0."""
    deployed = deployed_sigma(params, q, s)
    q, s = np.asarray(q), np.asarray(s)
    if deployed is not None:
        gp = deployed.rows >= 0
        q, s = np.where(gp[:, None, None], 0.0, q), np.where(gp, 0.0, s)
    return q, s, deployed


def _lit(v: float) -> str:
    return f"{float(v):.17e}"


def _rows(values: np.ndarray) -> str:
    if values.ndim == 1:
        return "{" + ", ".join(_lit(v) for v in values) + "}"
    return "{" + ",\n    ".join(_rows(v) for v in values) + "}"


def c_lines(block: DeployedSigma) -> list[str]:
    """The header's tables and ``fedcal_deployed_var`` (double; module docstring)."""
    g, k, t = block.cross.shape
    idx = np.tril_indices(t)
    packed = np.stack([w[idx] for w in block.quad])
    return [
        "/* Units calibrated from the prior's discrepancy model (docs/firmware.md, 'Deployed",
        " * units'): v = phi^T W phi + w0 - sum_n k(z, d_n) (B phi)_n, in double, with",
        " * k(z, d) = exp(-1/2 sum_j ((z_j - d_j) / l_j)^2), z the scaled inputs. */",
        f"#define FEDCAL_GP_UNITS {g}",
        f"#define FEDCAL_GP_POINTS {k}",
        "/* The unit's row in the tables below; -1: its σ is the basis form's. */",
        "static const short fedcal_gp_row[FEDCAL_NUM_SENSORS] = {"
        + ", ".join(str(int(r)) for r in block.rows)
        + "};",
        "static const unsigned char fedcal_gp_count[FEDCAL_GP_UNITS] = {"
        + ", ".join(str(int(c)) for c in block.count)
        + "};",
        "/* W, packed lower triangle (row-major) of the symmetric matrix. */",
        "static const double fedcal_gp_quad[FEDCAL_GP_UNITS]"
        f"[FEDCAL_NUM_TERMS * (FEDCAL_NUM_TERMS + 1) / 2] = {_rows(packed)};",
        f"static const double fedcal_gp_const[FEDCAL_GP_UNITS] = {_rows(block.const)};",
        "static const double fedcal_gp_len[FEDCAL_GP_UNITS][FEDCAL_NUM_INPUTS] = "
        f"{_rows(block.lengths)};",
        "static const double fedcal_gp_points[FEDCAL_GP_UNITS][FEDCAL_GP_POINTS]"
        f"[FEDCAL_NUM_INPUTS] = {_rows(block.points)};",
        "static const double fedcal_gp_cross[FEDCAL_GP_UNITS][FEDCAL_GP_POINTS]"
        f"[FEDCAL_NUM_TERMS] = {_rows(block.cross)};",
        "/* v of deployed unit row `g` at raw inputs x, unguarded basis terms phi. */",
        "static inline double fedcal_deployed_var(int g, const double *x,"
        " const FEDCAL_BASIS_T *phi) {",
        "    const double *W = fedcal_gp_quad[g];",
        "    double var = fedcal_gp_const[g];",
        "    for (int r = 0; r < FEDCAL_NUM_TERMS; ++r) {",
        "        double row = 0;",
        "        for (int c = 0; c < r; ++c) row += W[r * (r + 1) / 2 + c] * (double)phi[c];",
        "        var += (double)phi[r] * (2 * row + W[r * (r + 1) / 2 + r] * (double)phi[r]);",
        "    }",
        "    for (int n = 0; n < fedcal_gp_count[g]; ++n) {",
        "        double d2 = 0, b = 0;",
        "        for (int j = 0; j < FEDCAL_NUM_INPUTS; ++j) {",
        "            double z = (x[j] - fedcal_x_offset[j]) / fedcal_x_scale[j];",
        "            double d = (z - fedcal_gp_points[g][n][j]) / fedcal_gp_len[g][j];",
        "            d2 += d * d;",
        "        }",
        "        for (int t = 0; t < FEDCAL_NUM_TERMS; ++t)",
        "            b += fedcal_gp_cross[g][n][t] * (double)phi[t];",
        "        var -= exp(-0.5 * d2) * b;",
        "    }",
        "    return var;",
        "}",
    ]


def json_unit(block: DeployedSigma, row: int) -> dict:
    """One deployed unit's numbers for the JSON (``sigma_deployed``)."""
    k = int(block.count[row])
    return {
        "quad": block.quad[row].tolist(),
        "const": float(block.const[row]),
        "lengths": block.lengths[row].tolist(),
        "points": block.points[row, :k].tolist(),
        "cross": block.cross[row, :k].tolist(),
    }


JSON_FORMULA = (
    "; a unit with sigma_deployed (calibrated from the prior's discrepancy model): "
    "sigma = |scaler.y_scale| * sqrt(phi(u)^T quad phi(u) + const - sum_n k_n (cross[n] . "
    "phi(u)) + g^2), k_n = exp(-1/2 sum_j ((u_j - points[n][j]) / lengths[j])^2)"
)

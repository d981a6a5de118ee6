"""The consistency check decided by Cholesky gives the eigenvalue check's verdicts (issue 25.1).

``core.robust.inconsistencies`` and ``gram_problems`` clear most units by Cholesky
factorizations of shifted matrices and compute eigenvalues only for the others. The reference
here is the check as it was: eigenvalues of every unit, then the thresholds. Units are planted
on both sides of every threshold (a few per cent of the tolerance away), beside non-finite
uploads and honest E-step uploads; the two must flag the same units with the same messages.
"""

from __future__ import annotations

import math

import torch

from fedcal.core.bayes import Moments, posterior
from fedcal.core.robust import (
    GRAM_TOL,
    gram_problems,
    inconsistencies,
    prior_frame,
    whitened_gaps,
    whitened_tolerance,
)

F64 = torch.float64


def eigvalsh_or_nan(a):
    """eigvalsh of every matrix, NaN for a non-finite one (what LAPACK gives when it does not
    refuse it)."""
    out = torch.full(a.shape[:-1], torch.nan, dtype=a.dtype)
    for i in range(a.shape[0]):
        if bool(torch.isfinite(a[i]).all()):
            out[i] = torch.linalg.eigvalsh(a[i])
    return out


def reference_gram_problems(gram, n, constant_first):
    """gram_problems with the smallest eigenvalue of every unit (the check before 25.1)."""
    g = 0.5 * (gram.to(F64) + gram.to(F64).transpose(-2, -1))
    scale = torch.diagonal(g, dim1=-2, dim2=-1).abs().amax(-1).clamp_min(1e-300)
    low = eigvalsh_or_nan(g)[..., 0]
    not_psd = ~(low >= -GRAM_TOL * scale)
    off = torch.zeros_like(not_psd)
    if constant_first and n is not None:
        rows = n.to(F64)
        off = ~((g[..., 0, 0] - rows).abs() <= GRAM_TOL * rows.clamp_min(1.0))
    out = {}
    for i in (not_psd | off).nonzero()[:, 0].tolist():
        if bool(not_psd[i]):
            out[i] = f"Gram matrix not positive semi-definite (eigenvalue {float(low[i]):.3g})"
        else:
            out[i] = (
                f"Gram's constant term {float(g[i, 0, 0]):.6g} is not its row count {float(n[i]):g}"
            )
    return out


def reference_inconsistencies(stats, mu, sigma, declared=None, constant_first=True):
    """inconsistencies with the eigenvalues of every unit (the check before 25.1)."""
    g = whitened_gaps(stats, mu, sigma)
    tol = float(whitened_tolerance(sigma))
    bad = (
        ~(g["rss"] >= 0)
        | ~torch.isfinite(g["rss"])
        | (g["w_low"] < -tol)
        | (g["w_high"] > 1 + tol)
        | (g["h_low"] < -tol)
        | (g["h_high"] > 1 + tol)
        | (g["woodbury"] > tol)
        | ~(g["rhs"] <= tol)
        | ~torch.isfinite(g["woodbury"])
    )
    n, gram = stats.get("n"), stats.get("gram")
    if n is not None and declared is not None:
        bad |= n.to(F64) != declared.to(F64)
    out = [None] * len(bad)
    if gram is not None:
        for i, why in reference_gram_problems(gram, n, constant_first).items():
            out[i] = why
    for i in bad.nonzero()[:, 0].tolist():
        if out[i] is not None:
            continue
        one = {k: float(v[i]) for k, v in g.items()}
        if n is not None and declared is not None and float(n[i]) != float(declared[i]):
            out[i] = (
                f"declares {float(n[i]):g} rows in its statistics, {float(declared[i]):g} counted"
            )
        elif not math.isfinite(one["rss"]):
            out[i] = f"residual sum of squares not finite ({one['rss']:.3g})"
        elif not one["rss"] >= 0:
            out[i] = f"negative residual sum of squares {one['rss']:.3g}"
        elif one["w_low"] < -tol:
            out[i] = (
                "posterior covariance S − m mᵀ not positive semi-definite "
                f"(whitened eigenvalue {one['w_low']:.3g})"
            )
        elif one["w_high"] > 1 + tol:
            out[i] = f"posterior wider than the prior (whitened eigenvalue {one['w_high']:.3g})"
        elif one["h_low"] < -tol or one["h_high"] > 1 + tol:
            out[i] = (
                f"GLS Gram outside [0, Σ⁻¹] (whitened eigenvalues {one['h_low']:.3g}…"
                f"{one['h_high']:.3g})"
            )
        elif one["woodbury"] > tol or one["woodbury"] != one["woodbury"]:
            out[i] = f"GLS Gram and posterior covariance disagree (gap {one['woodbury']:.3g})"
        elif not math.isfinite(one["rhs"]):
            out[i] = f"GLS right-hand side or posterior mean not finite (gap {one['rhs']:.3g})"
        else:
            out[i] = f"posterior mean and GLS right-hand side disagree (gap {one['rhs']:.3g})"
    return out


# A prior with a non-trivial whitening: Σ = L Lᵀ, μ ≠ 0 (p = 3).
L = torch.tensor([[2.0, 0.0, 0.0], [0.5, 1.0, 0.0], [-0.3, 0.2, 0.5]], dtype=F64)
SIGMA, MU = L @ L.T, torch.tensor([0.1, -0.2, 0.3], dtype=F64)
TOL = float(whitened_tolerance(SIGMA))
Q = torch.linalg.qr(torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0], [1.5, 0.2, -0.7]]))[0].to(F64)
EYE = torch.eye(3, dtype=F64)
ROWS = 12.0


def along(vals, k=None, d=0.0):
    """Q diag(vals) Qᵀ, plus d along Q's column k."""
    out = Q @ torch.diag(torch.tensor(vals, dtype=F64)) @ Q.T
    if k is not None:
        out = out + d * torch.outer(Q[:, k], Q[:, k])
    return out


def unit(w=(0.1, 0.5, 0.9), gap_k=None, gap=0.0, rhs=0.0, rss=1.0, n=ROWS, gram=None):
    """An upload whose whitened W = Q diag(w) Qᵀ, H = I − W + gap·q_k q_kᵀ, GLS gap ``rhs``
    (relative, :func:`whitened_gaps`), ``rss``, ``n`` rows and Gram ``gram``."""
    m = torch.tensor([0.7, -0.4, 1.1], dtype=F64)
    w_mat = along(w)
    h_mat = (
        EYE - w_mat if gap_k is None else EYE - w_mat + gap * torch.outer(Q[:, gap_k], Q[:, gap_k])
    )
    z = torch.linalg.solve_triangular(L, (m - MU).unsqueeze(-1), upper=False)[:, 0]
    e = rhs * (1.0 + z.norm()) * Q[:, 0]  # ‖e‖/(1 + ‖z‖) = rhs
    l_inv = torch.linalg.inv(L)
    g = torch.diag(torch.tensor([ROWS, 3.0, 2.0], dtype=F64)) if gram is None else gram
    return {
        "mean": m,
        "second": torch.outer(m, m) + L @ w_mat @ L.T,
        "gls_gram": l_inv.T @ h_mat @ l_inv,
        "gls_rhs": l_inv.T @ (z - e),
        "rss": torch.tensor(rss, dtype=F64),
        "n": torch.tensor(n, dtype=F64),
        "gram": g,
    }


def gram_with_low(low):
    """A Gram with G_00 = ROWS and smallest eigenvalue ``low`` (scale max|G_kk| = ROWS)."""
    v = torch.tensor([0.0, 1.0, 1.0], dtype=F64) / 2**0.5
    return torch.diag(torch.tensor([ROWS, 4.0, 4.0], dtype=F64)) + (low - 4.0) * torch.outer(v, v)


T, GT = TOL, GRAM_TOL * ROWS
# (name, upload, flagged by the reference?): each threshold 5 % beyond and 5 % inside
PLANTED = [
    ("honest", unit(), False),
    ("W below −t", unit(w=(-1.05 * T, 0.5, 0.9)), True),
    ("W above −t", unit(w=(-0.95 * T, 0.5, 0.9)), False),
    ("W above 1 + t", unit(w=(0.1, 0.5, 1 + 1.05 * T)), True),
    ("W below 1 + t", unit(w=(0.1, 0.5, 1 + 0.95 * T)), False),
    # H = I − W + D with W and ‖D‖ within their tolerances, H beyond its own
    ("H below −t", unit(w=(0.1, 0.5, 1 + 0.4 * T), gap_k=2, gap=-0.7 * T), True),
    ("H above −t", unit(w=(0.1, 0.5, 1 + 0.2 * T), gap_k=2, gap=-0.7 * T), False),
    ("H above 1 + t", unit(w=(-0.4 * T, 0.5, 0.9), gap_k=0, gap=0.7 * T), True),
    ("H below 1 + t", unit(w=(-0.2 * T, 0.5, 0.9), gap_k=0, gap=0.7 * T), False),
    ("Woodbury beyond t", unit(gap_k=1, gap=1.05 * T), True),
    ("Woodbury within t", unit(gap_k=1, gap=-0.95 * T), False),
    ("GLS rhs beyond t", unit(rhs=1.05 * T), True),
    ("GLS rhs within t", unit(rhs=0.95 * T), False),
    ("rss < 0", unit(rss=-1e-3), True),
    ("rss = 0", unit(rss=0.0), False),
    ("rss = +inf", unit(rss=float("inf")), True),
    ("rss NaN", unit(rss=float("nan")), True),
    ("n ≠ declared", unit(n=ROWS + 1), True),
    ("Gram eigenvalue below −tol", unit(gram=gram_with_low(-1.05 * GT)), True),
    ("Gram eigenvalue above −tol", unit(gram=gram_with_low(-0.95 * GT)), False),
    ("Gram singular", unit(gram=gram_with_low(0.0)), False),
    (
        "G_00 off by 1.05 tol",
        unit(gram=gram_with_low(1.0) + 1.05e-9 * ROWS * torch.outer(EYE[0], EYE[0])),
        True,
    ),
    (
        "G_00 off by 0.95 tol",
        unit(gram=gram_with_low(1.0) + 0.95e-9 * ROWS * torch.outer(EYE[0], EYE[0])),
        False,
    ),
]


def nonfinite():
    """NaN and inf in each kind of leaf."""
    out = []
    for key, where in (
        ("second", (0, 1)),
        ("gls_gram", (2, 2)),
        ("mean", (1,)),
        ("gls_rhs", (0,)),
        ("gram", (1, 2)),
        ("gram", (0, 0)),
    ):
        for bad in (float("nan"), float("inf")):
            u = unit()
            u[key] = u[key].clone()
            u[key][where] = bad
            if key in ("second", "gls_gram", "gram"):
                u[key][where[::-1]] = bad
            out.append((f"{key} {bad}", u))
    return out


def stack(units):
    return {k: torch.stack([u[k] for u in units]) for k in units[0]}


def declared_of(units):
    return torch.full((len(units),), ROWS, dtype=F64)


def test_planted_units_get_the_eigenvalue_checks_verdicts_and_messages():
    units = [u for _, u, _ in PLANTED] + [u for _, u in nonfinite()]
    stats, declared = stack(units), declared_of(units)
    ref = reference_inconsistencies(stats, MU, SIGMA, declared)
    # each planted unit lies on the side of its threshold the reference says
    assert [why is not None for why in ref[: len(PLANTED)]] == [f for *_, f in PLANTED]
    got = inconsistencies(stats, MU, SIGMA, declared)
    assert got == ref
    # every non-finite upload is rejected (a NaN fails "beyond the tolerance" too)
    assert all(why is not None for why in got[len(PLANTED) :])
    names = [name for name, *_ in PLANTED] + [name for name, _ in nonfinite()]
    assert got[names.index("rss = +inf")] == "residual sum of squares not finite (inf)"
    assert got[names.index("gls_rhs nan")] == (
        "GLS right-hand side or posterior mean not finite (gap nan)"
    )
    # the same with the prior's frame formed once beforehand, in chunks of units
    frame = prior_frame(MU, SIGMA)
    chunked = []
    for lo in range(0, len(units), 5):
        part = {k: v[lo : lo + 5] for k, v in stats.items()}
        chunked += inconsistencies(part, MU, SIGMA, declared[lo : lo + 5], frame=frame)
    assert chunked == ref
    assert gram_problems(stats["gram"], stats["n"], True) == reference_gram_problems(
        stats["gram"], stats["n"], True
    )


def test_honest_uploads_are_cleared_by_cholesky_alone(monkeypatch):
    # E-step uploads of 200 random units (p = 6) under a random prior: the reference passes
    # them all, and Cholesky clears every one (no eigenvalue problem is solved).
    gen = torch.Generator().manual_seed(0)
    c, p = 200, 6
    phi = torch.randn(c, 20, p, generator=gen, dtype=F64)
    phi[..., 0] = 1.0  # the constant first basis function (G_00 = n)
    y = phi @ torch.randn(p, generator=gen, dtype=F64) + 0.1 * torch.randn(
        c, 20, generator=gen, dtype=F64
    )
    a = torch.randn(p, p, generator=gen, dtype=F64)
    sigma, mu = a @ a.T + 0.1 * torch.eye(p, dtype=F64), torch.randn(p, generator=gen, dtype=F64)
    gram = phi.transpose(1, 2) @ phi
    mom = Moments(
        gram, (phi * y.unsqueeze(-1)).sum(1), (y * y).sum(1), torch.full((c,), 20.0, dtype=F64)
    )
    post = posterior(mom, mu, sigma, torch.full((c,), 0.01, dtype=F64))
    stats = {
        "mean": post.mean,
        "second": post.mean.unsqueeze(-1) * post.mean.unsqueeze(-2) + post.cov,
        "gls_gram": post.gls_gram,
        "gls_rhs": post.gls_rhs,
        "rss": post.rss,
        "n": mom.n,
        "gram": gram,
    }
    assert reference_inconsistencies(stats, mu, sigma, mom.n) == [None] * c
    calls = []
    eigvalsh = torch.linalg.eigvalsh

    def counted(x):
        calls.append(x.shape)
        return eigvalsh(x)

    monkeypatch.setattr(torch.linalg, "eigvalsh", counted)
    assert inconsistencies(stats, mu, sigma, mom.n) == [None] * c
    assert calls == [torch.Size([p, p])]  # Σ's own, for the tolerance; none of a unit's

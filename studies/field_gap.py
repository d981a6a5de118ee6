"""Diagnosis of fedprior_short's emulation (issue 26, docs/field.md "Sixth session").

On one generated field network with short co-locations (studies/field.py's network and
config), fedprior_drift runs ``--rounds`` plain rounds in process (every unit, every reply
accepted: ``fedcal_support.rounds.run_rounds``), then prints

* per unit: class (short: span below twice the fleet's shortest), calibration span and
  rows, the gap from its last calibration row to its test rows (days, mean and max), the
  input-space distance of its test rows from its calibration rows (Mahalanobis distance of
  each test row from the calibration rows' mean, under the fleet's pooled input
  covariance in scaled units, eigenvalues floored at 1e-3 of the largest; mean over rows),
  its test RMSE, the root mean square of its stated σ and its 95 % coverage (scaled units);
* per emulation window j of S2 (``short_emulation = "future"``, the default design): the
  same gap (window end -> predicted row), distance (predicted rows from the window's rows),
  RMSE and coverage of the emulated use, pooled over the long units, at w* and at w = 1
  (the variance as S2 states it: σ² + φᵀVφ [+ the probe's τ²] + q·walk);
* the same for every row outside the windows placed over the whole span, binned by gap
  (the ``"span"`` design).

    PYTHONPATH=src:. python studies/field_gap.py --seed 0 [--features 8] [--rounds 12]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import field as study  # studies/field.py (same folder)
import numpy as np
import torch

from fedcal.algorithms.fedprior_short import SHORT_WINDOWS
from fedcal.build import build_algorithm, build_task, client_inputs, load_data
from fedcal.config import load_config
from fedcal.core.bayes import F64, Moments, moments, posterior
from fedcal.core.tree import expand
from fedcal.engine.simulation import prepare
from fedcal_support.rounds import run_rounds

DAY = 86400.0
Z95 = 1.959964
BINS = (0, 30, 60, 100, 150, 200, 400)  # days


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec, feats = next(v for v in study.NETWORKS.values() if len(v[1]) == args.features)
    where = Path(tempfile.mkdtemp(prefix="field_gap-"))
    study.network_csv(spec, args.seed, True, where / "network.csv")
    text = study.CONFIG.format(
        methods=["fedprior_drift"],
        path=where / "network.csv",
        features=list(feats),
        target=study.TARGET,
        time=study.TIME_COLUMN,
    ).replace("'", '"')
    (where / "run.toml").write_text(text)
    config = load_config(where / "run.toml")
    fleet = load_data(config)
    tens = prepare(fleet, config.data.scaling, config.engine.dtype)
    task = build_task(config, tens.train.x.shape[-1], fleet.meta, client_inputs(tens))
    alg = build_algorithm("fedprior_drift", config, task)
    run = run_rounds(alg, tens.train, args.rounds)
    train, test = tens.train, tens.test
    server = run.server
    sh = server["drift"]["short"]
    w_star = float(sh["temper"])
    print(
        f"seed {args.seed}, {args.features} features, {args.rounds} rounds: q "
        f"{float(server['drift']['q']):.3g}, w* {w_star:g}, q_s {float(sh['q']):g}, "
        f"tau2_s {float(sh['tau']):.3g}, window {float(sh['window']) / DAY:.1f} days"
    )
    x_all = torch.cat([train.x[i, : int(train.count[i])] for i in range(train.num_clients)])
    ev, vec = torch.linalg.eigh(torch.cov(x_all.to(F64).T))
    c_inv = vec @ torch.diag(1 / ev.clamp_min(1e-3 * float(ev.max()))) @ vec.T

    def dist(xp: torch.Tensor, xw: torch.Tensor) -> torch.Tensor:
        d = xp.to(F64) - xw.to(F64).mean(0)
        return ((d @ c_inv) * d).sum(-1).sqrt()

    # S2's uploads of the next round: each unit's gain over w = 1 per held-out row, against
    # bound_short_sse's scale s_w (how far below short_sse_clip honest units stay)
    up = alg.client_update(expand(alg.broadcast(server), train.num_clients), run.states, train)
    sse, held = up.reply["drift"]["short"]["sse"], up.reply["drift"]["short"]["held"]
    some = held > 0
    if bool(some.any()):
        sse, h = sse[some], held[some].unsqueeze(1)
        s_w = (torch.maximum(sse, sse[:, -1:]) / h).median(0).values
        ratio = ((sse - sse[:, -1:]).abs() / h / s_w)[:, :-1]
        print(f"honest squared-error gains: at most {float(ratio.max()):.2f} x s_w")
    pred = alg.predict(run.personal, test.x)[..., 0].to(F64)
    std = alg.predictive_std_timed(run.personal, test)[..., 0].to(F64)
    t_tr = alg._time(train)
    t_last, span = alg._span(t_tr, train.mask.to(F64))
    window = float(sh["window"])
    short = span < 2 * window
    print(
        "\n| unit | class | span (d) | rows | gap mean / max (d) | distance | RMSE | σ rms "
        "| coverage |\n|---|---|---|---|---|---|---|---|---|"
    )
    t_te = alg._time(test)
    for i in range(train.num_clients):
        n, m = int(train.count[i]), int(test.count[i])
        err = pred[i, :m] - test.y[i, :m, 0].to(F64)
        gap = (t_te[i, :m] - t_last[i]) / DAY
        cover = float((err.abs() <= Z95 * std[i, :m]).to(F64).mean())
        print(
            f"| {tens.client_ids[i]} | {'short' if short[i] else 'long'} | "
            f"{float(span[i]) / DAY:.0f} | {n} | "
            f"{float(gap.mean()):.0f} / {float(gap.max()):.0f} | "
            f"{float(dist(test.x[i, :m], train.x[i, :n]).mean()):.2f} | "
            f"{float(err.pow(2).mean().sqrt()):.3f} | {float(std[i, :m].pow(2).mean().sqrt()):.3f} "
            f"| {cover:.3f} |"
        )
    down = expand(alg.broadcast(server), train.num_clients)
    y = train.y[..., 0].to(F64)
    design = alg.design(train.x, train.branch).to(F64)
    model = alg._model_mask(down)
    if model is not None:
        design = design * model.to(F64).reshape(-1, design.shape[-1]).unsqueeze(1)
    mask = train.mask.to(F64)
    first = t_last - span
    long = (span >= 2 * window).to(F64).unsqueeze(1)
    noise = alg._noise(down, run.states).to(F64).reshape(-1).expand(train.num_clients)
    scale = down["drift"]["scale"].to(F64).reshape(-1)[0]
    walk = ((design @ alg.drift.walk.drift_cov(down)) * design).sum(-1) / scale
    q = float(server["drift"]["q"])
    probe = down.get("probe_n")
    probe = 0.0 if probe is None else float(probe.reshape(-1)[0])
    tau_p = down.get("disc_var")
    tau_p = 0.0 if tau_p is None else float(tau_p.reshape(-1)[0])

    def emulate(start: torch.Tensor, end: torch.Tensor, w: float, both_sides: bool):
        inside = ((t_tr >= start.unsqueeze(1)) & (t_tr <= end.unsqueeze(1))).to(F64)
        keep = mask * inside * long
        if both_sides:
            held = mask * (1 - inside) * long
        else:
            fut = (t_tr > (t_last - alg.drift_holdout * span).unsqueeze(1)).to(F64)
            held = mask * fut * (t_tr > end.unsqueeze(1)).to(F64) * long
        base = moments(design, y, keep)
        stats = Moments(base.gram * w, base.rhs * w, base.yy * w, base.n)
        post = posterior(stats, down["mu"].to(F64), down["sigma"].to(F64), noise)
        mean = torch.einsum("crp,cp->cr", design, post.mean)
        spread = ((design @ post.cov) * design).sum(-1)
        small = ((keep.sum(1) < 2 * probe) & (probe > 0)).to(F64).unsqueeze(1)
        dt = (t_tr - end.unsqueeze(1)).clamp_min(0) + (start.unsqueeze(1) - t_tr).clamp_min(0)
        var = noise.unsqueeze(1) + spread + small * tau_p + q * dt * walk
        d = torch.zeros_like(y)
        for i in range(train.num_clients):
            if held[i].sum() > 0 and keep[i].sum() > 0:
                d[i] = dist(train.x[i], train.x[i][keep[i] > 0])
        return held > 0, (y - mean) ** 2, var, dt / DAY, d

    print("\n| window j | w | rows | gap (d) | distance | RMSE | σ rms | coverage |")
    print("|---|---|---|---|---|---|---|---|")
    room = (span * (1 - alg.drift_holdout) - window).clamp_min(0.0)
    for w in (w_star, 1.0):
        for j in range(SHORT_WINDOWS):
            start = first + room * j / (SHORT_WINDOWS - 1)
            h, e2, var, gap, d = emulate(start, start + window, w, False)
            print(
                f"| {j} | {w:g} | {int(h.sum())} | {float(gap[h].mean()):.0f} | "
                f"{float(d[h].mean()):.2f} | {float(e2[h].mean().sqrt()):.3f} | "
                f"{float(var[h].mean().sqrt()):.3f} | "
                f"{float((e2[h] <= Z95**2 * var[h]).to(F64).mean()):.3f} |"
            )
    print(
        "\n| span design, gap (d) | w | rows | RMSE | σ rms | coverage |\n|---|---|---|---|---|---|"
    )
    room = (span - window).clamp_min(0.0)
    for w in (w_star, 1.0):
        acc = np.zeros((len(BINS) - 1, 4))
        for j in range(SHORT_WINDOWS):
            start = first + room * j / (SHORT_WINDOWS - 1)
            h, e2, var, gap, _ = emulate(start, start + window, w, True)
            for b in range(len(BINS) - 1):
                m = h & (gap >= BINS[b]) & (gap < BINS[b + 1])
                acc[b] += [
                    int(m.sum()),
                    int((e2[m] <= Z95**2 * var[m]).sum()),
                    float(e2[m].sum()),
                    float(var[m].sum()),
                ]
        for b, (n, inside, sse, sv) in enumerate(acc):
            if n:
                print(
                    f"| {BINS[b]}–{BINS[b + 1]} | {w:g} | {int(n)} | {math.sqrt(sse / n):.3f} | "
                    f"{math.sqrt(sv / n):.3f} | {inside / n:.3f} |"
                )


if __name__ == "__main__":
    main()

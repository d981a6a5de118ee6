"""Which statistic's noise dominates: noise on one statistic only (others × 1e-6)."""
import dataclasses, sys
from dataclasses import replace
import torch, pandas as pd
torch.set_num_threads(1)
import fedcal.core.privacy as P
from fedcal.config import load_config
from fedcal.engine.simulation import EngineConfig, prepare, simulate
from fedcal.experiment import build_algorithm, build_policy, build_task, client_inputs, load_data
N=int(sys.argv[1]); R=int(sys.argv[2]); eps=float(sys.argv[3]); design=sys.argv[4]; fs=int(sys.argv[5])
orig = P.noise_std
ONLY=None
def ns(declared, m, scale=1.0):
    out = orig(declared, m, scale)
    return {k: (v if (ONLY is None or k in ONLY) else 1e-6 * v) for k, v in out.items()}
P.noise_std = ns
cfg = load_config("fewpoint")
N_all = N+30
c = replace(cfg, fleet=dataclasses.replace(cfg.fleet, seed=fs, train_design=design, num_reference=N, num_new=30),
   privacy=replace(cfg.privacy, epsilon=eps, delta=1.0/N_all**2, clip=1.0, quantile=0.9), engine=replace(cfg.engine, rounds=R))
fleet = load_data(c)
tensors = prepare(fleet, cfg.data.scaling, cfg.engine.dtype)
task = build_task(c, tensors.train.x.shape[-1], {}, client_inputs(tensors))
alg = dataclasses.replace(build_algorithm("fedprior_fixed", c, task), interval="posterior", dp_whiten=True)
policy, spent = build_policy(c)
print(f"N={N} eps={eps} R={R} design={design} fleet seed {fs}: sigma {spent['noise_multiplier']:.3g}")
keys = ["mean","second","gls_gram","gls_rhs","rss","n","gram","support"]
for only in [None, []]+[[k] for k in keys]:
    ONLY=None if only is None else set(only)
    res = simulate(alg, tensors, EngineConfig(rounds=R, eval_every=R, seed=0, aggregation=policy))
    f = pd.DataFrame(res.final); new = f["client"].astype(str).map(fleet.roles)=="new"
    label = "all noisy" if only is None else ("noise on " + (",".join(only) or "none (x1e-6)"))
    print(f"| {label} | {f.loc[new,'test_rmse'].mean():.4g} | {f.loc[new,'test_rmse'].max():.4g} | {f.loc[~new,'test_rmse'].mean():.4g} |", flush=True)

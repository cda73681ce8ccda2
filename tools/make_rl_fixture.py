#!/usr/bin/env python3
"""tools/make_rl_fixture.py: the PyTorch fixture of slime's RL objectives.

An independent PyTorch (float64, autograd) implementation of the formulas of
issues 7 and 22 (GRPO and REINFORCE++ advantages, TIS/MIS importance weights
and their metrics, PPO-clip / dual-clip, GSPO and CISPO losses with entropy
and KL to a reference, three aggregations, empty sequences counted or
skipped) as THUDM/slime defines them, on a fixed random packed batch, written to
tests/rl/data/rl_fixture.safetensors (or --out), which
tests/rl/test_rl_fixture.cpp compares against the CPU reference.

Conventions where the issue leaves details open (slime's documented choices):
  - GRPO std is unbiased (n - 1), + 1e-6, not applied to a one-sample group.
  - Whitening: (x - mean) / sqrt(var + 1e-8), population variance over the
    response tokens of the batch.
  - REINFORCE++ returns run over the response tokens of a sequence only; the
    sequence reward sits on its last response token.
  - MIS: log-ratio d = old - rollout pooled per token, summed (sequence) or
    averaged (geometric) over the response tokens of a sequence, clamped to
    [-20, 20] before exp (slime's SAFETY_BOUND); the veto rejects a sequence
    with any exp(d) < veto; renormalisation 1 (slime's --tis-batch-normalize)
    divides by the mean of the bounded weights before rejection over every
    loss token (token level) or over every sequence of its mean weight
    (sequence and geometric levels), 2 (ours) by the mean of the kept
    weights. A rejected token has weight 0, leaves the loss's numerator and
    stays in its denominators.
  - KL: k1, k2, k3 (unclamped) and low_var_kl (k3 clamped to [-10, 10]
    after the unbiased ratio), slime's compute_approx_kl.
  - Normalisers: empty 0 (slime's) counts every sequence (N_seqs) and
    max(n_s, 1) tokens per sequence (N_tokens); empty 1 (ours) only the
    sequences with loss tokens and their tokens.
  - seq_mean_token_sum reduces the pg term only (slime's custom pg reducer);
    KL, entropy and every metric but pg_loss use the per-sequence mean.
  - Metrics of the loss are aggregated with those weights; the clip
    fraction counts tokens whose clipped branch is the one taken (PPO/GSPO)
    or whose ratio is clipped (CISPO); ppo_kl = old - lp (GSPO: minus the
    sequence mean log-ratio).

Tensors (T tokens, S sequences, N = S samples, G groups), all float64 unless
noted:
  cu_seqlens i32 [S+1], loss_mask u8 [T], group_sizes i64 [G]
  lp, old_lp, ref_lp, rollout_lp, entropy, kl_shaping [T]; rewards [N]
  adv.grpo_std, adv.grpo [N]; adv.tokens [T] (grpo_std broadcast)
  adv.reinforce_pp [T], adv.reinforce_pp_baseline [T]
  teacher_lp [T]; opd.reverse_kl [T] (old - teacher on loss tokens) and
      adv.opd [T] (adv.tokens - 0.7 reverse_kl), on-policy distillation
  is.<name>.weights [T], is.<name>.keep u8 [T], is.<name>.metrics [7]
      (mean weight, clip fraction, rejected fraction, mean |w - 1|,
       trainer perplexity, rollout perplexity, k3 KL trainer vs rollout)
      and is.<name>.config [6] (level, mode, low, high, veto, renormalize;
      level 0 tis / 1 token / 2 sequence / 3 geometric; mode 0 truncate /
      1 clip / 2 mask; renormalize 0 off / 1 batch / 2 kept)
  loss.<i>.config [12] (kind 0 ppo / 1 gspo / 2 cispo, aggregation 0
      token_mean / 1 seq_mean_token_mean / 2 seq_mean_token_sum, kl estimator
      0 k1 / 1 k2 / 2 k3 / 3 low_var_kl, unbiased, eps_clip, eps_clip_high,
      eps_clip_c, entropy_coef, kl_coef, uses TIS weights, uses MIS
      token/mask keep, empty sequences 0 count / 1 skip)
  loss.<i>.metrics [7] (loss, pg_loss, entropy, kl, ppo_kl, clip_fraction,
      dual_clip_fraction); loss.<i>.grad_lp [T], loss.<i>.grad_entropy [T]

Run: . /tmp/torchenv/bin/activate && python tools/make_rl_fixture.py
(torch and safetensors). The fixture must stay under 300 KB; the script checks.
"""
import argparse
import math
import pathlib

import torch
from safetensors.torch import save_file

SEED = 7
LENGTHS = [1, 17, 45, 3, 60, 30, 25, 8, 52, 40]
GROUPS = [4, 3, 1, 2]
MAX_BYTES = 300 * 1024
GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8
LOW_VAR_KL_CLAMP = 10.0
MIS_LOG_RATIO_BOUND = 20.0
GAMMA = 0.97
SHAPING_KL_COEF = 0.05
OPD_KL_COEF = 0.7


def make_inputs():
    g = torch.Generator().manual_seed(SEED)

    def u(n, lo, hi):
        return lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)

    T = sum(LENGTHS)
    cu = [0]
    mask = []
    for s, n in enumerate(LENGTHS):
        prompt = min(n, 1 + int(torch.randint(0, 5, (1,), generator=g)))
        if s == 0:
            prompt = n  # a sequence without response tokens
        mask += [0] * prompt + [1] * (n - prompt)
        cu.append(cu[-1] + n)
    old = -u(T, 0.05, 3.0)
    x = dict(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
        group_sizes=torch.tensor(GROUPS, dtype=torch.int64),
        old_lp=old,
        lp=old + u(T, -0.4, 0.4),
        ref_lp=old + u(T, -0.5, 0.5),
        rollout_lp=old + 0.1 * torch.randn(T, generator=g, dtype=torch.float64),
        entropy=u(T, 0.0, 2.0),
        kl_shaping=u(T, -0.2, 0.3),
        rewards=torch.randn(len(LENGTHS), generator=g, dtype=torch.float64),
    )
    x["teacher_lp"] = old + u(T, -0.6, 0.6)
    # Two tokens whose rollout is far more likely than the trainer's: the MIS
    # veto (0.75) rejects their sequences.
    for s in (2, 6):
        t = cu[s + 1] - 2
        x["rollout_lp"][t] = x["old_lp"][t] + 0.5
    # Sequence 8's rollout is more likely on every token: its summed log-ratio
    # (about -25) passes MIS's -20 bound.
    for t in range(cu[8], cu[9]):
        x["rollout_lp"][t] = x["old_lp"][t] + 0.5
    # Ratios far above the dual clip's threshold (exp(1.5) = 4.5 > 3), in
    # every sequence with response tokens (both advantage signs).
    for s in range(1, len(LENGTHS)):
        t = cu[s + 1] - 3 if LENGTHS[s] > 3 else cu[s + 1] - 1
        x["lp"][t] = x["old_lp"][t] + 1.5
    # References far below the policy on a few tokens: k3 = exp(3.5) - 4.5 > 10,
    # where low_var_kl clamps and k3 does not.
    for s in (1, 4, 9):
        t = cu[s + 1] - 1
        x["ref_lp"][t] = x["lp"][t] + 3.5
    return x


def segments(x):
    cu = x["cu_seqlens"].tolist()
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


# ---- advantages -------------------------------------------------------------------------------
def grpo(rewards, groups, normalize_std):
    out = torch.empty_like(rewards)
    start = 0
    for n in groups:
        r = rewards[start:start + n]
        a = r - r.mean()
        if normalize_std and n > 1:
            a = a / (r.std(unbiased=True) + GRPO_EPS)
        out[start:start + n] = a
        start += n
    return out


def to_tokens(per_seq, x):
    m = x["loss_mask"].to(torch.float64)
    lens = torch.tensor([e - b for b, e in segments(x)])
    return torch.repeat_interleave(per_seq, lens) * m


def whiten(v, m):
    mb = m.bool()
    mean = v[mb].mean()
    var = ((v[mb] - mean) ** 2).mean()
    return torch.where(mb, (v - mean) / torch.sqrt(var + WHITEN_EPS), torch.zeros_like(v))


def reinforce_pp(x):
    m = x["loss_mask"]
    out = torch.zeros_like(x["lp"])
    for s, (b, e) in enumerate(segments(x)):
        idx = [t for t in range(b, e) if m[t]]
        ret = 0.0
        for j, t in enumerate(reversed(idx)):
            r = -SHAPING_KL_COEF * x["kl_shaping"][t].item() + (x["rewards"][s].item() if j == 0 else 0.0)
            ret = r + GAMMA * ret
            out[t] = ret
    return whiten(out, m)


def reinforce_pp_baseline(x):
    centred = grpo(x["rewards"], GROUPS, False)
    a = to_tokens(centred, x) - SHAPING_KL_COEF * x["kl_shaping"] * x["loss_mask"]
    return whiten(a, x["loss_mask"])


# ---- importance sampling ----------------------------------------------------------------------
IS_CASES = {
    # name: (level, mode, low, high, veto, renormalize)
    "tis": (0, 1, 0.0, 2.0, 0.0, 0),
    "mis_token_truncate": (1, 0, 0.5, 1.1, 0.0, 0),
    "mis_token_mask": (1, 2, 0.9, 1.1, 0.0, 0),
    "mis_sequence_clip": (2, 1, 0.8, 1.25, 0.0, 0),
    "mis_sequence_truncate_bound": (2, 0, 0.0, 5.0, 0.0, 0),
    "mis_geometric_mask_veto_renorm": (3, 2, 0.97, 1.03, 0.75, 2),
    "mis_geometric_truncate": (3, 0, 0.5, 1.01, 0.0, 0),
    "mis_token_mask_batch_norm": (1, 2, 0.9, 1.1, 0.0, 1),
    "mis_sequence_clip_batch_norm": (2, 1, 0.8, 1.25, 0.0, 1),
    "mis_geometric_truncate_batch_norm": (3, 0, 0.5, 1.01, 0.0, 1),
}


def importance(x, level, mode, low, high, veto, renorm):
    m = x["loss_mask"].bool()
    d = x["old_lp"] - x["rollout_lp"]
    logrho = d.clone()
    rejected = torch.zeros_like(m)
    for b, e in segments(x):
        sm = m[b:e]
        if not sm.any():
            continue
        ds = d[b:e][sm]
        if level == 2:
            logrho[b:e] = ds.sum()
        elif level == 3:
            logrho[b:e] = ds.mean()
        if veto > 0 and (torch.exp(ds) < veto).any():
            rejected[b:e] = True
    if level > 0:
        logrho = torch.clamp(logrho, -MIS_LOG_RATIO_BOUND, MIS_LOG_RATIO_BOUND)
    rho = torch.exp(logrho)
    if mode == 0:  # truncate
        w = torch.clamp(rho, max=high)
        clipped = rho > high
    elif mode == 1:  # clip
        w = torch.clamp(rho, low, high)
        clipped = (rho < low) | (rho > high)
    else:  # mask
        w = rho
        clipped = (rho < low) | (rho > high)
        rejected = rejected | clipped
    keep = m & ~rejected
    if renorm == 1:  # slime's --tis-batch-normalize: bounded weights before rejection
        wm = torch.where(m, w, torch.zeros_like(w))
        if level == 1:
            mean = wm.sum() / max(int(m.sum()), 1)
        else:
            means = [wm[b:e].sum() / max(int(m[b:e].sum()), 1) for b, e in segments(x)]
            mean = sum(means) / len(means)
        if mean > 1e-8:
            w = w / mean
    w = torch.where(keep, w, torch.zeros_like(w))
    if renorm == 2 and keep.any():
        w = w / w[keep].mean()
    n = m.sum().double()
    nk = keep.sum().double()
    k3 = torch.exp(d) - d - 1  # KL(rollout || trainer), samples from the rollout
    metrics = torch.stack([
        w[keep].sum() / nk,
        (clipped & m).sum().double() / n,
        (rejected & m).sum().double() / n,
        (w[keep] - 1).abs().sum() / nk,
        torch.exp(-x["old_lp"][m].mean()),
        torch.exp(-x["rollout_lp"][m].mean()),
        k3[m].mean(),
    ])
    return w, keep.to(torch.uint8), metrics


# ---- losses -------------------------------------------------------------------------------
LOSS_CASES = [
    # kind, aggregation, estimator, unbiased, eps, eps_high, eps_c, ent, kl, use_w, use_keep, empty
    (0, 0, 3, 0, 0.2, 0.28, 3.0, 0.01, 0.1, 1, 1, 0),
    (0, 1, 0, 1, 0.2, 0.28, 1.25, 0.01, 0.1, 1, 0, 0),
    (0, 2, 1, 0, 0.1, 0.15, 0.0, 0.0, 0.2, 0, 1, 0),
    (0, 0, 0, 0, 0.2, 0.2, 0.0, 0.0, 0.0, 0, 0, 0),
    (1, 0, 2, 0, 3e-4, 4e-4, 0.0, 0.01, 0.1, 1, 1, 0),
    (1, 1, 1, 1, 0.01, 0.02, 1.02, 0.02, 0.05, 0, 1, 0),
    (1, 2, 0, 0, 0.2, 0.28, 0.0, 0.0, 0.1, 1, 0, 0),
    (2, 0, 2, 0, 0.2, 0.28, 0.0, 0.01, 0.1, 1, 1, 0),
    (2, 1, 0, 1, 0.1, 0.2, 0.0, 0.0, 0.05, 1, 0, 0),
    (2, 2, 1, 0, 0.2, 0.28, 0.0, 0.01, 0.0, 0, 1, 0),
    (0, 0, 2, 1, 0.2, 0.28, 3.0, 0.01, 0.1, 1, 1, 1),
    (0, 1, 3, 1, 0.2, 0.28, 2.0, 0.01, 0.1, 0, 0, 1),
    (0, 2, 2, 0, 0.2, 0.28, 3.0, 0.05, 0.1, 1, 1, 1),
    (1, 2, 3, 0, 0.01, 0.02, 0.0, 0.01, 0.1, 0, 0, 1),
]


def kl_estimate(est, lp, ref, ratio=None):
    if est == 0:
        kl = lp - ref
    elif est == 1:
        kl = 0.5 * (lp - ref) ** 2
    else:
        log_r = ref - lp
        kl = torch.exp(log_r) - log_r - 1
    if ratio is not None:
        kl = kl * ratio
    if est == 3:
        kl = torch.clamp(kl, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return kl


def policy_loss(x, case, weights, keep):
    kind, agg, est, unbiased, eps, eps_high, eps_c, ent_coef, kl_coef, use_w, use_keep, empty = case
    lp = x["lp"].clone().requires_grad_(True)
    ent = x["entropy"].clone().requires_grad_(True)
    old, adv = x["old_lp"], x["adv.tokens"]
    m = x["loss_mask"].to(torch.float64)
    k = m * (keep.to(torch.float64) if use_keep else 1.0)
    w = weights if use_w else torch.ones_like(lp)
    segs = segments(x)
    if empty == 0:  # slime: every sequence, at least one token each
        n_tok = sum(max(m[b:e].sum(), torch.tensor(1.0, dtype=torch.float64)) for b, e in segs)
        n_seq = len(segs)
    else:
        n_tok = m.sum()
        n_seq = sum(1 for b, e in segs if m[b:e].sum() > 0)
    log_ratio = lp - old
    if kind == 1:  # GSPO: the sequence's mean log-ratio for every token
        per_tok = []
        for b, e in segs:
            ns = m[b:e].sum()
            mean = (log_ratio[b:e] * m[b:e]).sum() / ns if ns > 0 else log_ratio[b:e].sum() * 0
            per_tok.append(mean.expand(e - b))
        log_ratio = torch.cat(per_tok)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - eps, 1 + eps_high)
    if kind == 2:  # CISPO
        pg = -clipped_ratio.detach() * adv * lp
        clipped = clipped_ratio.detach() != ratio.detach()
        dual = torch.zeros_like(clipped)
    else:
        unclipped_loss = -adv * ratio
        clipped_loss = -adv * clipped_ratio
        pg = torch.maximum(unclipped_loss, clipped_loss)
        clipped = clipped_loss.detach() > unclipped_loss.detach()
        dual = torch.zeros_like(clipped)
        if eps_c > 0:
            dual_loss = -adv * eps_c
            dual = (adv < 0) & (dual_loss < pg.detach())
            pg = torch.where(adv < 0, torch.minimum(pg, dual_loss), pg)
    pg = w * pg
    kl = kl_estimate(est, lp, x["ref_lp"], torch.exp(lp - old) if unbiased else None)

    def aggregate(v, token_sum=False):
        v = v * k
        if agg == 0:
            return v.sum() / n_tok
        parts = []
        for b, e in segs:
            ns = m[b:e].sum()
            if ns == 0:
                continue
            parts.append(v[b:e].sum() / (1.0 if token_sum else ns))
        return torch.stack(parts).sum() / n_seq

    # seq_mean_token_sum: the pg term by token sums, the rest by sequence means.
    loss = aggregate(pg, token_sum=agg == 2) + aggregate(kl_coef * kl - ent_coef * ent)
    loss.backward()
    with torch.no_grad():
        metrics = torch.stack([
            loss.detach(),
            aggregate(pg.detach(), token_sum=agg == 2),
            aggregate(ent.detach()),
            aggregate(kl.detach()),
            aggregate(-log_ratio.detach()),
            aggregate(clipped.to(torch.float64)),
            aggregate(dual.to(torch.float64)),
        ])
    return metrics, lp.grad.detach().clone(), ent.grad.detach().clone()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "tests/rl/data/rl_fixture.safetensors"))
    args = ap.parse_args()
    x = make_inputs()
    out = dict(x)
    out["adv.grpo_std"] = grpo(x["rewards"], GROUPS, True)
    out["adv.grpo"] = grpo(x["rewards"], GROUPS, False)
    x["adv.tokens"] = out["adv.tokens"] = to_tokens(out["adv.grpo_std"], x)
    out["adv.reinforce_pp"] = reinforce_pp(x)
    out["adv.reinforce_pp_baseline"] = reinforce_pp_baseline(x)
    # On-policy distillation (slime's apply_opd_kl_to_advantages): the student's
    # logprobs are the old ones; reverse KL k1 = student - teacher on loss tokens.
    m = x["loss_mask"].to(torch.float64)
    out["opd.reverse_kl"] = (x["old_lp"] - x["teacher_lp"]) * m
    out["adv.opd"] = x["adv.tokens"] - OPD_KL_COEF * out["opd.reverse_kl"]
    weights = {}
    for name, cfg in IS_CASES.items():
        w, keep, metrics = importance(x, *cfg)
        weights[name] = (w, keep)
        out[f"is.{name}.weights"] = w
        out[f"is.{name}.keep"] = keep
        out[f"is.{name}.metrics"] = metrics
        out[f"is.{name}.config"] = torch.tensor(cfg, dtype=torch.float64)
    tis_w = weights["tis"][0]
    mask_keep = weights["mis_token_mask"][1]
    clipped_cases = 0
    for i, case in enumerate(LOSS_CASES):
        metrics, g_lp, g_ent = policy_loss(x, case, tis_w, mask_keep)
        clipped_cases += metrics[5].item() > 0
        out[f"loss.{i}.config"] = torch.tensor(case, dtype=torch.float64)
        out[f"loss.{i}.metrics"] = metrics
        out[f"loss.{i}.grad_lp"] = g_lp
        out[f"loss.{i}.grad_entropy"] = g_ent
    assert clipped_cases >= 6, "the random batch should reach the clipped branches"
    for i in (0, 10, 12):  # dual clip 3 with ratios of 4.5
        assert out[f"loss.{i}.metrics"][6] > 0, f"loss case {i} should reach the dual clip"
    # The -20 bound is reached (exp(-20), not exp(-25), on sequence 8).
    cu = x["cu_seqlens"].tolist()
    w8 = out["is.mis_sequence_truncate_bound.weights"][cu[9] - 1].item()
    assert abs(w8 - math.exp(-20)) < 1e-20, w8
    for name in IS_CASES:
        assert out[f"is.{name}.keep"].sum() > 0
    assert out["is.mis_geometric_mask_veto_renorm.metrics"][2] > 0
    out = {k: v.contiguous() for k, v in out.items()}
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))
    size = path.stat().st_size
    assert size < MAX_BYTES, f"{path} is {size} bytes, over {MAX_BYTES}"
    print(f"wrote {path} ({size} bytes, {sum(LENGTHS)} tokens, {len(LOSS_CASES)} loss cases, {len(IS_CASES)} IS cases)")


if __name__ == "__main__":
    main()

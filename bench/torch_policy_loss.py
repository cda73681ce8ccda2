#!/usr/bin/env python3
"""PyTorch eager baseline for bench/bench_policy_loss.cu.

The same loss as the fused kernel, written the way RL frameworks write it in
PyTorch (f32 [T] tensors on the GPU, autograd for the gradients with respect
to lp and entropy), on the same shapes (64 sequences x 4096 tokens and 256 x
1024, a 16-token prompt each) and variants:

    ppo   token_mean, eps_clip 0.2 / 0.28, dual clip 3
    gspo  seq_mean_token_mean, sequence ratio exp(mean_t(lp - old)), 3e-4 / 4e-4
    both: TIS weights, rejected tokens (keep mask), k3 KL (kl_coef 0.05),
          entropy bonus (0.01)

One call = forward (per-token terms, segment sums with index_add_) + backward
(lp.grad, entropy.grad, set to None before each call) + the metrics a trainer
logs (clip fraction, ppo_kl, kl), left on the device. Bytes counted as in the
C++ benchmark: 34 T (what the fused op must read and write). copy_fraction
divides that rate by the bandwidth of a device-to-device copy of the same
bytes (torch's copy_), timed the same way. Prints one JSON line per row
({"bench", "us", "gbps", "copy_fraction"}), names matching
bench_policy_loss's ("policy_loss/S64xL4096/ppo"), and writes them to --out.

    python3 bench/torch_policy_loss.py --out torch_policy_loss.json
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

SHAPES = [(64, 4096), (256, 1024)]
PROMPT = 16


def make_inputs(seqs, length, kind, device):
    g = torch.Generator(device="cpu").manual_seed(1234)
    n = seqs * length
    u = lambda: torch.rand(n, generator=g)  # noqa: E731
    spread = 2e-3 if kind == "gspo" else 0.6
    old = -0.05 - 3 * u()
    x = dict(
        old=old,
        lp=old + (u() - 0.5) * spread,
        ref=old + (u() - 0.5),
        ent=2 * u(),
        w=0.5 + u(),
        adv=(torch.rand(seqs, generator=g) * 4 - 2).repeat_interleave(length),
        mask=(torch.arange(n) % length >= PROMPT).float(),
        keep=(u() > 0.05).float(),
        seq_id=torch.arange(seqs).repeat_interleave(length),
    )
    return {k: v.to(device) for k, v in x.items()}


def make_run(kind, x, seqs):
    lp = x["lp"].clone().requires_grad_(True)
    ent = x["ent"].clone().requires_grad_(True)
    old, ref, adv, w, m, keep, sid = (x[k] for k in ("old", "ref", "adv", "w", "mask", "keep", "seq_id"))
    n_tok = m.sum()
    n_s = torch.zeros(seqs, device=m.device).index_add_(0, sid, m)
    n_seq = (n_s > 0).sum()
    k = m * keep
    eps, eps_high = (3e-4, 4e-4) if kind == "gspo" else (0.2, 0.28)

    def run():
        lp.grad = None
        ent.grad = None
        if kind == "gspo":
            seq_lr = torch.zeros(seqs, device=lp.device).index_add(0, sid, (lp - old) * m) / n_s.clamp(min=1)
            log_ratio = seq_lr[sid]
        else:
            log_ratio = lp - old
        ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1 - eps, 1 + eps_high)
        pg1, pg2 = -adv * ratio, -adv * clipped_ratio
        pg = torch.maximum(pg1, pg2)
        if kind == "ppo":
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
        pg = pg * w
        d = ref - lp
        kl = (torch.exp(d) - d - 1).clamp(-10, 10)
        per_token = (pg - 0.01 * ent + 0.05 * kl) * k
        if kind == "gspo":
            c = (1.0 / (n_s.clamp(min=1) * n_seq))[sid]
        else:
            c = 1.0 / n_tok
        loss = (per_token * c).sum()
        loss.backward()
        with torch.no_grad():
            metrics = torch.stack([((pg2 > pg1).float() * k * c).sum(), (-log_ratio * k * c).sum(), (kl * k * c).sum()])
        return loss.detach(), metrics

    return run


def main():
    p = bench_util.parser(__doc__, out="torch_policy_loss.json", warmup=20, reps=20, batch=50)
    args = p.parse_args()
    device = bench_util.cuda_device()
    rows = []
    for seqs, length in SHAPES:
        n = seqs * length
        nbytes = 34 * n
        src = torch.zeros(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_us = bench_util.time_us(lambda: dst.copy_(src), args.warmup, args.reps, args.batch)
        copy_bw = nbytes / (copy_us * 1e-6)
        for kind in ("ppo", "gspo"):
            x = make_inputs(seqs, length, kind, device)
            run = make_run(kind, x, seqs)
            us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
            row = {
                "bench": f"policy_loss/S{seqs}xL{length}/{kind}",
                "us": us,
                "gbps": bench_util.gbps(nbytes, us),
                "copy_gbps": copy_bw / 1e9,
                "copy_fraction": (nbytes / (us * 1e-6)) / copy_bw,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"results": rows}, f, indent=1)


if __name__ == "__main__":
    main()

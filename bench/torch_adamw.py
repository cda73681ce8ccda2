#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_adamw.cu.

Times, on one GPU, over the parameter shapes of Qwen3-0.6B (310 fp32 tensors,
N = 596,049,920 elements, each its own allocation):

    adamw/qwen3_0.6b/f32   torch.optim.AdamW(fused=True) .step(), fp32 params,
                           grads and moments (betas 0.9/0.95, wd 0.1, lr 1e-4)
    grad_norm/qwen3_0.6b   torch.nn.utils.get_total_norm(grads, foreach=True)
                           .item() (the value on the host, as slime returns it)
    (slime's adamw/qwen3_0.6b/f32_bf16copy has no PyTorch counterpart: torch
    would need a second pass, p.copy_ into bf16 weights.)

Bytes (the algorithmic traffic, each operand once): adamw 28 N (read p, g, m,
v; write p, m, v, fp32), grad_norm 4 N. GB/s = bytes / time / 1e9; every row
also times a copy of bytes / 2 and reports frac_of_copy = GB/s / copy GB/s.

Method: one correctness check (a fused step against foreach=False on layer
0's q_norm and k_proj, relative error; the norm against float64), --warmup
untimed calls, then --reps timed batches of --batch calls between two CUDA
events; the time of one call is the median over batches of batch time /
batch. Prints one JSON line per benchmark and writes them all to --out.

    python3 bench/torch_adamw.py --out torch_adamw.json

Standard library and torch only.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

H, F, Q, KV, V, L = 1024, 3072, 16 * 128, 8 * 128, 151936, 28
LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def qwen3_0_6b_shapes():
    shapes = [(V, H)]
    for _ in range(L):
        shapes += [(H,), (Q, H), (KV, H), (KV, H), (H, Q), (128,), (128,), (H,), (F, H), (F, H), (H, F)]
    return shapes + [(H,)]


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def main():
    args = bench_util.parser(__doc__, out="torch_adamw.json", warmup=2, reps=10, batch=5).parse_args()
    device = bench_util.cuda_device()
    g = torch.Generator(device=device).manual_seed(1)
    params = []
    for shape in qwen3_0_6b_shapes():
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=g) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=g) * 1e-3
        params.append(p)
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    # Correctness: one fused step against the single-tensor reference on two tensors.
    picks = [6, 3]
    ref = [torch.nn.Parameter(params[i].detach().clone()) for i in picks]
    for r, i in zip(ref, picks):
        r.grad = params[i].grad.clone()
    ref_opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    opt.step()
    ref_opt.step()
    adamw_err = max(rel_err(params[i].detach(), r.detach()) for r, i in zip(ref, picks))

    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True).item()
    want = torch.sqrt(sum((gr.double() ** 2).sum() for gr in grads)).item()
    norm_err = abs(norm - want) / want

    copy_time = bench_util.copy_timer(device, args.warmup, args.reps, args.batch, empty_cache=True)

    cases = [
        ("adamw/qwen3_0.6b/f32", 28 * n, opt.step, adamw_err, 1e-6),
        ("grad_norm/qwen3_0.6b", 4 * n, lambda: torch.nn.utils.get_total_norm(grads, foreach=True).item(), norm_err,
         1e-5),
    ]
    rows, failed = [], False
    for name, nbytes, run, err, tol in cases:
        us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
        row = bench_util.copy_bound_row(name, nbytes, us, copy_time(nbytes // 2), err, tol, numel=n)
        failed = failed or "error" in row
        rows.append(row)
        print(json.dumps(row), flush=True)

    bench_util.write_doc(args.out, rows, bench_util.context(args, device, dtype="f32", numel=n, tensors=len(params)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

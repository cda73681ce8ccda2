#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_vision_ops.cu.

Times the memory-bound ops of the Qwen3-VL vision tower in bf16 on one GPU,
with the same shapes, names and byte counts as the C++ benchmark
(T = 4096 and 16384 rows):

    layer_norm_fwd/{T}x{1024,4096}/bf16      F.layer_norm(x, (D,), w, b, eps)
    layer_norm_fwd_bwd/...                   the forward, then autograd.grad
                                             w.r.t. x, w and b
    gelu_tanh_fwd/{T}x4096/bf16              F.gelu(x, approximate="tanh")
    gelu_tanh_fwd_bwd/...                    the forward, then autograd.grad w.r.t. x
    gelu_erf_fwd/..., gelu_erf_fwd_bwd/...   F.gelu(x) (approximate="none")

Bytes (the algorithmic traffic, each operand once, bf16 = 2 bytes, f32 = 4):
    layer_norm_fwd 4TD + 4D + 8T,  layer_norm_fwd_bwd that + 6TD + 2D + 8T + 16D,
    gelu_fwd 4N,  gelu_fwd_bwd 10N (N = T x 4096).  GB/s = bytes / time / 1e9.

Method, per op: one correctness check against float64 on sampled rows,
--warmup untimed calls, then --reps timed batches of --batch calls between two
CUDA events on the current stream; the time of one call is the median over
batches of batch time / batch. Every op also times a copy of bytes / 2 and
reports frac_of_copy = GB/s / copy GB/s. Prints one JSON line per op,
{"bench", "us", "gbps", "copy_gbps", "frac_of_copy", ...}, and writes them all
to --out (read by bench/compare_ops.py).

    python3 bench/torch_vision_ops.py --out torch_vision_ops.json

Standard library and torch only.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

ROWS = (16384, 4096)
EPS = 1e-6  # Qwen3-VL's vision LayerNorm eps
MLP = 4096


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def timed_and_checked(fwd, inputs, dy, rows, backward, f64):
    """(run, check) of one case. run: fwd(), or with backward fwd() then
    autograd.grad w.r.t. inputs (inputs[0] is x) for dy. check: the relative
    error of y (or dx) on the sampled rows against f64, the op in float64 on
    those rows of x."""
    x = inputs[0]

    def ref():
        xd = x.detach().double()[rows].requires_grad_(backward)
        yd = f64(xd)
        return torch.autograd.grad(yd, (xd,), dy.double()[rows])[0] if backward else yd

    if not backward:
        return fwd, lambda: rel_err(fwd()[rows], ref())
    run = lambda: torch.autograd.grad(fwd(), inputs, dy)
    return run, lambda: rel_err(run()[0][rows], ref())


def make_cases(device):
    """(name, bytes, setup) where setup() returns (run, check)."""
    bf16 = torch.bfloat16
    cases = []

    def randn(*shape, scale=1.0, shift=0.0, seed=1):
        g = torch.Generator(device=device).manual_seed(seed)
        return (torch.randn(*shape, device=device, generator=g) * scale + shift).to(bf16)

    def layer_norm_setup(T, D, backward):
        x = randn(T, D, scale=2.0, shift=0.5, seed=1).requires_grad_(backward)
        w = randn(D, scale=0.3, shift=1.0, seed=2).requires_grad_(backward)
        b = randn(D, scale=0.3, seed=3).requires_grad_(backward)
        dy = randn(T, D, seed=4)
        rows = torch.tensor([0, 1, T // 2, T - 1], device=device)
        fwd = lambda: F.layer_norm(x, (D,), w, b, EPS)
        wd, bd = w.detach().double(), b.detach().double()
        return timed_and_checked(fwd, (x, w, b), dy, rows, backward,
                                 lambda xd: F.layer_norm(xd, (D,), wd, bd, EPS))

    def gelu_setup(T, approximate, backward):
        x = randn(T, MLP, scale=3.0, seed=11).requires_grad_(backward)
        dy = randn(T, MLP, seed=12)
        rows = torch.tensor([0, T // 3, T - 1], device=device)
        fwd = lambda: F.gelu(x, approximate=approximate)
        return timed_and_checked(fwd, (x,), dy, rows, backward, lambda xd: F.gelu(xd, approximate=approximate))

    for T in ROWS:
        for D in (1024, 4096):
            td = T * D
            fwd_bytes = 4 * td + 4 * D + 8 * T
            cases.append((f"layer_norm_fwd/{T}x{D}/bf16", fwd_bytes,
                          lambda T=T, D=D: layer_norm_setup(T, D, False)))
            cases.append((f"layer_norm_fwd_bwd/{T}x{D}/bf16", fwd_bytes + 6 * td + 2 * D + 8 * T + 16 * D,
                          lambda T=T, D=D: layer_norm_setup(T, D, True)))
        n = T * MLP
        for approximate, op in (("tanh", "gelu_tanh"), ("none", "gelu_erf")):
            cases.append((f"{op}_fwd/{T}x{MLP}/bf16", 4 * n,
                          lambda T=T, a=approximate: gelu_setup(T, a, False)))
            cases.append((f"{op}_fwd_bwd/{T}x{MLP}/bf16", 10 * n,
                          lambda T=T, a=approximate: gelu_setup(T, a, True)))
    return cases


def main():
    args = bench_util.parser(__doc__, out="torch_vision_ops.json", warmup=3, reps=20, batch=5).parse_args()
    device = bench_util.cuda_device()

    copy_time = bench_util.copy_timer(device, args.warmup, args.reps, args.batch)
    # bf16 outputs against float64 on the same rounded inputs
    rows, failed = bench_util.run_copy_bound_cases(make_cases(device), copy_time, args, tol=lambda name: 1e-2)

    bench_util.write_doc(args.out, rows, bench_util.context(args, device))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

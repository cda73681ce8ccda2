#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_row_ops.cu.

Times the row ops of the Qwen3-VL vision tower in bf16 on one GPU, with the
same shapes, names and byte counts as the C++ benchmark:

    bias_add/16384x{4096,1152}/bf16   y += b
    bias_grad/16384x{4096,1152}/bf16  dy.sum(0, dtype=torch.float32) (the
                                      column sums in fp32, as slime's dbias)
    pos_embed_fwd/16384x2304x1024/bf16
        transformers' Qwen3VLVisionModel.fast_pos_embed_interpolate: the
        embedding gather of the 4 taps times their weights (in the table's
        dtype), summed over the taps
    pos_embed_fwd_bwd/...             the forward, then autograd.grad w.r.t.
                                      the table for d_out

The taps: align-corners bilinear of one 128 x 128 patch grid into the 48 x 48
table (transformers' get_vision_interpolation_indices_and_weights without the
merge reordering, which only permutes the patches).

Bytes (the algorithmic traffic, each operand once, bf16 = 2 bytes, f32 and
i32 = 4; T = 16384, P = 16384, S = 2304, D = 1024):
    bias_add 4Tn + 2n,  bias_grad 2Tn + 8n,
    pos_embed_fwd 2SD + 32P + 2PD,  pos_embed_fwd_bwd that + 2PD + 32P + 8SD.
GB/s = bytes / time / 1e9.

Method, per op: one correctness check against float64 (sampled rows, or the
whole gradient), --warmup untimed calls, then --reps timed batches of --batch
calls between two CUDA events on the current stream; the time of one call is
the median over batches of batch time / batch. Every op also times a copy of
bytes / 2 and reports frac_of_copy = GB/s / copy GB/s. Prints one JSON line
per op, {"bench", "us", "gbps", "copy_gbps", "frac_of_copy", ...}, and writes
them all to --out (read by bench/compare_ops.py).

    python3 bench/torch_row_ops.py --out torch_row_ops.json

Standard library and torch only.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

ROWS = 16384
WIDTHS = (4096, 1152)
GRID, SIDE, DIM = 128, 48, 1024


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def bilinear_taps(g, side, device):
    """ids [4, g*g] (long) and weights [4, g*g] (f32) as transformers computes them."""
    src = torch.arange(g, dtype=torch.float32) * (side - 1) / (g - 1)
    fl = src.floor()
    taps = [(fl + o).clamp(max=side - 1).long() for o in (0, 1)]
    wts = [(1 - (src - fl - o).abs()).clamp(min=0) for o in (0, 1)]
    ids, weights = [], []
    for a in (0, 1):
        for b in (0, 1):
            ids.append((taps[a][:, None] * side + taps[b][None, :]).flatten())
            weights.append((wts[a][:, None] * wts[b][None, :]).flatten())
    return torch.stack(ids).to(device), torch.stack(weights).to(device)


def make_cases(device):
    """(name, bytes, setup) where setup() returns (run, check)."""
    bf16 = torch.bfloat16
    cases = []

    def randn(*shape, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(*shape, device=device, generator=g).to(bf16)

    def bias_add_setup(n):
        y, b = randn(ROWS, n, seed=1), randn(n, seed=2)
        rows = torch.tensor([0, 1, ROWS // 2, ROWS - 1], device=device)

        def run():
            y.add_(b)

        def check():
            want = y[rows].double() + b.double()
            run()
            return rel_err(y[rows], want)

        return run, check

    def bias_grad_setup(n):
        dy = randn(ROWS, n, seed=3)
        run = lambda: dy.sum(0, dtype=torch.float32)
        return run, lambda: rel_err(run(), dy.double().sum(0))

    def pos_embed_setup(backward):
        ids, w = bilinear_taps(GRID, SIDE, device)
        table = randn(SIDE * SIDE, DIM, seed=4).requires_grad_(backward)
        d_out = randn(GRID * GRID, DIM, seed=5)
        wt = w.to(bf16)  # transformers: weight_tensor in the embedding's dtype

        def fwd():
            e = F.embedding(ids, table) * wt[:, :, None]
            return e[0] + e[1] + e[2] + e[3]

        def ref():
            td = table.detach().double()
            return (td[ids] * w.double()[:, :, None]).sum(0)

        if not backward:
            rows = torch.tensor([0, 1, GRID * GRID // 3, GRID * GRID - 1], device=device)
            return fwd, lambda: rel_err(fwd()[rows], ref()[rows])

        run = lambda: torch.autograd.grad(fwd(), (table,), d_out)[0]

        def check():
            want = torch.zeros(SIDE * SIDE, DIM, dtype=torch.float64, device=device)
            want.index_add_(0, ids.flatten(), (d_out.double()[None] * w.double()[:, :, None]).flatten(0, 1))
            return rel_err(run(), want)

        return run, check

    for n in WIDTHS:
        cases.append((f"bias_add/{ROWS}x{n}/bf16", 4 * ROWS * n + 2 * n, lambda n=n: bias_add_setup(n)))
        cases.append((f"bias_grad/{ROWS}x{n}/bf16", 2 * ROWS * n + 8 * n, lambda n=n: bias_grad_setup(n)))
    P, S, D = GRID * GRID, SIDE * SIDE, DIM
    fwd_bytes = 2 * S * D + 32 * P + 2 * P * D
    shape = f"{P}x{S}x{D}"
    cases.append((f"pos_embed_fwd/{shape}/bf16", fwd_bytes, lambda: pos_embed_setup(False)))
    cases.append((f"pos_embed_fwd_bwd/{shape}/bf16", fwd_bytes + 2 * P * D + 32 * P + 8 * S * D,
                  lambda: pos_embed_setup(True)))
    return cases


def main():
    args = bench_util.parser(__doc__, out="torch_row_ops.json", warmup=3, reps=20, batch=5).parse_args()
    device = bench_util.cuda_device()

    copy_time = bench_util.copy_timer(device, args.warmup, args.reps, args.batch)
    # bf16 results (bf16 weights and products in transformers' resample)
    # against float64 on the same rounded inputs
    rows, failed = bench_util.run_copy_bound_cases(make_cases(device), copy_time, args, tol=lambda name: 2e-2)

    bench_util.write_doc(args.out, rows, bench_util.context(args, device))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_moe_permute.cu.

Times the MoE token layout ops in bf16 on one GPU with torch ops, with the
same names, configs and byte counts as the C++ benchmark (H = 2048;
T = 32768, E = 128, k = 8 and T = 16384, E = 64, k = 8; N = T k; uniform
random routing, k distinct experts per token):

    moe_layout/...         order = argsort(ids.flatten(), stable=True) (the
                           grouped row -> copy permutation), counts =
                           bincount, offsets = cumsum, copy_to_row = the
                           inverse permutation (scatter)
    moe_permute_fwd/...    x.index_select(0, order // k)
    moe_permute_bwd/...    zeros(T, H).index_add_(0, order // k, dx_grouped)
    moe_unpermute_fwd/...  weighted sum: bmm(w [T, 1, k], y_grouped[copy_to_row]
                           viewed [T, k, H])
    moe_unpermute_bwd/...  dy_grouped = dy[order // k] * w.flatten()[order];
                           dweights = (dy[:, None] * y_grouped[copy_to_row]
                           viewed [T, k, H]).sum(-1)
    moe_router_fwd/...     softmax(logits.float()), topk, renormalise, to bf16

Bytes (the algorithmic traffic, each operand once; bf16 = 2, f32 / i32 = 4):
    permute_fwd, permute_bwd 2(T + N)H;  unpermute_fwd 2(N + T)H + 2Tk;
    unpermute_bwd 2(T + 2N)H + 4Tk;  router_fwd 6TE + 6Tk;  layout 12N + 8E.

Method, per op: one correctness check (float64 on sampled tokens), --warmup
untimed calls, then --reps timed batches of --batch calls between two CUDA
events on the current stream; the time of one call is the median over batches
of batch time / batch. Every op also times a copy of bytes / 2 and reports
frac_of_copy = GB/s / copy GB/s. Prints one JSON line per op, {"bench", "us",
"gbps", "copy_gbps", "frac_of_copy", ...}, and writes them all to --out.

    python3 bench/torch_moe_permute.py --out torch_moe_permute.json

Standard library and torch only.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

H = 2048
CONFIGS = [(32768, 128, 8), (16384, 64, 8)]


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def make_cases(device):
    """(name, bytes, setup) where setup() returns (run, check); check() returns a relative error."""
    bf16 = torch.bfloat16
    cases = []

    for T, E, k in CONFIGS:
        N = T * k
        suffix = f"T{T}xH{H}/E{E}k{k}/bf16"

        def common(T=T, E=E, k=k):
            g = torch.Generator(device=device).manual_seed(7)
            # k distinct experts per token: the first k of a random permutation.
            ids = torch.rand(T, E, device=device, generator=g).argsort(dim=-1)[:, :k].to(torch.int64).contiguous()
            order = torch.argsort(ids.flatten(), stable=True)
            c2r = torch.empty_like(order)
            c2r[order] = torch.arange(order.numel(), device=device)
            tok = order // k
            randn = lambda *s, scale=1.0: (torch.randn(*s, device=device, generator=g) * scale).to(bf16)
            return ids, order, c2r, tok, randn
        toks = torch.tensor([0, 1, 4097], device=device)

        def layout_setup(T=T, E=E, k=k, common=common):
            ids, order, c2r, _, _ = common()
            flat = ids.flatten()
            inverse = torch.empty_like(order)
            ar = torch.arange(flat.numel(), device=device)

            def run():
                o = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=E)
                offsets = torch.cumsum(counts, 0)
                inverse[o] = ar
                return o, offsets

            def check():
                o, _ = run()
                return float((o != order).sum().item() + (inverse != c2r).sum().item())

            return run, check

        def permute_setup(backward, T=T, k=k, N=N, common=common):
            ids, order, c2r, tok, randn = common()
            if not backward:
                x = randn(T, H)
                run = lambda: x.index_select(0, tok)

                def check():
                    xg = run()
                    return rel_err(xg[c2r.view(T, k)[toks].flatten()], x[toks].repeat_interleave(k, 0))

                return run, check
            dxg = randn(N, H)
            run = lambda: torch.zeros(T, H, device=device, dtype=bf16).index_add_(0, tok, dxg)

            def check():
                want = dxg.double()[c2r.view(T, k)[toks]].sum(1)
                return rel_err(run()[toks], want)

            return run, check

        def unpermute_setup(backward, T=T, k=k, N=N, common=common):
            ids, order, c2r, tok, randn = common()
            yg = randn(N, H)
            w = randn(T, k, scale=0.3)
            if not backward:
                run = lambda: torch.bmm(w.view(T, 1, k), yg.index_select(0, c2r).view(T, k, H)).view(T, H)

                def check():
                    want = (w.double()[toks].unsqueeze(-1) * yg.double()[c2r.view(T, k)[toks]]).sum(1)
                    return rel_err(run()[toks], want)

                return run, check
            dy = randn(T, H)
            wflat = w.flatten()

            def run():
                dyg = dy.index_select(0, tok) * wflat.index_select(0, order).unsqueeze(1)
                dw = (dy.unsqueeze(1) * yg.index_select(0, c2r).view(T, k, H)).sum(-1)
                return dyg, dw

            def check():
                _, dw = run()
                want = (dy.double()[toks].unsqueeze(1) * yg.double()[c2r.view(T, k)[toks]]).sum(-1)
                return rel_err(dw[toks], want)

            return run, check

        def router_setup(T=T, E=E, k=k, common=common):
            _, _, _, _, randn = common()
            logits = randn(T, E, scale=2.0)

            def run():
                p = torch.softmax(logits.float(), dim=-1)
                w, i = torch.topk(p, k, dim=-1)
                w = w / w.sum(-1, keepdim=True)
                return p, i, w.to(bf16)

            def check():
                _, _, w = run()
                p = torch.softmax(logits.double()[toks], dim=-1)
                wd, _ = torch.topk(p, k, dim=-1)
                return rel_err(w[toks], wd / wd.sum(-1, keepdim=True))

            return run, check

        cases.append((f"moe_layout/{suffix}", 12 * N + 8 * E, layout_setup))
        cases.append((f"moe_permute_fwd/{suffix}", 2 * (T + N) * H, lambda f=permute_setup: f(False)))
        cases.append((f"moe_permute_bwd/{suffix}", 2 * (T + N) * H, lambda f=permute_setup: f(True)))
        cases.append((f"moe_unpermute_fwd/{suffix}", 2 * (N + T) * H + 2 * T * k, lambda f=unpermute_setup: f(False)))
        cases.append((f"moe_unpermute_bwd/{suffix}", 2 * (T + 2 * N) * H + 4 * T * k,
                      lambda f=unpermute_setup: f(True)))
        cases.append((f"moe_router_fwd/{suffix}", 6 * T * E + 6 * T * k, router_setup))
    return cases


def main():
    args = bench_util.parser(__doc__, out="torch_moe_permute.json", warmup=3, reps=20, batch=5).parse_args()
    device = bench_util.cuda_device()

    copy_time = bench_util.copy_timer(device, args.warmup, args.reps, args.batch)
    # exact for the layout, else bf16 roundings
    rows, failed = bench_util.run_copy_bound_cases(make_cases(device), copy_time, args,
                                                   tol=lambda name: 0.0 if name.startswith("moe_layout") else 1e-2)

    bench_util.write_doc(args.out, rows, bench_util.context(args, device))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

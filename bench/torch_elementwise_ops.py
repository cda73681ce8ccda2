#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_elementwise_ops.cu.

Times the memory-bound ops of a Qwen3 decoder layer in bf16 on one GPU, with
the same shapes, names and byte counts as the C++ benchmark (T = 16384):

    rms_norm_fwd/16384x{4096,2048}/bf16  F.rms_norm(x, (D,), w, eps)
    rms_norm_bwd/...                     autograd.grad of it w.r.t. x and w
    rope_fwd/16384x36x128/bf16           HF apply_rotary_pos_emb on q [T, 32, 128]
                                         and k [T, 4, 128] (cos/sin precomputed
                                         once, as HF shares them across layers)
    rope_bwd/...                         autograd.grad w.r.t. q and k
    swiglu_fwd/16384x4096/bf16           F.silu(gu[:, :F]) * gu[:, F:], gu [T, 2F]
    swiglu_bwd/...                       autograd.grad w.r.t. gu
    add/16384x4096/bf16                  torch.add(a, b, out=y)
    copy/{128,256,512}MiB                dst.copy_(src)

Bytes (the algorithmic traffic, each operand once, bf16 = 2 bytes, f32 = 4):
    rms_norm_fwd 4TD + 2D + 4T,  rms_norm_bwd 6TD + 2D + 4T + 8D,
    rope 4T(Hq + Hk)d + 4T,  swiglu_fwd 6TF,  swiglu_bwd 10TF,  add 6TD,
    copy 2B.  GB/s = bytes / time / 1e9.

Method, per op: one correctness check against float64 on sampled rows,
--warmup untimed calls, then --reps timed batches of --batch calls between two
CUDA events on the current stream; the time of one call is the median over
batches of batch time / batch. Every op also times a copy of bytes / 2 and
reports frac_of_copy = GB/s / copy GB/s. Prints one JSON line per op,
{"bench", "us", "gbps", "copy_gbps", "frac_of_copy", ...}, and writes them all
to --out (read by bench/compare_ops.py).

    python3 bench/torch_elementwise_ops.py --out torch_elementwise_ops.json

Standard library and torch only.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

T = 16384
EPS = 1e-6
THETA = 1e6


def rel_err(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    # HF's formula; q, k [T, H, d], cos / sin [T, 1, d].
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rope_cos_sin(positions, d, dtype):
    """HF Qwen3RotaryEmbedding: fp32 inv_freq, fp32 angles, cos/sin cast to the activation dtype."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def make_cases(device):
    """(name, bytes, setup) where setup() returns (run, check)."""
    bf16 = torch.bfloat16
    cases = []

    def randn(*shape, scale=1.0, seed=1):
        g = torch.Generator(device=device).manual_seed(seed)
        return (torch.randn(*shape, device=device, generator=g) * scale).to(bf16)

    for D in (4096, 2048):
        def rms_setup(D=D, backward=False):
            x = randn(T, D, scale=2.0, seed=1).requires_grad_(backward)
            w = randn(D, scale=0.3, seed=2).requires_grad_(backward)
            dy = randn(T, D, seed=3)
            rows = torch.tensor([0, 1, T // 2, T - 1], device=device)

            def ref_y():
                xd, wd = x.detach().double()[rows], w.detach().double()
                return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * wd

            if not backward:
                run = lambda: F.rms_norm(x, (D,), w, EPS)
                return run, lambda: rel_err(run()[rows], ref_y())
            y = F.rms_norm(x, (D,), w, EPS)
            run = lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)

            def check():
                xd = x.detach().double()[rows].requires_grad_(True)
                wd = w.detach().double()
                yd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS) * wd
                (dxd,) = torch.autograd.grad(yd, (xd,), dy.double()[rows])
                return rel_err(run()[0][rows], dxd)

            return run, check

        td = T * D
        cases.append((f"rms_norm_fwd/{T}x{D}/bf16", 4 * td + 2 * D + 4 * T, rms_setup))
        cases.append((f"rms_norm_bwd/{T}x{D}/bf16", 6 * td + 2 * D + 4 * T + 8 * D,
                      lambda D=D: rms_setup(D, True)))

    Hq, Hk, d = 32, 4, 128

    def rope_setup(backward=False):
        q = randn(T, Hq, d, seed=11).requires_grad_(backward)
        k = randn(T, Hk, d, seed=12).requires_grad_(backward)
        positions = torch.arange(T, device=device) % 4096  # four packed sequences of 4096
        cos, sin = rope_cos_sin(positions, d, bf16)
        toks = torch.tensor([0, 4095, 4096, T - 1], device=device)

        def ref(x, sign):
            inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            ang = (positions[toks].float()[:, None] * inv_freq.to(device)[None, :]).double()
            c, s = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None] * sign
            xd = x.detach().double()[toks]
            return xd * c + rotate_half(xd) * s

        if not backward:
            run = lambda: apply_rotary_pos_emb(q, k, cos, sin)
            return run, lambda: rel_err(run()[0][toks], ref(q, 1.0))
        qo, ko = apply_rotary_pos_emb(q, k, cos, sin)
        dq, dk = randn(T, Hq, d, seed=13), randn(T, Hk, d, seed=14)
        run = lambda: torch.autograd.grad((qo, ko), (q, k), (dq, dk), retain_graph=True)
        return run, lambda: rel_err(run()[0][toks], ref(dq, -1.0))

    rope_bytes = 4 * T * (Hq + Hk) * d + 4 * T
    cases.append((f"rope_fwd/{T}x{Hq + Hk}x{d}/bf16", rope_bytes, rope_setup))
    cases.append((f"rope_bwd/{T}x{Hq + Hk}x{d}/bf16", rope_bytes, lambda: rope_setup(True)))

    def mrope_setup():
        # transformers' Qwen3VLTextRotaryEmbedding (interleaved, sections
        # 24 / 20 / 20) gives cos / sin once per forward; each layer then runs
        # apply_rotary_pos_emb, which is what is timed.
        q, k = randn(T, Hq, d, seed=31), randn(T, Hk, d, seed=32)
        t = torch.arange(T, device=device)
        pos3 = torch.stack([t % 4096, t % 4096 + (t * 2) % 64, t % 4096 + (t * 3) % 64])
        inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)).to(device)
        freqs = pos3.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, d/2]
        f = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            f[:, offset:[24, 20, 20][axis] * 3:3] = freqs[axis][:, offset:[24, 20, 20][axis] * 3:3]
        emb = torch.cat((f, f), dim=-1)
        cos, sin = emb.cos().to(bf16)[:, None, :], emb.sin().to(bf16)[:, None, :]
        toks = torch.tensor([0, 4095, 4096, T - 1], device=device)
        run = lambda: apply_rotary_pos_emb(q, k, cos, sin)

        def check():
            ang = torch.cat((f, f), -1)[toks].double()
            xd = q.double()[toks]
            return rel_err(run()[0][toks], xd * ang.cos()[:, None] + rotate_half(xd) * ang.sin()[:, None])

        return run, check

    cases.append((f"mrope_fwd/{T}x{Hq + Hk}x{d}/bf16", rope_bytes + 8 * T, mrope_setup))

    Fdim = 4096

    def swiglu_setup(backward=False):
        gu = randn(T, 2 * Fdim, scale=2.0, seed=21).requires_grad_(backward)
        dh = randn(T, Fdim, seed=22)
        rows = torch.tensor([0, T // 3, T - 1], device=device)
        fwd = lambda: F.silu(gu[:, :Fdim]) * gu[:, Fdim:]

        def ref():
            g = gu.detach().double()[rows]
            return F.silu(g[:, :Fdim]) * g[:, Fdim:]

        if not backward:
            return fwd, lambda: rel_err(fwd()[rows], ref())
        h = fwd()
        run = lambda: torch.autograd.grad(h, (gu,), dh, retain_graph=True)

        def check():
            g = gu.detach().double()[rows].requires_grad_(True)
            (dg,) = torch.autograd.grad(F.silu(g[:, :Fdim]) * g[:, Fdim:], (g,), dh.double()[rows])
            return rel_err(run()[0][rows], dg)

        return run, check

    cases.append((f"swiglu_fwd/{T}x{Fdim}/bf16", 6 * T * Fdim, swiglu_setup))
    cases.append((f"swiglu_bwd/{T}x{Fdim}/bf16", 10 * T * Fdim, lambda: swiglu_setup(True)))

    def add_setup():
        a, b = randn(T, 4096, seed=31), randn(T, 4096, seed=32)
        y = torch.empty_like(a)
        run = lambda: torch.add(a, b, out=y)
        return run, lambda: rel_err(run(), (a.float() + b.float()).to(bf16))

    cases.append((f"add/{T}x4096/bf16", 6 * T * 4096, add_setup))

    for mib in (128, 256, 512):
        def copy_setup(n=mib << 20):
            src = torch.full((n,), 7, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            run = lambda: dst.copy_(src)
            return run, lambda: float((run() != 7).sum().item())

        cases.append((f"copy/{mib}MiB", 2 * (mib << 20), copy_setup))
    return cases


def main():
    args = bench_util.parser(__doc__, out="torch_elementwise_ops.json", warmup=3, reps=20, batch=5).parse_args()
    device = bench_util.cuda_device()

    copy_time = bench_util.copy_timer(device, args.warmup, args.reps, args.batch)
    # exact for copies, else bf16, HF-style double rounding
    rows, failed = bench_util.run_copy_bound_cases(make_cases(device), copy_time, args,
                                                   tol=lambda name: 0.0 if name.startswith("copy") else 1e-2)

    bench_util.write_doc(args.out, rows, bench_util.context(args, device))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

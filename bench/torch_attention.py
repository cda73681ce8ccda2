#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_attention.cu, and the side-by-side table.

Times torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
with the FLASH_ATTENTION and the CUDNN_ATTENTION backends on the batch that
slime's packed benchmark is equivalent to: B sequences of S tokens each (equal
lengths, so a padded [B, H, S, d] batch does exactly the packed work), H = 16
heads, bf16, one GPU. The tensors are allocated [B, S, H, d] and passed
transposed, which is slime's packed [tokens, heads, d] memory layout.

    fwd     out = sdpa(q, k, v, is_causal=True)                 (no autograd)
    fwdbwd  out = sdpa(...); torch.autograd.grad(out, (q, k, v), dout)
    bwd     fwdbwd - fwd (derived from the two medians)

FLOP, as in bench_attention.cu: pairs = B S (S + 1) / 2 (the (query, key)
pairs the causal mask keeps); fwd = 4 d pairs H; bwd = 2.5 fwd; fwdbwd = 3.5 fwd.

Method, per shape, backend and op: one correctness check of the forward
against the MATH backend in fp32 on head 0, --warmup untimed calls, then
--reps timed batches of --batch calls between two CUDA events on the current
stream; the time of one call is the median over batches of batch time / batch.
Prints one JSON line per row, {"bench", "us", "tflops", "backend", ...}; the
FLASH rows carry bench_attention's names ("attention/hd128/1x4096/fwd"), the
cuDNN rows the same with "/cudnn" appended; all go to --out.

The RL-like packed batch (VARLEN_RL: 24 sequences of 96 to 7400 tokens, d 128,
bench_attention's "attention/hd128/varlen_rl/...") has no packed causal SDPA in
PyTorch; it is timed the two ways a PyTorch trainer would run it, each backend:
  "/<backend>_padded"   one call on the batch padded to the longest sequence
                        ([24, 16, 7400, 128], is_causal=True: exact for the
                        real rows, since the padding keys come after them);
  "/<backend>_per_seq"  one call per sequence on views of the packed tensors
                        (the backward: one autograd.grad over all outputs).
Their FLOP are the packed batch's (the causal pairs of the real tokens), so the
TFLOP/s of all rows compare as times do; the ratio printed for it is slime
against the faster of the two ways.

With --slime BENCH_JSON (bench_attention's --benchmark_out, JSON format) it
also prints slime's TFLOP/s beside both backends' and the ratios slime / torch.

    python3 bench/torch_attention.py --out torch_attention.json --slime bench_attention.json

Standard library and torch only.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

HEADS = 16
# (head_dim, sequences, tokens per sequence), as in bench_attention.cu.
SHAPES = [(128, 1, 4096), (128, 1, 16384), (128, 4, 1024), (64, 1, 2048), (64, 4, 512), (80, 1, 2048), (256, 1, 2048)]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
# The RL-like packed batch (keep equal to bench_attention.cu's kRlLens), head dim 128.
VARLEN_RL = [412, 1630, 3071, 788, 5120, 2290, 96, 7400, 1345, 2811, 660, 4096,
             1980, 350, 6032, 1207, 2600, 905, 3550, 150, 4870, 1500, 2222, 731]
VARLEN_D = 128
VARLEN_WAYS = ("padded", "per_seq")


def flop(d, b, s, op):
    fwd = 4.0 * d * (b * s * (s + 1) / 2) * HEADS
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[op]


def sdpa_calls(q, k, v, leaves, dout):
    """fwd() and fwdbwd() of causal SDPA on [B, H, S, d] q, k, v (views of
    `leaves`, which the backward differentiates; dout like the output)."""
    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwdbwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, leaves, dout)

    return fwd, fwdbwd


def time_fwd_fwdbwd(kind, fwd, fwdbwd, check_fn, args):
    """fwd and fwd+bwd timed under one SDPA backend after check_fn() (its
    verdict, '' when fine): ({"fwd", "fwdbwd", "bwd": us}, error)."""
    times, error = {}, ""
    try:
        with sdpa_kernel(kind):
            error = check_fn()
            times["fwd"] = bench_util.time_us(fwd, args.warmup, args.reps, args.batch)
            times["fwdbwd"] = bench_util.time_us(fwdbwd, args.warmup, args.reps, args.batch)
            times["bwd"] = times["fwdbwd"] - times["fwd"]
    except RuntimeError as e:  # backend not available for this shape or build
        error = str(e).splitlines()[0]
    return times, error


def op_rows(name, flop_of, times, error, **fields):
    """One JSON row per op (printed as it goes): name(op), us, tflops from flop_of(op)."""
    rows = []
    for op in ("fwd", "bwd", "fwdbwd"):
        row = {"bench": name(op), **fields}
        if op in times:
            us = times[op]
            row.update({"us": us, "tflops": bench_util.tflops(flop_of(op), us)})
            if op == "bwd":
                row["derived"] = "fwdbwd - fwd"
        if error:
            row["error"] = error
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def varlen_flop(op):
    fwd = 4.0 * VARLEN_D * sum(n * (n + 1) / 2 for n in VARLEN_RL) * HEADS
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}[op]


def varlen_name(op, backend=None, way=None):
    name = f"attention/hd{VARLEN_D}/varlen_rl/{op}"
    return name if backend is None else f"{name}/{backend}_{way}"


def varlen_rows(args, device):
    """The VARLEN_RL batch, padded and per sequence, with each backend."""
    g = torch.Generator(device=device).manual_seed(2)
    total, longest, b = sum(VARLEN_RL), max(VARLEN_RL), len(VARLEN_RL)
    starts = [sum(VARLEN_RL[:i]) for i in range(b)]

    def make(shape):
        return torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16)

    # Packed [T, H, d] leaves; per-sequence [1, H, L, d] views of them.
    packed = [make((total, HEADS, VARLEN_D)).requires_grad_() for _ in range(3)]
    dout_packed = make((total, HEADS, VARLEN_D))

    def seq_view(x, i):
        return x[starts[i]:starts[i] + VARLEN_RL[i]].unsqueeze(0).transpose(1, 2)

    # Padded [B, Smax, H, d] leaves (the same values in the real rows, zeros after).
    padded = []
    for x in packed + [dout_packed]:
        y = torch.zeros(b, longest, HEADS, VARLEN_D, device=device, dtype=torch.bfloat16)
        for i in range(b):
            y[i, :VARLEN_RL[i]] = x.detach()[starts[i]:starts[i] + VARLEN_RL[i]]
        padded.append(y)
    pq, pk, pv = (y.requires_grad_() for y in padded[:3])
    pdout = padded[3].transpose(1, 2)
    ptq, ptk, ptv = (y.transpose(1, 2) for y in (pq, pk, pv))

    padded_fwd, padded_fwdbwd = sdpa_calls(ptq, ptk, ptv, (pq, pk, pv), pdout)

    def per_seq_fwd():
        with torch.no_grad():
            return [F.scaled_dot_product_attention(*(seq_view(x, i) for x in packed), is_causal=True)
                    for i in range(b)]

    def per_seq_fwdbwd():
        outs = [F.scaled_dot_product_attention(*(seq_view(x, i) for x in packed), is_causal=True) for i in range(b)]
        return torch.autograd.grad(outs, packed, [seq_view(dout_packed, i) for i in range(b)])

    ways = {"padded": (padded_fwd, padded_fwdbwd), "per_seq": (per_seq_fwd, per_seq_fwdbwd)}
    i = VARLEN_RL.index(longest)  # checked: the longest sequence, head 0, against the MATH backend
    rows = []
    for backend, kind in BACKENDS:
        for way in VARLEN_WAYS:
            fwd, fwdbwd = ways[way]

            def check_longest():
                out = fwd()
                got = out[i:i + 1, :, :longest] if way == "padded" else out[i]
                return check(got, *(seq_view(x, i) for x in packed))

            times, error = time_fwd_fwdbwd(kind, fwd, fwdbwd, check_longest, args)
            rows += op_rows(lambda op: varlen_name(op, backend, way), varlen_flop, times, error,
                            backend=backend, way=way)
    return rows


def bench_name(d, b, s, op, backend):
    name = f"attention/hd{d}/{b}x{s}/{op}"
    return name if backend == "flash" else name + "/" + backend


def check(out, q, k, v):
    """Head 0 of the backend's output against the fp32 MATH backend; '' or what went wrong."""
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q[:, :1].float(), k[:, :1].float(), v[:, :1].float(), is_causal=True)
    got = out[:, :1].float()
    err = ((got - want).norm() / want.norm()).item()
    return "" if err <= 1e-2 else f"forward relative error {err:.3g} > 1e-2"


def main():
    p = bench_util.parser(__doc__, out="torch_attention.json", warmup=3, reps=20, batch=5)
    p.add_argument("--slime", help="bench_attention JSON to compare with")
    args = p.parse_args()

    device = bench_util.cuda_device()
    rows = []
    for d, b, s in SHAPES:
        g = torch.Generator(device=device).manual_seed(1)

        def make():
            return torch.randn(b, s, HEADS, d, device=device, generator=g, dtype=torch.bfloat16)

        qb, kb, vb = (make().requires_grad_() for _ in range(3))
        q, k, v = (x.transpose(1, 2) for x in (qb, kb, vb))  # [B, H, S, d] views of [B, S, H, d]
        dout = make().transpose(1, 2)

        fwd, fwdbwd = sdpa_calls(q, k, v, (qb, kb, vb), dout)
        for backend, kind in BACKENDS:
            times, error = time_fwd_fwdbwd(kind, fwd, fwdbwd, lambda: check(fwd(), q, k, v), args)
            rows += op_rows(lambda op: bench_name(d, b, s, op, backend), lambda op: flop(d, b, s, op), times, error,
                            backend=backend)

    rows += varlen_rows(args, device)

    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    if args.slime:
        slime = {n: r["TFLOPs"] for n, r in bench_util.gbench_results(args.slime).items() if "TFLOPs" in r}
        by_name = {r["bench"]: r for r in rows}
        print(f"\n{'benchmark':<34} {'slime':>8} {'flash':>8} {'ratio':>6} {'cudnn':>8} {'ratio':>6}   (TFLOP/s)")
        for d, b, s in SHAPES:
            for op in ("fwd", "bwd", "fwdbwd"):
                name = bench_name(d, b, s, op, "flash")
                # "/mma": slime's mma.sync forward forced (AttentionKernel::mma_sync); "/sm90": its
                # Hopper kernels forced, backward included (AttentionKernel::sm90); same torch rows.
                for slime_name in [name] + ([name + "/mma"] if op == "fwd" else [name + "/sm90"]):
                    sl = slime.get(slime_name)
                    if slime_name != name and not sl:
                        continue
                    cells = [f"{sl:8.1f}" if sl else f"{'-':>8}"]
                    for backend, _ in BACKENDS:
                        t = by_name.get(bench_name(d, b, s, op, backend), {}).get("tflops")
                        cells.append(f"{t:8.1f}" if t else f"{'-':>8}")
                        cells.append(f"{sl / t:6.2f}" if sl and t else f"{'-':>6}")
                    print(f"{slime_name:<34} " + " ".join(cells))
        # The RL-like batch: each backend's faster way (padded or per sequence).
        for op in ("fwd", "bwd", "fwdbwd"):
            for slime_name in [varlen_name(op)] + ([] if op == "fwd" else [varlen_name(op) + "/sm90"]):
                sl = slime.get(slime_name)
                if slime_name != varlen_name(op) and not sl:
                    continue
                cells = [f"{sl:8.1f}" if sl else f"{'-':>8}"]
                for backend, _ in BACKENDS:
                    ts = [by_name.get(varlen_name(op, backend, w), {}).get("tflops") for w in VARLEN_WAYS]
                    t = max((x for x in ts if x), default=None)
                    cells.append(f"{t:8.1f}" if t else f"{'-':>8}")
                    cells.append(f"{sl / t:6.2f}" if sl and t else f"{'-':>6}")
                print(f"{slime_name:<34} " + " ".join(cells) + "   (torch: the faster of padded / per sequence)")
    return 1 if any("error" in r for r in rows if r["backend"] == "flash") else 0


if __name__ == "__main__":
    sys.exit(main())

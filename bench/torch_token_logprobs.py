#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_token_logprobs.cu, and the side-by-side table.

Per-token log-probabilities and entropy of an lm-head the way RL frameworks
compute them (verl's logprobs_from_logits / entropy_from_logits), bf16 inputs,
V = 151936, on the same shapes as the C++ benchmark (T = 4096 and 8192 tokens,
D = 4096 and 2048, temperature 0.8):

    logits  = (h @ W.T).float() / temperature        [T, V] fp32, materialised
    logp    = log_softmax(logits); lp = logp.gather(targets)
    entropy = logsumexp(logits) - (softmax(logits) * logits).sum(-1)

Modes: fwd (under torch.no_grad(), as for old/reference log-probs) and fwd_bwd
(autograd backward with upstream gradients g_lp, g_ent on both outputs; h.grad
and W.grad are bf16, set to None before each call). FLOP as in the C++
benchmark: fwd 2 T V D, fwd_bwd 6 T V D.

Method, per shape and mode: one correctness check of 2 tokens against float64,
--warmup untimed calls, one call measured for memory, then --reps timed
batches of --batch calls between two CUDA events; the time of one call is the
median over batches of batch time / batch. Memory, from the caching allocator:
    peak_bytes   torch.cuda.max_memory_allocated() during one call (everything)
    extra_bytes  peak_bytes - memory_allocated() after the call, with its
                 outputs and gradients still alive: the op's transient memory
(the same definitions as bench_token_logprobs, whose extra_bytes is its
workspace). Prints one JSON line per row, {"bench", "us", "tflops",
"peak_bytes", "extra_bytes", ...}, names matching the C++ benchmark's
("token_logprobs/T8192/D4096/fwd_bwd"), and writes them all to --out.

With --slime BENCH_JSON (bench_token_logprobs --benchmark_out=... in JSON; by
default bench_token_logprobs.json in the directory of --out, if present) it
prints the table: time ratio = torch time / slime time, memory ratio = torch
extra / slime extra (and the same for the peaks); > 1 means slime is better.

    python3 bench/torch_token_logprobs.py --out torch_token_logprobs.json \
        --slime bench_token_logprobs.json

Standard library and torch only. TF32 stays off (bf16 GEMMs do not use it).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

VOCAB = 151936
TEMPERATURE = 0.8
SHAPES = [(4096, 4096), (8192, 4096), (4096, 2048), (8192, 2048)]  # (tokens, dim), as in the C++ benchmark
MODES = ("fwd", "fwd_bwd")


def logprobs_and_entropy(h, w, targets, temperature):
    logits = (h @ w.t()).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(logits, dim=-1)
    ent = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
    return lp, ent


def make_run(mode, h, w, targets, g_lp, g_ent):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return logprobs_and_entropy(h, w, targets, TEMPERATURE)
        return run

    def run():
        h.grad = None
        w.grad = None
        lp, ent = logprobs_and_entropy(h, w, targets, TEMPERATURE)
        torch.autograd.backward((lp, ent), (g_lp, g_ent))
        return lp.detach(), ent.detach()
    return run


def check(h, w, targets, lp, ent):
    """Compares 2 tokens' outputs with float64; '' or what went wrong."""
    rows = torch.tensor([0, h.shape[0] - 1], device=h.device)
    z = (h[rows].double() @ w.double().t()) / TEMPERATURE
    logp = torch.log_softmax(z, dim=-1)
    want_lp = logp.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    del z, logp
    # The baseline rounds the logits to bf16 before the fp32 upcast (h @ W.T
    # returns bf16): errors of ~|z| * 2^-9 per logit, so a loose bound.
    err = max((lp[rows].double() - want_lp).abs().max().item(), (ent[rows].double() - want_ent).abs().max().item())
    return "" if err <= 0.1 else f"max abs error {err:.3g} > 0.1"


def measure_memory(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    held = torch.cuda.memory_allocated()
    del out
    return peak, peak - held


def print_table(ours, rows):
    """ours: bench_util.gbench_results of bench_token_logprobs' JSON."""
    mib = 1 << 20
    print("token_logprobs: slime vs PyTorch (ratios are torch / slime: > 1 means slime is faster or smaller)")
    print(f"{'benchmark':<36} {'slime ms':>9} {'torch ms':>9} {'time x':>7} "
          f"{'slime extra MiB':>16} {'torch extra MiB':>16} {'mem x':>7} "
          f"{'slime peak MiB':>15} {'torch peak MiB':>15} {'peak x':>7}")
    for r in rows:
        name = r["bench"]
        s = ours.get(name)
        if s is None or "error" in s:
            print(f"{name:<36} slime: {s['error'] if s else 'missing'}")
            continue
        if "error" in r and "us" not in r:
            print(f"{name:<36} torch: {r['error']}")
            continue
        t_ratio = r["us"] / s["us"] if s["us"] else float("nan")
        se, te = s.get("extra_bytes") or 0, r["extra_bytes"]
        sp, tp = s.get("peak_bytes") or 0, r["peak_bytes"]
        m_ratio = te / se if se else float("nan")
        p_ratio = tp / sp if sp else float("nan")
        print(f"{name:<36} {s['us'] / 1e3:9.2f} {r['us'] / 1e3:9.2f} {t_ratio:7.2f} "
              f"{se / mib:16.0f} {te / mib:16.0f} {m_ratio:7.1f} {sp / mib:15.0f} {tp / mib:15.0f} {p_ratio:7.2f}",
              flush=True)


def main():
    p = bench_util.parser(__doc__, out="torch_token_logprobs.json", warmup=2, reps=10, batch=2)
    p.add_argument("--slime", help="bench_token_logprobs JSON to compare with (default: bench_token_logprobs.json "
                   "beside --out, where it exists, as tools/gpu-test.sh writes them)")
    args = p.parse_args()

    device = bench_util.cuda_device()
    torch.backends.cuda.matmul.allow_tf32 = False

    rows, failed = [], False
    for tokens, dim in SHAPES:
        g = torch.Generator(device=device).manual_seed(1)
        h = torch.randn(tokens, dim, device=device, generator=g).to(torch.bfloat16)
        w = (torch.randn(VOCAB, dim, device=device, generator=g) * (2.0 / dim ** 0.5)).to(torch.bfloat16)
        targets = torch.randint(0, VOCAB, (tokens,), device=device, generator=g)
        g_lp = torch.randn(tokens, device=device, generator=g)
        g_ent = 0.1 * torch.randn(tokens, device=device, generator=g)
        for mode in MODES:
            name = f"token_logprobs/T{tokens}/D{dim}/{mode}"
            h.requires_grad_(mode == "fwd_bwd")
            w.requires_grad_(mode == "fwd_bwd")
            run = make_run(mode, h, w, targets, g_lp, g_ent)
            flop = (2.0 if mode == "fwd" else 6.0) * tokens * VOCAB * dim
            row = {"bench": name, "tokens": tokens, "dim": dim, "vocab": VOCAB, "flop": flop}
            try:
                lp, ent = run()
                error = check(h.detach(), w.detach(), targets, lp, ent)
                del lp, ent
                peak, extra = measure_memory(run)
                us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
                row.update({"us": us, "tflops": bench_util.tflops(flop, us), "peak_bytes": peak,
                            "extra_bytes": extra, "correct": not error})
                if error:
                    row["error"] = error
                    failed = True
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0]}"
                failed = True
            h.grad = None
            w.grad = None
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del h, w, targets, g_lp, g_ent
        torch.cuda.empty_cache()

    bench_util.write_doc(args.out, rows, bench_util.context(args, device, temperature=TEMPERATURE))

    slime_json = args.slime or os.path.join(os.path.dirname(os.path.abspath(args.out)), "bench_token_logprobs.json")
    if args.slime or os.path.exists(slime_json):
        print_table(bench_util.gbench_results(slime_json), rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

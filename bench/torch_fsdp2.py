#!/usr/bin/env python3
"""PyTorch FSDP2 baseline for bench/bench_fsdp.cpp, and the side-by-side table.

The train step of transformers' Qwen3ForCausalLM with bench_fsdp's "dense0.5b"
config (hidden 1024, 24 layers, 16 heads / 8 KV heads, head_dim 128,
intermediate 3072, vocab 151936, tied embeddings, rope_theta 1e6: 533.1M
parameters), random init (std 0.02), SDPA attention, no activation
checkpointing, wrapped in FSDP2: fully_shard on every decoder layer and on the
root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32
parameters (the fp32 master), torch.optim.AdamW(fused=True, lr 1e-5, betas
0.9 / 0.999, eps 1e-8, weight decay 0.01), eager (no torch.compile).

Data, weak scaling as in bench_fsdp: every rank trains on its own 8 sequences
of 2048 tokens per step, as a batch of 8 rows of 2048 (causal attention inside
each row, positions 0..2047 in each; the same attention work as slime's packed
varlen batch with cu_seqlens). Row s of rank r holds x(j) = ((r * 8 + s) * 2049
+ j) * 2654435761 mod 151936 for j = 0 .. 2048: input_ids j < 2048, targets
j >= 1, so every one of the 16384 positions has a target (the same tokens as
slime's). One step: zero_grad(set_to_none), logits = model(input_ids).logits
(bf16 [8, 2048, V]), loss = cross_entropy(logits.float(), targets) (mean over
the rank's 16384 tokens, as transformers' ForCausalLMLoss upcasts; FSDP2
averages gradients over ranks, so the loss is the mean over all ranks' tokens,
as slime's), backward, optimizer step. No host synchronisation inside a step.

Method: --warmup untimed steps (the first one's loss is checked: finite and
within 1 of ln(vocab)), reset the peak memory statistics, --steps steps with a
CUDA event on the current stream before each and after the last, one
synchronisation; a step's time is the slowest rank's, "us" the median over the
steps. Row "fsdp/dense0.5b/gpus<N>" with us, tokens_per_s (N * 16384 / median
step time), peak_gib (torch.cuda.max_memory_allocated during the timed steps,
max over ranks), reserved_gib (max_memory_reserved), tflops (model FLOP per GPU
per second, bench_fsdp's formula), mean_us, min_us, max_us, loss_first,
loss_last, gpus, tokens_per_step, params.

    python3 bench/torch_fsdp2.py --out torch_fsdp.json            # 1 GPU (a process group of one)
    torchrun --nproc-per-node 2 bench/torch_fsdp2.py --append --out torch_fsdp.json   # 2 GPUs
    python3 bench/torch_fsdp2.py --table --slime bench_fsdp.json --out torch_fsdp.json

--append keeps the rows of --out for other GPU counts. --table only prints
(and exits 1 only when a correctness check failed or a file is missing)
slime's rows (Google Benchmark JSON of bench_fsdp) beside these: step time,
tokens/s, peak memory, their ratios (torch / slime for time and memory, slime
/ torch for tokens/s: > 1 means slime is better) and the 1 -> 2 GPU scaling
(tokens/s on 2 GPUs / on 1; 2.00 is perfect weak scaling). NCCL_NVLS_ENABLE=0
unless the environment already sets it.
"""

import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script; does not import torch)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

MODEL = "dense0.5b"
SEQS, SEQ_LEN = 8, 2048
CONFIG = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_cache=False, attention_dropout=0.0,
              initializer_range=0.02)
GIB = float(1 << 30)


def bench_name(gpus):
    return f"fsdp/{MODEL}/gpus{gpus}"


def step_flop():
    """Model FLOP of one rank's step (as bench_fsdp): 6 * tokens * matmul params (lm head included)
    + 6 * layers * seqs * seq_len^2 * heads * head_dim (causal attention, forward + backward)."""
    c = CONFIG
    d, qd = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    kvd = c["num_key_value_heads"] * c["head_dim"]
    per_layer = d * qd + 2 * d * kvd + qd * d + 3 * d * c["intermediate_size"]
    matmul_params = c["num_hidden_layers"] * per_layer + c["vocab_size"] * d
    attention = 6.0 * c["num_hidden_layers"] * SEQS * SEQ_LEN * SEQ_LEN * qd
    return 6.0 * SEQS * SEQ_LEN * matmul_params + attention


def make_tokens(rank, device):
    """input_ids, targets: int64 [8, 2048], x(j) of the module docstring."""
    import torch

    rows = (rank * SEQS + torch.arange(SEQS, dtype=torch.int64))[:, None] * (SEQ_LEN + 1)
    x = (rows + torch.arange(SEQ_LEN + 1, dtype=torch.int64)[None, :]) * 2654435761 % CONFIG["vocab_size"]
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


def measure(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    if "WORLD_SIZE" in os.environ:  # torchrun
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:  # a lone process: FSDP2 over a process group of one
        device = bench_util.cuda_device()
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()

    cfg = transformers.Qwen3Config(**CONFIG)
    torch.manual_seed(0)  # the same initial weights on every rank
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.train()
    params = sum(p.numel() for p in model.parameters())  # shared (tied) parameters once
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the master parameters must be fp32"
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the embeddings must be tied"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=True)
    ids, targets = make_tokens(rank, device)
    vocab = CONFIG["vocab_size"]

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))
        del logits
        loss.backward()
        opt.step()
        return loss

    loss_first = float(step().item())
    for _ in range(args.warmup - 1):
        step()
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda.reset_peak_memory_stats(device)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
    loss = None
    for i in range(args.steps):
        marks[i].record()
        loss = step()
    marks[-1].record()
    torch.cuda.synchronize(device)
    step_ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(args.steps)]
    stats = torch.tensor(step_ms + [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                         dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # per step the slowest rank; memory the largest rank
    step_ms, peak, reserved = stats[:args.steps].tolist(), stats[-2].item(), stats[-1].item()
    loss_last = float(loss.item())

    ln_v = math.log(vocab)
    error = ""
    if not (abs(loss_first - ln_v) < 1.0) or not math.isfinite(loss_last) or loss_last > ln_v + 1.0:
        error = f"correctness check failed: first loss {loss_first}, last loss {loss_last}, expected about {ln_v}"
    median_ms = statistics.median(step_ms)
    tokens_per_step = world * SEQS * SEQ_LEN
    row = {
        "bench": bench_name(world),
        "us": median_ms * 1e3,
        "tokens_per_s": tokens_per_step / (median_ms * 1e-3),
        "peak_gib": peak / GIB,
        "reserved_gib": reserved / GIB,
        "tflops": step_flop() / (median_ms * 1e-3) / 1e12,
        "mean_us": statistics.fmean(step_ms) * 1e3,
        "min_us": min(step_ms) * 1e3,
        "max_us": max(step_ms) * 1e3,
        "loss_first": loss_first,
        "loss_last": loss_last,
        "gpus": world,
        "tokens_per_step": tokens_per_step,
        "params": params,
        "batch_layout": f"{SEQS} rows x {SEQ_LEN}",
    }
    if error:
        row["error"] = error
    ctx = None
    if rank == 0:
        ctx = bench_util.context(args, device, transformers=transformers.__version__,
                                 nccl=".".join(str(v) for v in torch.cuda.nccl.version()), model=MODEL,
                                 config=CONFIG, attn_implementation="sdpa", world_size=world, steps=args.steps,
                                 NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"))
    dist.barrier()
    dist.destroy_process_group()
    return rank, row, ctx


def load_rows(path):
    """The rows of an earlier --out (or none)."""
    if not os.path.exists(path):
        return [], {}
    with open(path) as f:
        doc = json.load(f)
    return doc.get("results", []), doc.get("context", {})


def print_table(slime, rows):
    """slime: bench_util.gbench_results of bench_fsdp's JSON; rows: this script's rows."""
    torch_rows = {r["bench"]: r for r in rows}
    print("fsdp: slime Sharded<Qwen3Model, FullShard> vs PyTorch FSDP2 (transformers Qwen3ForCausalLM), "
          f"{MODEL}, {SEQS} x {SEQ_LEN} tokens per GPU per step (weak scaling)")
    print("time x = torch / slime step time; tok/s x = slime / torch; mem x = torch / slime peak (> 1: slime better)")
    print(f"{'benchmark':<24} {'slime ms':>9} {'torch ms':>9} {'time x':>7} {'slime tok/s':>12} {'torch tok/s':>12} "
          f"{'tok/s x':>8} {'slime GiB':>10} {'torch GiB':>10} {'mem x':>6}")
    names = sorted(set(slime) | set(torch_rows), key=lambda n: (len(n), n))
    for name in names:
        s, t = slime.get(name), torch_rows.get(name)
        problems = []
        if s is None or "error" in s:
            problems.append(f"slime: {s['error'] if s else 'missing'}")
        if t is None or ("error" in t and "us" not in t):
            problems.append(f"torch: {t['error'] if t else 'missing'}")
        elif "error" in t:
            problems.append(f"torch: {t['error']}")
        if s is None or "error" in s or t is None or "us" not in t:
            print(f"{name:<24} " + "; ".join(problems))
            continue
        print(f"{name:<24} {s['us'] / 1e3:9.1f} {t['us'] / 1e3:9.1f} {t['us'] / s['us']:7.2f} "
              f"{s['tokens_per_s']:12.0f} {t['tokens_per_s']:12.0f} {s['tokens_per_s'] / t['tokens_per_s']:8.2f} "
              f"{s['peak_gib']:10.2f} {t['peak_gib']:10.2f} {t['peak_gib'] / s['peak_gib']:6.2f}"
              + (f"  ({'; '.join(problems)})" if problems else ""))
    for side, table in (("slime", slime), ("torch", torch_rows)):
        one, two = table.get(bench_name(1)), table.get(bench_name(2))
        if one and two and "tokens_per_s" in one and "tokens_per_s" in two and "error" not in one and "error" not in two:
            print(f"{side} scaling 1 -> 2 GPUs: tokens/s x {two['tokens_per_s'] / one['tokens_per_s']:.2f} "
                  f"(2.00 = perfect weak scaling), peak memory per GPU x {two['peak_gib'] / one['peak_gib']:.2f}")


def main():
    p = bench_util.parser(__doc__, out="torch_fsdp.json", warmup=3, reps=1, batch=1,
                          out_help="JSON written by rank 0", warmup_help="untimed steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    p.add_argument("--append", action="store_true", help="keep --out's rows for other GPU counts")
    p.add_argument("--table", action="store_true", help="only print the table of --slime beside --out")
    p.add_argument("--slime", help="bench_fsdp JSON (Google Benchmark) for the table")
    args = p.parse_args()
    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be >= 1")

    if args.table:
        if not args.slime:
            sys.exit("--table needs --slime BENCH_FSDP_JSON")
        rows, _ = load_rows(args.out)
        slime = bench_util.gbench_results(args.slime) if os.path.exists(args.slime) else {}
        print_table(slime, rows)
        # A wrong result fails; a configuration skipped (e.g. one GPU only) is shown, not failed.
        wrong = [r for r in [*rows, *slime.values()] if "correctness" in r.get("error", "")]
        return 1 if wrong or not rows or not slime else 0

    rank, row, ctx = measure(args)
    if rank != 0:
        return 1 if "error" in row else 0
    print(json.dumps(row), flush=True)
    rows, old_ctx = load_rows(args.out) if args.append else ([], {})
    rows = [r for r in rows if r.get("bench") != row["bench"]] + [row]
    rows.sort(key=lambda r: r.get("gpus", 0))
    contexts = dict(old_ctx.get("runs", {})) if args.append else {}
    contexts[row["bench"]] = ctx
    bench_util.write_doc(args.out, rows, {**ctx, "runs": contexts})
    if args.slime and os.path.exists(args.slime):
        print_table(bench_util.gbench_results(args.slime), rows)
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())

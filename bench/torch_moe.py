#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_moe.cpp: transformers' Qwen3MoeSparseMoeBlock.

Times forward + backward of the Hugging Face MoE block (bf16, cuda:0) on the
same shapes as the moe/block rows of bench_moe:

    bench: the project's Qwen3-MoE benchmark config, hidden 1024, 32 experts,
           top-4, moe_intermediate 384, norm_topk_prob, 16384 tokens
    a3b:   Qwen3-30B-A3B's MoE layer, hidden 2048, 128 experts, top-8,
           moe_intermediate 768, 8192 tokens

The block is built from a Qwen3MoeConfig of those sizes (transformers 5.x:
Qwen3MoeExperts with stacked weights, whose forward dispatches on
config._experts_implementation; this script asks for "grouped_mm" when torch
has _grouped_mm and falls back to "eager" if that fails; transformers 4.x: a
ModuleList of experts looped in Python). Every parameter ~ N(0, 0.02) and
x, dy ~ N(0, 1), as in bench_moe, so the routing is spread the same way (not
the same weights: timing only). One call = y = block(x) (the hidden states when
the forward returns (hidden, router_logits)) and y.backward(dy) (the gradient
of (y * dy).sum()); parameter gradients accumulate in .grad.

FLOP per call = 3 * (2*T*H*E + 3 * 2*T*k*H*I) (router and the three expert
projections; forward, dgrad, wgrad), the same formula as bench_moe. Method:
--warmup untimed calls, then --reps timed batches of --batch calls between two
CUDA events; the time of one call is the median over batches of batch time /
batch. Each row: {"bench": "moe/block/<shape>/fwd_bwd", "us", "tokens_per_s",
"tflops", "experts_implementation" (what transformers ran: "grouped_mm",
"eager", or "module_list" for 4.x), "grouped_mm" (bool), "max_load" (the most
loaded expert's rows / the mean, from the first forward), "check"}. "check" is
informational: 4 sampled tokens of y against a float64 sum over the routed
experts' weights ("ok", "failed: ...", or "skipped: ..." when the weight layout
is not recognised). Written to --out as {"context": ..., "results": [...]}.

    python3 bench/torch_moe.py --out torch_moe.json
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

# (name, tokens T, hidden H, experts E, top-k, moe_intermediate I), as in bench_moe.cpp.
SHAPES = [
    ("bench", 16384, 1024, 32, 4, 384),
    ("a3b", 8192, 2048, 128, 8, 768),
]
WEIGHT_STD = 0.02
CHECK_TOKENS = 4


def flop(T, H, E, k, I):
    return 3.0 * (2.0 * T * H * E + 3.0 * 2.0 * T * k * H * I)


def make_config(Qwen3MoeConfig, H, E, k, I):
    return Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                          norm_topk_prob=True, hidden_act="silu", num_hidden_layers=1)


def set_experts_implementation(config, impl):
    """Sets config._experts_implementation; False when this config refuses it."""
    for attr in ("_experts_implementation", "_experts_implementation_internal"):
        try:
            setattr(config, attr, impl)
        except (AttributeError, ValueError, TypeError, KeyError, NotImplementedError):
            continue
        if getattr(config, "_experts_implementation", None) == impl:
            return True
    return False


def experts_implementation(block, config):
    experts = block.experts
    if isinstance(experts, torch.nn.ModuleList):
        return "module_list"
    cfg = getattr(experts, "config", config)
    return str(getattr(cfg, "_experts_implementation", None))


def expert_weights(block, e, H, I):
    """(gate [I, H], up [I, H], down [H, I]) of expert e as float64, or None."""
    ex = block.experts
    if isinstance(ex, torch.nn.ModuleList):
        m = ex[e]
        return (m.gate_proj.weight.double(), m.up_proj.weight.double(), m.down_proj.weight.double())
    gu, dn = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if gu is None or dn is None:
        return None
    gu, dn = gu[e].double(), dn[e].double()
    if tuple(gu.shape) == (H, 2 * I):  # transposed layout [H, 2I]
        gu = gu.t()
    if tuple(dn.shape) == (I, H):
        dn = dn.t()
    if tuple(gu.shape) != (2 * I, H) or tuple(dn.shape) != (H, I):
        return None
    return gu[:I], gu[I:], dn


def routing(block, x2d, k):
    """(indices [T, k], weights [T, k] float64) as the block routes (softmax in fp32, top-k, renormalised)."""
    logits = F.linear(x2d, block.gate.weight)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    w, idx = torch.topk(probs, k, dim=-1)
    return idx, (w / w.sum(dim=-1, keepdim=True)).double()


def check(block, x2d, y2d, H, E, k, I):
    with torch.no_grad():
        idx, w = routing(block, x2d, k)
        g = torch.Generator().manual_seed(5)
        worst = 0.0
        for _ in range(CHECK_TOKENS):
            t = int(torch.randint(0, x2d.shape[0], (1,), generator=g))
            xt = x2d[t].double()
            want = torch.zeros(H, dtype=torch.float64, device=x2d.device)
            for j in range(k):
                ws = expert_weights(block, int(idx[t, j]), H, I)
                if ws is None:
                    return "skipped: unrecognised expert weight layout"
                wg, wu, wd = ws
                h = F.silu(wg @ xt) * (wu @ xt)
                want += w[t, j] * (wd @ h)
            got = y2d[t].double()
            err = float((got - want).norm() / want.norm().clamp_min(1e-30))
            worst = max(worst, err)
        return "ok" if worst <= 2e-2 else f"failed: relative error {worst:.3g} > 2e-2"


def max_load(block, x2d, E, k):
    with torch.no_grad():
        idx, _ = routing(block, x2d, k)
        counts = torch.bincount(idx.reshape(-1), minlength=E).double()
        return float(counts.max() / counts.mean())


def bench_shape(args, device, Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, name, T, H, E, k, I):
    row = {"bench": f"moe/block/{name}/fwd_bwd", "tokens": T, "hidden": H, "experts": E, "topk": k,
           "moe_intermediate": I}
    config = make_config(Qwen3MoeConfig, H, E, k, I)
    candidates = (["grouped_mm"] if hasattr(torch, "_grouped_mm") else []) + ["eager"]
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, T, H, device=device, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(1, T, H, device=device, generator=g).to(torch.bfloat16)
    block, run, y, errors = None, None, None, []
    for impl in candidates:
        set_experts_implementation(config, impl)
        try:
            with torch.device(device):
                block = Qwen3MoeSparseMoeBlock(config)
            block = block.to(dtype=torch.bfloat16)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0.0, WEIGHT_STD, generator=g)

            def run(block=block):
                out = block(x)
                out = out[0] if isinstance(out, tuple) else out
                out.backward(dy)
                return out

            y = run()
            torch.cuda.synchronize(device)
            break
        except (RuntimeError, TypeError, KeyError, ValueError, NotImplementedError, ImportError) as e:
            errors.append(f"{impl}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            block, run, y = None, None, None
            torch.cuda.empty_cache()
    if run is None:
        row["error"] = "; ".join(errors)
        return row, False
    impl = experts_implementation(block, config)
    x2d = x.detach().reshape(T, H)
    y2d = y.detach().reshape(T, H)
    row.update({"experts_implementation": impl, "grouped_mm": impl == "grouped_mm",
                "max_load": max_load(block, x2d, E, k)})
    if errors:
        row["fallback"] = "; ".join(errors)
    try:
        row["check"] = check(block, x2d, y2d, H, E, k, I)
    except (RuntimeError, TypeError, AttributeError, IndexError) as e:
        row["check"] = f"skipped: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    del y, y2d
    us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
    row.update({"us": us, "tokens_per_s": T / (us * 1e-6), "tflops": bench_util.tflops(flop(T, H, E, k, I), us)})
    del block, run, x, dy
    torch.cuda.empty_cache()
    return row, True


def main():
    p = bench_util.parser(__doc__, out="torch_moe.json", warmup=3, reps=10, batch=3)
    args = p.parse_args()
    device = bench_util.cuda_device()

    try:
        import transformers
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as e:
        sys.exit(f"transformers with Qwen3-MoE is needed: {e}")

    rows, failed = [], False
    for shape in SHAPES:
        try:
            row, ok = bench_shape(args, device, Qwen3MoeConfig, Qwen3MoeSparseMoeBlock, *shape)
        except (RuntimeError, TypeError, ValueError) as e:  # e.g. out of memory while timing
            row, ok = {"bench": f"moe/block/{shape[0]}/fwd_bwd",
                       "error": str(e).splitlines()[0] if str(e) else type(e).__name__}, False
            torch.cuda.empty_cache()
        failed |= not ok
        rows.append(row)
        print(json.dumps(row), flush=True)

    ctx = bench_util.context(args, device, transformers=transformers.__version__,
                             grouped_mm_in_torch=hasattr(torch, "_grouped_mm"))
    bench_util.write_doc(args.out, rows, ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_vision_tower.cpp: transformers' Qwen3VLVisionModel.

Times the Hugging Face vision tower (transformers 5.x,
transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel built from a
Qwen3VLVisionConfig) in bf16 on cuda:0, on the shapes of bench_vision_tower:
Qwen3-VL-2B's tower with random weights (depth 24, hidden 1024, 16 heads of
64, intermediate 4096, patch 16, temporal patch 2, 3 channels, spatial merge
2, out_hidden 2048, 2304 position embeddings, deepstack after blocks 5, 11,
17) on 1, 4 and 8 images of 448 x 448 (28 x 28 patches each) and 1 and 4
images of 1024 x 1024 (64 x 64 patches).

Attention: "sdpa" (how a PyTorch user runs the tower: transformers splits the
patches per image and calls scaled_dot_product_attention on each), rows
vision_tower/<images>x<side>/{fwd,fwd_bwd}; and "flash_attention_2" when
transformers can import it, rows .../flash_attention_2 (no slime twin, printed
alone by compare_ops). The context says whether flash_attention_2 ran.

Weights: every parameter ~ N(0, 0.02), LayerNorm weights 1 and biases 0, as
slime's init_random (not the same values: timing only). The model is bf16,
so its parameter gradients accumulate in bf16 .grad (slime's in fp32).
pixel_values [P, 1536] ~ N(0, 1) bf16. One call:
    fwd:     out = tower(pixel_values, grid_thw) (grad enabled: a training
             forward that keeps the graph)
    fwd_bwd: the same, then (sum(out.pooler_output * r) + sum_j
             sum(out.deepstack_features[j] * r_j)).backward() with fixed
             r, r_j ~ N(0, 1); no pixel gradient.
FLOP per call: the formula of bench_vision_tower.cpp (GEMMs of the patch
embedding, qkv, proj, fc1, fc2 and the four mergers; attention 4 * P_i^2 *
hidden per image per block; fwd_bwd = 3 * fwd minus the patch embedding's
dgrad, which is not run). Method: --warmup untimed calls, then --reps timed
batches of --batch calls between two CUDA events; the time of one call is the
median over batches of batch time / batch.

Each row: {"bench", "us", "patches_per_s", "tflops", "images", "patches",
"attn_implementation", "param_dtype": "bf16", "check"}. "check" is
informational: "ok" when the outputs (and the patch embedding's weight
gradient, fwd_bwd) are finite and non-zero, else "failed: ...". The context
holds "check_small": a 2-block tower (hidden 256, 4 heads of 64) on one
12 x 20-patch image in bf16 against an f32 copy of the same weights on the
same device, relative error of the embeds and deepstack outputs (<= 3e-2 is
"ok"), as slime's check does against its CPU f32 reference. Written to --out
as {"context": ..., "results": [...]}.

    python3 bench/torch_vision_tower.py --out torch_vision_tower.json
    python3 bench/torch_vision_tower.py --device cpu --tiny   # smoke test, no GPU
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script)

# (name, images, side in pixels), as in bench_vision_tower.cpp.
SHAPES = [
    ("1x448", 1, 448),
    ("4x448", 4, 448),
    ("8x448", 8, 448),
    ("1x1024", 1, 1024),
    ("4x1024", 4, 1024),
]
TOWER_2B = dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, patch_size=16,
                temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=2048,
                num_position_embeddings=2304, deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh")
SMALL = dict(TOWER_2B, depth=2, hidden_size=256, num_heads=4, intermediate_size=1024, out_hidden_size=512,
             deepstack_visual_indexes=[0, 1])
# --tiny: a smoke test of the script on any device (one 64 x 64 image).
TINY = dict(SMALL, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=128)
TINY_SHAPES = [("1x64", 1, 64)]
WEIGHT_STD = 0.02
CHECK_TOL = 3e-2


def flop(cfg, images, side, backward):
    """The FLOP of one call (bench_vision_tower.cpp's formula)."""
    H, I, O = cfg["hidden_size"], cfg["intermediate_size"], cfg["out_hidden_size"]
    K = cfg["in_channels"] * cfg["temporal_patch_size"] * cfg["patch_size"] ** 2
    m2, L = cfg["spatial_merge_size"] ** 2, cfg["depth"]
    Pi = (side // cfg["patch_size"]) ** 2
    P = images * Pi
    N = P / m2
    patch = 2.0 * P * K * H
    blocks = L * (2.0 * P * (3 * H * H + H * H + 2 * H * I) + images * 4.0 * Pi * Pi * H)
    mergers = (1 + len(cfg["deepstack_visual_indexes"])) * 2.0 * N * (m2 * H) * (m2 * H + O)
    fwd = patch + blocks + mergers
    return 3.0 * fwd - patch if backward else fwd


def build(classes, cfg, attn, dtype, device, seed):
    Qwen3VLVisionConfig, Qwen3VLVisionModel = classes
    config = Qwen3VLVisionConfig(**cfg)
    with torch.device(device):
        model = Qwen3VLVisionModel._from_config(config, attn_implementation=attn, dtype=dtype)
    model.train()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm" in name and name.endswith(".weight"):
                p.fill_(1.0)
            elif ".norm" in name and name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, WEIGHT_STD, generator=g)
    return model


def inputs(cfg, images, side, device, seed):
    """(pixel_values [P, C*T*p*p] bf16, grid_thw [images, 3], r, [r_j]), all ~ N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = side // cfg["patch_size"]
    P = images * s * s
    N = P // cfg["spatial_merge_size"] ** 2
    K = cfg["in_channels"] * cfg["temporal_patch_size"] * cfg["patch_size"] ** 2
    O = cfg["out_hidden_size"]
    pixels = torch.randn(P, K, device=device, generator=g).to(torch.bfloat16)
    grid = torch.tensor([[1, s, s]] * images, dtype=torch.int64, device=device)
    r = torch.randn(N, O, device=device, generator=g).to(torch.bfloat16)
    rs = [torch.randn(N, O, device=device, generator=g).to(torch.bfloat16) for _ in cfg["deepstack_visual_indexes"]]
    return pixels, grid, r, rs


def loss_of(out, r, rs):
    loss = (out.pooler_output * r).sum()
    for d, rj in zip(out.deepstack_features, rs):
        loss = loss + (d * rj).sum()
    return loss


def finite_nonzero(t, what):
    t = t.detach().float()
    if not bool(torch.isfinite(t).all()):
        return f"{what} is not finite"
    if not bool((t != 0).any()):
        return f"{what} is zero"
    return ""


def check_outputs(model, out, backward):
    problems = [finite_nonzero(out.pooler_output, "embeds")]
    problems += [finite_nonzero(d, f"deepstack[{j}]") for j, d in enumerate(out.deepstack_features)]
    if backward:
        grad = model.patch_embed.proj.weight.grad
        problems.append("the patch embedding's weight gradient is missing" if grad is None
                        else finite_nonzero(grad, "the patch embedding's weight gradient"))
    problems = [p for p in problems if p]
    return "ok" if not problems else "failed: " + "; ".join(problems)


def check_small(classes, attn, device, cfg):
    """bf16 tower against an f32 copy of its weights on one 12 x 20-patch image:
    the worst relative error over embeds and deepstack outputs."""
    low = build(classes, cfg, attn, torch.bfloat16, device, seed=7)
    ref = build(classes, cfg, "sdpa", torch.float32, device, seed=7)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    p = cfg["patch_size"]
    g = torch.Generator(device=device).manual_seed(8)
    K = cfg["in_channels"] * cfg["temporal_patch_size"] * p * p
    pixels = torch.randn(12 * 20, K, device=device, generator=g).to(torch.bfloat16)
    grid = torch.tensor([[1, 12, 20]], dtype=torch.int64, device=device)
    with torch.no_grad():
        a, b = low(pixels, grid), ref(pixels.float(), grid)
    worst = 0.0
    for x, y in zip([a.pooler_output, *a.deepstack_features], [b.pooler_output, *b.deepstack_features]):
        x, y = x.double(), y.double()
        err = float((x - y).norm() / y.norm().clamp_min(1e-30))
        worst = max(worst, err if err == err else float("inf"))
    verdict = "ok" if worst <= CHECK_TOL else f"failed: relative error {worst:.3g} > {CHECK_TOL}"
    return {"attn_implementation": attn, "rel_error": worst, "verdict": verdict}


def bench_impl(args, classes, cfg, shapes, attn, device, suffix):
    rows, failed = [], False
    model = build(classes, cfg, attn, torch.bfloat16, device, seed=1)
    for name, images, side in shapes:
        pixels, grid, r, rs = inputs(cfg, images, side, device, seed=2)
        P = pixels.shape[0]
        for backward in (False, True):
            row = {"bench": f"vision_tower/{name}/{'fwd_bwd' if backward else 'fwd'}{suffix}", "images": images,
                   "patches": P, "attn_implementation": attn, "param_dtype": "bf16"}

            def run(backward=backward):
                out = model(pixels, grid)
                if backward:
                    loss_of(out, r, rs).backward()
                return out

            try:
                model.zero_grad(set_to_none=True)
                row["check"] = check_outputs(model, run(), backward)
                us = time_us(run, args, device)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. out of memory
                row["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
                failed = True
                rows.append(row)
                print(json.dumps(row), flush=True)
                empty_cache(device)
                continue
            f = flop(cfg, images, side, backward)
            row.update({"us": us, "patches_per_s": P / (us * 1e-6), "tflops": bench_util.tflops(f, us), "flop": f})
            rows.append(row)
            print(json.dumps(row), flush=True)
        del pixels, grid, r, rs
        empty_cache(device)
        if not suffix:  # the tower's attention alone, as SDPA runs it in the model (once: not per backend row)
            rows.append(attention_row(args, cfg, name, images, side, device))
            print(json.dumps(rows[-1]), flush=True)
    del model
    empty_cache(device)
    return rows, failed


def attention_row(args, cfg, name, images, side, device):
    """vision_tower/<name>/attention_fwd_bwd: depth x SDPA forward + backward over
    [images, heads, n, head_dim] bf16, non-causal (what the tower's attention
    does per image), as bench_vision_tower's row of that name."""
    heads, hd = cfg["num_heads"], cfg["hidden_size"] // cfg["num_heads"]
    n = (side // cfg["patch_size"]) ** 2
    g = torch.Generator(device=device).manual_seed(11)
    q, k, v = (torch.randn(images, heads, n, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    do = torch.randn(images, heads, n, hd, device=device, dtype=torch.bfloat16, generator=g)
    F = torch.nn.functional

    def run():
        for _ in range(cfg["depth"]):
            F.scaled_dot_product_attention(q, k, v, is_causal=False).backward(do)

    row = {"bench": f"vision_tower/{name}/attention_fwd_bwd", "images": images, "patches": images * n}
    try:
        us = time_us(run, args, device)
    except (RuntimeError, TypeError, ValueError) as e:
        row["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return row
    f = cfg["depth"] * 3.0 * 4.0 * images * n * n * cfg["hidden_size"]
    row.update({"us": us, "tflops": bench_util.tflops(f, us), "flop": f})
    return row


def time_us(run, args, device):
    if device.type == "cuda":
        return bench_util.time_us(run, args.warmup, args.reps, args.batch)
    import statistics
    import time

    for _ in range(args.warmup):
        run()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        for _ in range(args.batch):
            run()
        times.append((time.perf_counter() - t0) / args.batch)
    return statistics.median(times) * 1e6


def empty_cache(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def flash_attention_2_status():
    """"" when transformers can run flash_attention_2, else why not."""
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError as e:
        return f"not importable: {e}"
    if not is_flash_attn_2_available():
        return "not importable: transformers.utils.is_flash_attn_2_available() is False (no flash_attn package)"
    return ""


def main():
    p = bench_util.parser(__doc__, out="torch_vision_tower.json", warmup=2, reps=5, batch=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of the script (wall-clock timing), with --tiny")
    p.add_argument("--tiny", action="store_true", help="a 2-block, hidden-128 tower on one 64 x 64 image")
    args = p.parse_args()
    device = bench_util.cuda_device() if args.device == "cuda" else torch.device("cpu")

    try:
        import transformers
        from transformers import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    except ImportError as e:
        sys.exit(f"transformers with Qwen3-VL (5.x) is needed: {e}")
    classes = (Qwen3VLVisionConfig, Qwen3VLVisionModel)
    cfg, shapes = (TINY, TINY_SHAPES) if args.tiny else (TOWER_2B, SHAPES)

    impls = [("sdpa", "")]
    fa2 = flash_attention_2_status() if device.type == "cuda" else "not tried on the CPU"
    if not fa2:
        impls.append(("flash_attention_2", "/flash_attention_2"))

    check = {}
    for attn, _ in impls:
        try:
            check[attn] = check_small(classes, attn, device, TINY if args.tiny else SMALL)
        except (RuntimeError, TypeError, ValueError, ImportError) as e:
            check[attn] = {"attn_implementation": attn, "verdict": f"failed: {str(e).splitlines()[0]}"}
        print(json.dumps({"check_small": check[attn]}), flush=True)

    rows, failed = [], False
    for attn, suffix in impls:
        try:
            r, f = bench_impl(args, classes, cfg, shapes, attn, device, suffix)
        except (RuntimeError, TypeError, ValueError, ImportError) as e:  # e.g. flash_attention_2 refused
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if attn == "sdpa":
                raise
            fa2 = f"failed: {msg}"
            print(json.dumps({"flash_attention_2": fa2}), flush=True)
            continue
        rows += r
        failed |= f

    fields = dict(transformers=transformers.__version__, param_dtype="bf16", attn_implementation="sdpa",
                  flash_attention_2=fa2 or "ran", check_small=list(check.values()), tiny=args.tiny)
    if device.type == "cuda":
        ctx = bench_util.context(args, device, **fields)
    else:
        ctx = {"torch": torch.__version__, "device": "cpu", "dtype": "bf16", **fields,
               "warmup": args.warmup, "reps": args.reps, "batch": args.batch}
    bench_util.write_doc(args.out, rows, ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

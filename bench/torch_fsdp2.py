#!/usr/bin/env python3
"""PyTorch FSDP2 baseline for bench/bench_fsdp.cpp, and the side-by-side table.

The train step of bench_fsdp's models, each wrapped in FSDP2:
fully_shard on every decoder layer and on the root,
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32
parameters (the fp32 master), torch.optim.AdamW(fused=True, lr 1e-5, betas
0.9 / 0.999, eps 1e-8, weight decay 0.01), random init (std 0.02), SDPA
attention, no activation checkpointing, eager (no torch.compile):

  dense0.5b  transformers' Qwen3ForCausalLM: hidden 1024, 24 layers, 16 heads /
             8 KV heads, head_dim 128, intermediate 3072, vocab 151936, tied
             embeddings, rope_theta 1e6: 533.1M parameters. 3 warm-up + 20
             timed steps, 3 repetitions.
  dense1.7b  (opt-in: --models) transformers' Qwen3ForCausalLM in Qwen3-1.7B's
             shape: hidden 2048, 28 layers, 16 heads / 8 KV heads, head_dim
             128, intermediate 6144, vocab 151936, tied embeddings, rope_theta
             1e6, rms_norm_eps 1e-6: 1720.6M parameters. 3 warm-up + 20 timed
             steps, 3 repetitions. The same 8 x 2048 tokens per GPU: estimated to fit one
             139 GiB H200 (from dense0.5b's measured 60.6 GiB: fp32 parameters
             + gradients + AdamW moments 16 B x 1.72 G = 25.6 GiB, saved
             activations about 104 KB per token and layer = 44.6 GiB, fp32
             logits, log-softmax and its gradient about 28 GiB: ~100 GiB on 1
             GPU, ~88 GiB on 2); an out-of-memory error would be its row's
             "error" (the token count is not shrunk).
  moe        transformers' Qwen3MoeForCausalLM from a Qwen3MoeConfig: hidden
             1024, 8 layers, 16 heads / 4 KV heads (head_dim 64 = hidden /
             heads), every layer sparse (decoder_sparse_step 1, no
             mlp_only_layers), 32 experts top-4, moe_intermediate 384,
             norm_topk_prob, vocab 32000, untied, rope_theta 1e6
             (intermediate 3072 unused): 388.8M parameters, 91.8M active per
             token. output_router_logits False: no load-balancing loss (as
             slime's side). No expert parallelism (the stacked expert weights
             shard with their layer). The experts run with transformers'
             "grouped_mm" experts implementation (torch grouped GEMMs) where
             this transformers / torch offers it (transformers 5:
             experts_implementation), else its default ("eager", or a
             ModuleList looped in Python for transformers 4.x); the row
             records which ran ("experts_implementation", "grouped_mm" and,
             after a failed attempt, "fallback"). 2 warm-up + 20 timed steps,
             3 repetitions.

  vl2b_8layers  (opt-in: --models) transformers'
             Qwen3VLForConditionalGeneration (Qwen3VLConfig) with Qwen3-VL-2B's
             vision tower (depth 24, hidden 1024, 16 heads of 64, intermediate
             4096, 3 channels, patch 16, temporal patch 2, spatial merge 2,
             out_hidden 2048, num_position_embeddings 2304, deepstack after
             blocks 5, 11, 17, gelu_pytorch_tanh) and its text model with 8 of
             its 28 layers (Qwen3VLTextConfig: hidden 2048, 16 heads / 8 KV
             heads, head_dim 128, intermediate 6144, vocab 151936, tied
             embeddings, rope_parameters {default, rope_theta 5e6,
             mrope_section [24, 20, 20], mrope_interleaved}, max_position
             262144, rms_norm_eps 1e-6), default special token ids (image
             151655, vision start / end 151652 / 151653). fully_shard on every
             vision block, on the tower (patch embedding, position table,
             mergers), on every text decoder layer and on the root. SDPA in
             both (transformers' tower runs one SDPA call per image). 3
             warm-up + 20 timed steps, 3 repetitions. See "VL data" below.

bench_fsdp's "moe_ep2" (the moe model with expert parallelism, mesh dp_shard 1
x ep 2) has no FSDP2 counterpart: the table shows slime's row alone, and
beside slime's fsdp/moe/gpus2 when the --slime files hold both.

Data, weak scaling as in bench_fsdp: every rank trains on its own 8 sequences
of 2048 tokens per step, as a batch of 8 rows of 2048 (causal attention inside
each row, positions 0..2047 in each; the same attention work as slime's packed
varlen batch with cu_seqlens). Row s of rank r holds x(j) = ((r * 8 + s) * 2049
+ j) * 2654435761 mod vocab for j = 0 .. 2048: input_ids j < 2048, targets
j >= 1, so every one of the 16384 positions has a target (the same tokens as
slime's). One step: zero_grad(set_to_none), logits = model(input_ids).logits
(bf16 [8, 2048, V]), loss = cross_entropy(logits.float(), targets) (mean over
the rank's 16384 tokens, as transformers' ForCausalLMLoss upcasts; FSDP2
averages gradients over ranks, so the loss is the mean over all ranks' tokens,
as slime's), backward, optimizer step. No host synchronisation inside a step
of ours (transformers' MoE code may have its own).

VL data (vl2b_8layers), as bench_fsdp's: row s of rank r is vision_start,
196 image pads (a 448 x 448 image: grid (1, 28, 28) = 784 patches, merged
2 x 2), vision_end, then text y(j) = ((r * 8 + s) * 2049 + j) * 2654435761 mod
151643 (below the first special token) for j = 198 .. 2048; input_ids j <
2048, targets j >= 1 (every one of the 16384 positions has a target, image
positions included, as slime's). pixel_values [8 * 784, 1536] bf16 ~ N(0, 1)
(per rank seed; slime draws its own values of the same shape),
image_grid_thw [[1, 28, 28]] x 8. The MRoPE position_ids [3, 8, 2048] come
from the model's get_rope_index (mm_token_type_ids: 1 on the image pads) once,
before the steps (slime's make_vl_batch builds its positions once too). One
step: zero_grad(set_to_none), loss = model(input_ids, pixel_values,
image_grid_thw, position_ids, labels=targets, shift_labels=targets).loss
(transformers' ForCausalLMLoss from labels: logits upcast to fp32, mean
cross entropy over the rank's 16384 tokens; shift_labels: the targets are
already the next tokens), backward, optimizer step. transformers' Qwen3-VL
forward has host synchronisations of its own (the grid's .tolist() to split
the merged patches per image, the placeholder count check). Extra row fields:
patches_per_s (N * 6272 / median step time), patches_per_step,
images_per_step. tokens_per_s counts every position (text and image tokens).

Method, per model, as bench_fsdp (issue 19): --reps repetitions (default 3),
each building the model anew: --warmup untimed steps (the first one's loss
is checked: finite and within 1 of ln(vocab)), reset the peak memory
statistics, --steps steps (default 20) with a CUDA event on the current
stream before each and after the last, one synchronisation; a step's time is
the slowest rank's, a repetition's time its median step, "us" the median of
the repetitions' times. Rows "fsdp/<model>/gpus<N>" with us, tokens_per_s
(N * 16384 / median step time), reps, rep_min_us / rep_max_us (the fastest
and slowest repetition) and spread_pct (their difference over the median, in
%), peak_gib (torch.cuda.max_memory_allocated during the timed steps, max
over ranks and repetitions), reserved_gib (max_memory_reserved), tflops
(model FLOP per GPU per second, bench_fsdp's formula: active matmul
parameters), mean_us, min_us, max_us (over every timed step), loss_first
(the first repetition's), loss_last (the last one's), gpus, tokens_per_step,
params, steps.
The models of --models run one after the other in one process (in the
order dense0.5b, moe, dense1.7b, vl2b_8layers), each row written to --out as soon as it is
measured; the memory of one is freed before the next.

    python3 bench/torch_fsdp2.py --out torch_fsdp.json            # 1 GPU (a process group of one)
    torchrun --nproc-per-node 2 bench/torch_fsdp2.py --append --out torch_fsdp.json   # 2 GPUs
    python3 bench/torch_fsdp2.py --table --slime bench_fsdp.json --out torch_fsdp.json

The opt-in rows (fsdp/dense1.7b/gpus1 and gpus2 here; bench_fsdp's
SLIME_BENCH_FSDP_MODELS selects its own, fsdp/moe_ep2/gpus2 included), on 2
GPUs, from the repository root:

    SLIME_BENCH_FSDP_MODELS=dense1.7b,moe_ep2 build/gpu/bench/bench_fsdp --benchmark_out=bench_fsdp_new.json
    python3 bench/torch_fsdp2.py --models dense1.7b --out torch_fsdp_new.json
    torchrun --nproc-per-node 2 bench/torch_fsdp2.py --models dense1.7b --append --out torch_fsdp_new.json
    python3 bench/torch_fsdp2.py --table --slime bench_fsdp_new.json --out torch_fsdp_new.json

(--slime bench_fsdp.json bench_fsdp_new.json: the default run's rows too, so
moe_ep2 is shown against moe on 2 GPUs.)

The VL row on one GPU (both sides in the same run, from the repository root):

    export SLIME_BENCH_FSDP_MODELS=vl2b_8layers
    build/gpu/bench/bench_fsdp --benchmark_filter=vl2b_8layers/gpus1 --benchmark_out=bench_fsdp_vl.json
    python3 bench/torch_fsdp2.py --models vl2b_8layers --out torch_fsdp_vl.json
    python3 bench/torch_fsdp2.py --table --slime bench_fsdp_vl.json --out torch_fsdp_vl.json

--models: comma-separated models to measure, default "dense0.5b,moe" (the
rows tools/gpu-test.sh runs within its 90 s per process), "all" for every
model of this script; --model is the same option. --warmup / --steps override
the models' step counts. --append keeps the rows of --out for other GPU
counts (and other models). --table only prints (and exits 1 only when a
correctness check failed or a file is missing) slime's rows (Google Benchmark
JSON of bench_fsdp; several --slime files are merged, a later file's row
replacing an earlier one of the same name) beside these: step time, tokens/s,
peak memory, their ratios (torch / slime for time and memory, slime / torch
for tokens/s: > 1 means slime is better; slime-only rows show "-" for torch),
per model the 1 -> 2 GPU scaling (tokens/s on 2 GPUs / on 1; 2.00 is perfect
weak scaling) and slime's moe_ep2 against moe on 2 GPUs. NCCL_NVLS_ENABLE=0
unless the environment already sets it.
"""

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402  (bench/, beside this script; does not import torch)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

SEQS, SEQ_LEN = 8, 2048
GIB = float(1 << 30)
# name -> transformers config class, its kwargs, head_dim (for the FLOP count), step counts, tied.
MODELS = {
    "dense0.5b": dict(
        config_class="Qwen3Config",
        config=dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_cache=False,
                    attention_dropout=0.0, initializer_range=0.02),
        head_dim=128, warmup=3, steps=20, tied=True,
        description="Qwen3 hidden 1024, 24 layers, 16/8 heads, head_dim 128, intermediate 3072, vocab 151936, tied"),
    "moe": dict(
        config_class="Qwen3MoeConfig",
        # head_dim is not a Qwen3MoeConfig field: its attention takes hidden / heads = 64 (checked after building).
        config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=40960, rms_norm_eps=1e-6,
                    rope_theta=1e6, tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
                    initializer_range=0.02, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                    hidden_act="silu"),
        head_dim=64, warmup=2, steps=20, tied=False,
        description="Qwen3-MoE hidden 1024, 8 layers (all sparse), 16/4 heads, head_dim 64, 32 experts top-4, "
                    "moe_intermediate 384, norm_topk_prob, vocab 32000, untied, no expert parallelism, no aux loss"),
    "dense1.7b": dict(
        config_class="Qwen3Config",
        config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_cache=False,
                    attention_dropout=0.0, initializer_range=0.02),
        head_dim=128, warmup=3, steps=20, tied=True,
        description="Qwen3-1.7B's shape: hidden 2048, 28 layers, 16/8 heads, head_dim 128, intermediate 6144, "
                    "vocab 151936, tied"),
    "vl2b_8layers": dict(
        config_class="Qwen3VLConfig",
        # config: the text_config (Qwen3VLTextConfig); vision: the vision_config (Qwen3VLVisionConfig).
        config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                    rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu", use_cache=False,
                    attention_dropout=0.0, initializer_range=0.02,
                    rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[24, 20, 20],
                                         mrope_interleaved=True)),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh", initializer_range=0.02),
        image_side=448,
        head_dim=128, warmup=3, steps=20, tied=True,
        description="Qwen3-VL-2B's tower (depth 24, hidden 1024, 16 heads of 64, intermediate 4096, patch 16, "
                    "temporal 2, merge 2, deepstack 5/11/17) + its text model with 8 layers (hidden 2048, 16/8 heads, "
                    "head_dim 128, intermediate 6144, vocab 151936, tied, rope_theta 5e6, mrope [24, 20, 20]); one "
                    "448x448 image (784 patches, 196 tokens) per 2048-token sequence"),
}
TEXT_VOCAB = 151643  # VL text tokens: below Qwen's first special token (<|endoftext|>)
DEFAULT_MODELS = "dense0.5b,moe"  # tools/gpu-test.sh's rows
# bench_fsdp's rows without an FSDP2 counterpart: name -> description, GPU counts, the model it is compared with.
SLIME_ONLY = {
    "moe_ep2": dict(
        description="moe with expert parallelism: mesh dp_shard 1 x ep 2, 16 of the 32 experts per GPU "
                    "(all_to_all_v token exchange), dense units sharded over both GPUs (slime only)",
        gpus=(2,), compare="moe"),
}
TABLE_ORDER = [*MODELS, *SLIME_ONLY]


def parse_models(spec):
    """The models of --models ("a,b" or "all"), in MODELS' order; exits on an unknown or slime-only name."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        sys.exit(f"--models '{spec}' names no model (models: {', '.join(MODELS)}, or all)")
    for n in names:
        if n in SLIME_ONLY:
            sys.exit(f"--models: {n} is bench_fsdp's only (FSDP2 has no counterpart); models: {', '.join(MODELS)}")
        if n != "all" and n not in MODELS:
            sys.exit(f"--models: unknown model '{n}' (models: {', '.join(MODELS)}, or all)")
    return [m for m in MODELS if "all" in names or m in names]


def bench_name(model, gpus):
    return f"fsdp/{model}/gpus{gpus}"


def is_sparse_layer(c, layer):
    """Qwen3MoeDecoderLayer's rule (as slime's Qwen3Config::is_sparse_layer)."""
    return (c.get("num_experts", 0) > 0 and layer not in c.get("mlp_only_layers", [])
            and (layer + 1) % c.get("decoder_sparse_step", 1) == 0)


def step_flop(model):
    """Model FLOP of one rank's step (as bench_fsdp): 6 * tokens * matmul params active per token (lm head
    included; MoE layers: router + top-k experts) + 6 * layers * seqs * seq_len^2 * heads * head_dim (causal
    attention, forward + backward)."""
    spec = MODELS[model]
    c = spec["config"]
    d, qd = c["hidden_size"], c["num_attention_heads"] * spec["head_dim"]
    kvd = c["num_key_value_heads"] * spec["head_dim"]
    matmul_params = c["vocab_size"] * d
    for layer in range(c["num_hidden_layers"]):
        matmul_params += d * qd + 2 * d * kvd + qd * d
        if is_sparse_layer(c, layer):
            matmul_params += d * c["num_experts"] + c["num_experts_per_tok"] * 3 * d * c["moe_intermediate_size"]
        else:
            matmul_params += 3 * d * c["intermediate_size"]
    attention = 6.0 * c["num_hidden_layers"] * SEQS * SEQ_LEN * SEQ_LEN * qd
    tower = vision_tower_flop(spec["vision"], vl_grids(spec)) if "vision" in spec else 0.0
    return 6.0 * SEQS * SEQ_LEN * matmul_params + attention + tower


def vl_grids(spec):
    """(t, h, w) of the SEQS images of one rank's step."""
    side = spec["image_side"] // spec["vision"]["patch_size"]
    return [(1, side, side)] * SEQS


def vision_tower_flop(v, grids):
    """Forward + backward model FLOP of the vision tower (bench_models.hpp's vision_tower_flop): GEMMs and
    attention, fwd = 2 P K H + L (2 P (4 H^2 + 2 H I) + sum_i 4 P_i^2 H) + mergers 2 N (m^2 H) (m^2 H + O),
    fwd + bwd = 3 fwd - 2 P K H (no pixel gradient)."""
    h, i, o, layers = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v["depth"]
    k = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    m2 = v["spatial_merge_size"] ** 2
    p = sum(t * hh * w for t, hh, w in grids)
    attn = sum(t * 4.0 * (hh * w) ** 2 * h for t, hh, w in grids)
    patch = 2.0 * p * k * h
    blocks = layers * (2.0 * p * (3.0 * h * h + h * h + 2.0 * h * i) + attn)
    mergers = (1 + len(v["deepstack_visual_indexes"])) * 2.0 * (p / m2) * (m2 * h) * (m2 * h + o)
    return 3.0 * (patch + blocks + mergers) - patch


def make_tokens(rank, vocab, device):
    """input_ids, targets: int64 [8, 2048], x(j) of the module docstring."""
    import torch

    rows = (rank * SEQS + torch.arange(SEQS, dtype=torch.int64))[:, None] * (SEQ_LEN + 1)
    x = (rows + torch.arange(SEQ_LEN + 1, dtype=torch.int64)[None, :]) * 2654435761 % vocab
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


def make_vl_batch(rank, spec, config, device, dtype):
    """vl2b_8layers' batch of the module docstring: dict(input_ids, pixel_values, image_grid_thw, mm_token_type_ids)
    and targets (int64 [8, 2048])."""
    import torch

    v = spec["vision"]
    grids = vl_grids(spec)
    patches = grids[0][0] * grids[0][1] * grids[0][2]
    merged = patches // v["spatial_merge_size"] ** 2
    ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    assert min(ids) >= TEXT_VOCAB, f"special token ids {ids} inside the text tokens' range [0, {TEXT_VOCAB})"
    head = [config.vision_start_token_id] + [config.image_token_id] * merged + [config.vision_end_token_id]
    rows = (rank * SEQS + torch.arange(SEQS, dtype=torch.int64))[:, None] * (SEQ_LEN + 1)
    y = (rows + torch.arange(SEQ_LEN + 1, dtype=torch.int64)[None, :]) * 2654435761 % TEXT_VOCAB
    y[:, :len(head)] = torch.tensor(head, dtype=torch.int64)
    gen = torch.Generator().manual_seed(1000 + rank)
    patch_dim = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    pixel_values = torch.randn(SEQS * patches, patch_dim, generator=gen).to(device=device, dtype=dtype)
    input_ids = y[:, :-1].contiguous().to(device)
    inputs = dict(input_ids=input_ids, pixel_values=pixel_values,
                  image_grid_thw=torch.tensor(grids, dtype=torch.int64, device=device),
                  mm_token_type_ids=(input_ids == config.image_token_id).to(torch.int32))
    return inputs, y[:, 1:].contiguous().to(device)


def first_line(e):
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def experts_implementation(model):
    """What runs the experts of an MoE model: "module_list" (transformers 4.x: experts looped in Python), else
    the config's _experts_implementation (transformers 5: "grouped_mm", "eager", ...)."""
    import torch

    experts = getattr(model.model.layers[0].mlp, "experts", None)
    if isinstance(experts, torch.nn.ModuleList):
        return "module_list"
    cfg = getattr(experts, "config", None) or model.config
    return str(getattr(cfg, "_experts_implementation", None) or getattr(model.config, "_experts_implementation", None))


def build(transformers, model_name, device, experts_impl):
    """The FSDP2-wrapped model and its optimizer (experts_impl: None, or the requested experts implementation)."""
    import torch

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    spec = MODELS[model_name]
    kwargs = dict(spec["config"])
    if experts_impl is not None:
        kwargs["experts_implementation"] = experts_impl
    vl = "vision" in spec
    if vl:  # Qwen3VLConfig: tie_word_embeddings at the top level, the ids transformers' defaults
        cfg = getattr(transformers, spec["config_class"])(text_config=kwargs, vision_config=dict(spec["vision"]),
                                                          tie_word_embeddings=spec["tied"])
    else:
        cfg = getattr(transformers, spec["config_class"])(**kwargs)
    extra = {} if experts_impl is None else {"experts_implementation": experts_impl}
    torch.manual_seed(0)  # the same initial weights on every rank
    with torch.device(device):
        if vl:
            model = transformers.Qwen3VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa")
        else:
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **extra)
    model.train()
    params = sum(p.numel() for p in model.parameters())  # shared (tied) parameters once
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the master parameters must be fp32"
    text = model.model.language_model if vl else model.model
    tied = model.lm_head.weight is text.embed_tokens.weight
    assert tied == spec["tied"], f"the embeddings must {'' if spec['tied'] else 'not '}be tied"
    head_dim = getattr(text.layers[0].self_attn, "head_dim", spec["head_dim"])
    assert head_dim == spec["head_dim"], f"head_dim {head_dim}, expected {spec['head_dim']}"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if vl:  # the tower's blocks, then the rest of the tower (patch embedding, position table, mergers)
        for block in model.model.visual.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model.model.visual, mp_policy=mp)
    for layer in text.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=True)
    return model, opt, params


def measure_model(args, transformers, model_name, device, world, rank):
    """(row, context) of one model (see the module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    spec = MODELS[model_name]
    warmup = args.warmup if args.warmup is not None else spec["warmup"]
    steps = args.steps if args.steps is not None else spec["steps"]
    vocab = spec["config"]["vocab_size"]
    vl = "vision" in spec
    if not vl:
        ids, targets = make_tokens(rank, vocab, device)
    moe = spec["config_class"] == "Qwen3MoeConfig"
    # MoE: ask for grouped_mm where torch has grouped GEMMs; on failure (to build, or in the first step) the default.
    candidates = ([("grouped_mm" if hasattr(torch, "_grouped_mm") else None)] + [None]) if moe else [None]
    candidates = list(dict.fromkeys(candidates))
    reps = args.reps
    rep_ms, all_ms, peak, reserved = [], [], 0.0, 0.0
    for rep in range(reps):  # each repetition builds the model anew (as bench_fsdp)
        fallback = []
        model = opt = step = None
        gc_cuda(device)
        for i, impl in enumerate(candidates):
            try:
                model, opt, params = build(transformers, model_name, device, impl)
                if vl:
                    inputs, targets = make_vl_batch(rank, spec, model.config, device, torch.bfloat16)
                    with torch.no_grad():  # MRoPE positions [3, 8, 2048], once (outside the steps)
                        position_ids, _ = model.model.get_rope_index(
                            inputs["input_ids"], mm_token_type_ids=inputs.pop("mm_token_type_ids"),
                            image_grid_thw=inputs["image_grid_thw"])
                    inputs["position_ids"] = position_ids

                    def step(model=model, opt=opt):
                        opt.zero_grad(set_to_none=True)
                        loss = model(**inputs, labels=targets, shift_labels=targets).loss
                        loss.backward()
                        opt.step()
                        return loss
                else:
                    def step(model=model, opt=opt):
                        opt.zero_grad(set_to_none=True)
                        logits = model(input_ids=ids, use_cache=False).logits
                        loss = F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1))
                        del logits
                        loss.backward()
                        opt.step()
                        return loss

                loss_first = float(step().item())
                break
            except (RuntimeError, TypeError, ValueError, ImportError, NotImplementedError, AttributeError) as e:
                if i + 1 == len(candidates):
                    raise
                fallback.append(f"{impl}: {first_line(e)}")
                model = opt = step = None
                gc_cuda(device)
        for _ in range(warmup - 1):
            step()
        torch.cuda.synchronize(device)
        dist.barrier()
        torch.cuda.reset_peak_memory_stats(device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        loss = None
        for i in range(steps):
            marks[i].record()
            loss = step()
        marks[-1].record()
        torch.cuda.synchronize(device)
        step_ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(steps)]
        stats = torch.tensor(step_ms + [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # per step the slowest rank; memory the largest rank
        step_ms = stats[:steps].tolist()
        peak, reserved = max(peak, stats[-2].item()), max(reserved, stats[-1].item())
        rep_ms.append(statistics.median(step_ms))
        all_ms += step_ms
        if rep == 0:
            first_of_reps = loss_first
        loss_last = float(loss.item())
    loss_first = first_of_reps

    ln_v = math.log(vocab)
    error = ""
    if not (abs(loss_first - ln_v) < 1.0) or not math.isfinite(loss_last) or loss_last > ln_v + 1.0:
        error = f"correctness check failed: first loss {loss_first}, last loss {loss_last}, expected about {ln_v}"
    median_ms = statistics.median(rep_ms)  # the median of the repetitions' median steps
    tokens_per_step = world * SEQS * SEQ_LEN
    row = {
        "bench": bench_name(model_name, world),
        "us": median_ms * 1e3,
        "tokens_per_s": tokens_per_step / (median_ms * 1e-3),
        "peak_gib": peak / GIB,
        "reserved_gib": reserved / GIB,
        "tflops": step_flop(model_name) / (median_ms * 1e-3) / 1e12,
        "mean_us": statistics.fmean(all_ms) * 1e3,
        "min_us": min(all_ms) * 1e3,
        "max_us": max(all_ms) * 1e3,
        "reps": reps,
        "rep_min_us": min(rep_ms) * 1e3,
        "rep_max_us": max(rep_ms) * 1e3,
        "spread_pct": 100.0 * (max(rep_ms) - min(rep_ms)) / median_ms,
        "loss_first": loss_first,
        "loss_last": loss_last,
        "gpus": world,
        "tokens_per_step": tokens_per_step,
        "params": params,
        "steps": steps,
        "batch_layout": f"{SEQS} rows x {SEQ_LEN}",
    }
    if vl:
        patches_per_step = world * sum(t * h * w for t, h, w in vl_grids(spec))
        row.update({"patches_per_s": patches_per_step / (median_ms * 1e-3), "patches_per_step": patches_per_step,
                    "images_per_step": world * SEQS})
    if moe:
        impl = experts_implementation(model)
        row.update({"experts_implementation": impl, "grouped_mm": impl == "grouped_mm"})
        if fallback:
            row["fallback"] = "; ".join(fallback)
    if error:
        row["error"] = error
    ctx = None
    if rank == 0:
        cfg = getattr(model.config, "text_config", model.config)  # a VL model's: its text_config
        rope = getattr(cfg, "rope_parameters", None)
        theta = rope.get("rope_theta") if isinstance(rope, dict) else getattr(cfg, "rope_theta", None)
        ctx = bench_util.context(argparse.Namespace(warmup=warmup, reps=args.reps, batch=args.batch), device,
                                 transformers=transformers.__version__,
                                 nccl=".".join(str(v) for v in torch.cuda.nccl.version()), model=model_name,
                                 model_class=type(model).__name__, config=spec["config"],
                                 vision_config=spec.get("vision"), rope_theta_effective=theta,
                                 attn_implementation="sdpa", world_size=world, steps=steps,
                                 NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"))
    del model, opt, step, loss, marks
    return row, ctx


def gc_cuda(device):
    """Frees what an earlier model left (before the next one is built)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def measure(args, record):
    """Measures the models of --models in turn; record(row, ctx) on rank 0 after each. Returns (rank, failed)."""
    import torch
    import torch.distributed as dist
    import transformers

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

    failed = False
    for model_name in parse_models(args.models):
        try:
            row, ctx = measure_model(args, transformers, model_name, device, world, rank)
        except (RuntimeError, TypeError, ValueError, ImportError, NotImplementedError, AttributeError,
                AssertionError) as e:  # e.g. no Qwen3-MoE in this transformers, out of memory
            row, ctx = {"bench": bench_name(model_name, world), "gpus": world, "error": first_line(e)}, None
        failed |= "error" in row
        if rank == 0:
            record(row, ctx)
        gc_cuda(device)
        dist.barrier()
    dist.destroy_process_group()
    return rank, failed


def load_rows(path):
    """The rows of an earlier --out (or none)."""
    if not os.path.exists(path):
        return [], {}
    with open(path) as f:
        doc = json.load(f)
    return doc.get("results", []), doc.get("context", {})


def row_model(name):
    """"fsdp/<model>/gpus<N>" -> "<model>" ("" for another name)."""
    parts = name.split("/")
    return parts[1] if len(parts) > 1 else ""


def print_table(slime, rows):
    """slime: bench_util.gbench_results of bench_fsdp's JSON; rows: this script's rows."""
    torch_rows = {r["bench"]: r for r in rows}
    present = {row_model(n) for n in [*slime, *torch_rows]}
    print("fsdp: slime Sharded<Qwen3Model / Qwen3VLModel, FullShard> vs PyTorch FSDP2 (transformers "
          f"Qwen3ForCausalLM / Qwen3MoeForCausalLM / Qwen3VLForConditionalGeneration), {SEQS} x {SEQ_LEN} tokens per "
          "GPU per step (weak scaling; VL: image tokens included)")
    for name, spec in [*MODELS.items(), *SLIME_ONLY.items()]:
        if name in present:
            print(f"  {name}: {spec['description']}")
    print("time x = torch / slime step time; tok/s x = slime / torch; mem x = torch / slime peak (> 1: slime better)")
    print(f"{'benchmark':<24} {'slime ms':>9} {'torch ms':>9} {'time x':>7} {'slime tok/s':>12} {'torch tok/s':>12} "
          f"{'tok/s x':>8} {'slime GiB':>10} {'torch GiB':>10} {'mem x':>6}")
    order = {name: i for i, name in enumerate(TABLE_ORDER)}

    def key(n):
        parts = n.split("/")
        return (order.get(parts[1], len(order)) if len(parts) > 1 else len(order), len(n), n)

    names = sorted(set(slime) | set(torch_rows), key=key)
    for name in names:
        s, t = slime.get(name), torch_rows.get(name)
        if row_model(name) in SLIME_ONLY and t is None:  # no FSDP2 counterpart: slime's numbers alone
            if s is None or "error" in s:
                print(f"{name:<24} slime: {s['error'] if s else 'missing'}")
            else:
                print(f"{name:<24} {s['us'] / 1e3:9.1f} {'-':>9} {'-':>7} {s['tokens_per_s']:12.0f} {'-':>12} "
                      f"{'-':>8} {s['peak_gib']:10.2f} {'-':>10} {'-':>6}  (slime only)")
            continue
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

    def ok(row):
        return row is not None and "tokens_per_s" in row and "error" not in row

    for model in MODELS:
        for side, table in (("slime", slime), ("torch", torch_rows)):
            one, two = table.get(bench_name(model, 1)), table.get(bench_name(model, 2))
            if ok(one) and ok(two):
                print(f"{model} {side} scaling 1 -> 2 GPUs: tokens/s x "
                      f"{two['tokens_per_s'] / one['tokens_per_s']:.2f} (2.00 = perfect weak scaling), "
                      f"peak memory per GPU x {two['peak_gib'] / one['peak_gib']:.2f}")
    for model, spec in SLIME_ONLY.items():
        for gpus in spec["gpus"]:
            mine, base = slime.get(bench_name(model, gpus)), slime.get(bench_name(spec["compare"], gpus))
            if ok(mine) and ok(base):
                print(f"{model} vs {spec['compare']} on {gpus} GPUs (slime): tokens/s x "
                      f"{mine['tokens_per_s'] / base['tokens_per_s']:.2f}, peak memory per GPU x "
                      f"{mine['peak_gib'] / base['peak_gib']:.2f} (> 1: {model} higher)")
    for name in names:  # VL rows: the tower's throughput too
        s, t = slime.get(name), torch_rows.get(name)
        if ok(s) and ok(t) and "patches_per_s" in s and "patches_per_s" in t:
            print(f"{name} patches/s: slime {s['patches_per_s']:.0f}, torch {t['patches_per_s']:.0f}, "
                  f"x {s['patches_per_s'] / t['patches_per_s']:.2f} (slime / torch); model TFLOP/s per GPU: slime "
                  f"{s['tflops']:.1f}, torch {t['tflops']:.1f}")
    # Run-to-run spread (issue 19's bar: <= 5%): the slowest repetition's median
    # step over the fastest one's, both sides.
    for name in names:
        for side, row in (("slime", slime.get(name)), ("torch", torch_rows.get(name))):
            if ok(row) and "spread_pct" in row:
                print(f"{name} {side}: {int(row.get('reps', 0))} repetitions, median step {row['us'] / 1e3:.1f} ms, "
                      f"fastest {row['rep_min_us'] / 1e3:.1f}, slowest {row['rep_max_us'] / 1e3:.1f} ms, "
                      f"spread {row['spread_pct']:.1f}%")
    impls = {r["bench"]: r["experts_implementation"] + (f" (after: {r['fallback']})" if r.get("fallback") else "")
             for r in rows if "experts_implementation" in r}
    for name, impl in sorted(impls.items()):
        print(f"torch experts implementation, {name}: {impl}")


def load_slime(paths):
    """The rows of bench_fsdp's JSON files merged (a later file's row replaces an earlier one of the same name),
    and the paths that do not exist."""
    slime, missing = {}, []
    for path in paths or []:
        if os.path.exists(path):
            slime.update(bench_util.gbench_results(path))
        else:
            missing.append(path)
    return slime, missing


def main():
    p = bench_util.parser(__doc__, out="torch_fsdp.json", warmup=None, reps=3, batch=1,
                          out_help="JSON written by rank 0",
                          warmup_help="untimed steps of each repetition (default: dense0.5b and dense1.7b 3, moe 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps of each of --reps repetitions (each builds the model anew); the median of "
                        "the repetitions' median steps is reported (default 20)")
    p.add_argument("--models", "--model", dest="models", default=DEFAULT_MODELS,
                   help=f"comma-separated models to measure ({', '.join(MODELS)}) or all (default: {DEFAULT_MODELS})")
    p.add_argument("--append", action="store_true", help="keep --out's rows for other GPU counts and models")
    p.add_argument("--table", action="store_true", help="only print the table of --slime beside --out")
    p.add_argument("--slime", nargs="+", help="bench_fsdp JSON file(s) (Google Benchmark) for the table, merged")
    args = p.parse_args()
    if (args.warmup is not None and args.warmup < 1) or (args.steps is not None and args.steps < 1) or args.reps < 1:
        sys.exit("--warmup, --steps and --reps must be >= 1")

    if args.table:
        if not args.slime:
            sys.exit("--table needs --slime BENCH_FSDP_JSON [...]")
        rows, _ = load_rows(args.out)
        slime, missing = load_slime(args.slime)
        print_table(slime, rows)
        for path in missing:
            print(f"missing: {path}")
        # A wrong result fails; a configuration skipped (e.g. one GPU only) is shown, not failed.
        wrong = [r for r in [*rows, *slime.values()] if "correctness" in r.get("error", "")]
        return 1 if wrong or not rows or not slime or missing else 0
    parse_models(args.models)  # exits on a bad name before any process group exists

    rows, old_ctx = load_rows(args.out) if args.append else ([], {})
    contexts = dict(old_ctx.get("runs", {})) if args.append else {}
    order = {name: i for i, name in enumerate(MODELS)}

    def record(row, ctx):
        """Rank 0: prints the row and rewrites --out with it (a later timeout keeps the rows so far)."""
        nonlocal rows
        print(json.dumps(row), flush=True)
        rows = [r for r in rows if r.get("bench") != row["bench"]] + [row]
        rows.sort(key=lambda r: (order.get(row_model(r.get("bench", "")), len(order)), r.get("gpus", 0)))
        if ctx is not None:
            contexts[row["bench"]] = ctx
        last = ctx or next(iter(contexts.values()), {})
        bench_util.write_doc(args.out, rows, {**last, "runs": contexts})

    rank, failed = measure(args, record)
    if rank != 0:
        return 1 if failed else 0
    slime, _ = load_slime(args.slime)
    if slime:
        print_table(slime, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

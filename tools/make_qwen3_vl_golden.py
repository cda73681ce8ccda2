#!/usr/bin/env python3
"""tools/make_qwen3_vl_golden.py: the golden fixtures of slime's Qwen3-VL path.

Builds a tiny random transformers Qwen3VLForConditionalGeneration (float32,
eager attention, fixed seed) and writes into tests/nn/data/qwen3_vl_tiny/
(or --out); with --moe a Qwen3VLMoeForConditionalGeneration (4 experts,
top-2, layer 1 dense through mlp_only_layers) into
tests/nn/data/qwen3_vl_moe_tiny/, whose model.safetensors stores the experts
fused as transformers 5 writes them (gate_up_proj [E, 2I, hidden], down_proj
[E, hidden, I]; the hub's checkpoints hold their transposes, which
transformers and slime read too), and whose golden expert gradients are per expert
(grad.<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight, [out, in]):

  config.json, model.safetensors   the Hugging Face directory (save_pretrained)
  golden.safetensors               what slime's Qwen3-VL tests compare:
    pixel_values      f32 [P, C*T*p*p]  every image of every sample, in order
                                        (random: the tower does not care where
                                        they came from)
    image_grid_thw    i64 [I, 3]        their grids (patches, before merging)
    s<k>.tokens       i64 [L_k]         sample k (0: one image, 1: two images,
                                        one of them tall, 2: text only), its
                                        image-pad runs expanded
    s<k>.position_ids i64 [3, L_k]      get_rope_index (MRoPE t, h, w)
    s<k>.targets      i64 [L_k]         the next token; the last gets a fixed
                                        random id
    s<k>.logits       f32 [L_k, V]      the sample run alone, batch size 1
    s<k>.logprobs     f32 [L_k]         log_softmax(logits)[t, targets[t]]
    loss              f32 [1]           L = -sum over samples and tokens of
                                        logprobs / total tokens
    grad.<name>       f32               dL/d(parameter), every HF parameter
    vision.embeds     f32 [N, H]        the vision tower on pixel_values
                                        (merged tokens N = P / merge^2)
    vision.deepstack.<j> f32 [N, H]     its deepstack features, j-th index
    vision.r, vision.r_deepstack.<j>    fixed random weights: the tower loss
                                        Lv = sum(embeds * r) + sum_j
                                        sum(deepstack_j * r_deepstack_j)
    vision.grad.<name> f32              dLv/d(parameter) of the tower's
                                        parameters (HF names)

Run: /path/to/python tools/make_qwen3_vl_golden.py (needs torch,
transformers >= 4.57 with Qwen3-VL, safetensors). The fixture must stay under
3 MB; the script checks.
"""
import argparse
import inspect
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                          Qwen3VLMoeForConditionalGeneration)

SEED = 20261202
MAX_FIXTURE_BYTES = 3 * 1024 * 1024
IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 120, 121, 122, 123
MERGE = 2
# Grids (t, h, w) in patches; sample 0 has image 0, sample 1 images 1 and 2.
GRIDS = [(1, 8, 12), (1, 4, 4), (1, 12, 4)]
SAMPLE_IMAGES = [[0], [1, 2], []]
TEXT = [  # text runs around the images: len(images) + 1 runs per sample
    [5, 9],
    [3, 2, 6],
    [17],
]


def make_config(moe=False):
    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # one of the CUDA attention kernels' head dims
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        attention_bias=False,
        hidden_act="silu",
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                    mlp_only_layers=[1], router_aux_loss_coef=0.001, output_router_logits=False)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10], "mrope_interleaved": True}
    from transformers import Qwen3VLTextConfig

    text_class = Qwen3VLTextConfig
    if moe:
        from transformers import Qwen3VLMoeTextConfig as text_class
    if "rope_parameters" in inspect.signature(text_class.__init__).parameters:
        text["rope_parameters"] = rope
    else:
        text["rope_theta"] = rope["rope_theta"]
        text["rope_scaling"] = {"rope_type": "default", "mrope_section": rope["mrope_section"], "mrope_interleaved": True}
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=1,  # head_dim 32 (a CUDA attention kernel of its own)
        in_channels=3,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=MERGE,
        out_hidden_size=64,
        num_position_embeddings=16,  # a 4 x 4 learned grid, interpolated
        deepstack_visual_indexes=[0],
        hidden_act="gelu_pytorch_tanh",
        initializer_range=0.2,
    )
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    return config


def vision_outputs(out):
    """(embeds, [deepstack...]) from whatever the tower returns."""
    if isinstance(out, tuple):
        return out[0], list(out[1])
    for a, b in (("pooler_output", "deepstack_features"), ("last_hidden_state", "deepstack_features")):
        if hasattr(out, a) and hasattr(out, b) and getattr(out, b) is not None:
            return getattr(out, a), list(getattr(out, b))
    raise SystemExit(f"unknown vision tower output {type(out)}: {list(vars(out))}")


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--moe", action="store_true", help="Qwen3-VL-MoE (default: dense Qwen3-VL)")
    args = parser.parse_args()
    if args.out is None:
        args.out = root / ("tests/nn/data/qwen3_vl_moe_tiny" if args.moe else "tests/nn/data/qwen3_vl_tiny")

    torch.manual_seed(SEED)
    config = make_config(args.moe)
    model_class = Qwen3VLMoeForConditionalGeneration if args.moe else Qwen3VLForConditionalGeneration
    model = model_class(config).to(torch.float32)
    lm_head, embed = model.lm_head.weight, model.model.language_model.embed_tokens.weight
    assert lm_head.data_ptr() != embed.data_ptr(), "the fixture's LM head must be untied"
    model.eval()
    with torch.no_grad():
        # Norm weights start at 1 and biases at 0: perturb them so that their
        # gradients and products are exercised.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    visual = model.model.visual
    v = config.vision_config
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size * v.patch_size

    gen = torch.Generator().manual_seed(SEED + 1)
    grid_thw = torch.tensor(GRIDS, dtype=torch.int64)
    patches = [t * h * w for t, h, w in GRIDS]
    pixel_values = torch.randn(sum(patches), patch_dim, generator=gen)
    pixel_of = list(torch.split(pixel_values, patches))

    # The tower alone.
    golden = {"pixel_values": pixel_values.contiguous(), "image_grid_thw": grid_thw}
    model.zero_grad(set_to_none=True)
    embeds, deep = vision_outputs(visual(pixel_values, grid_thw=grid_thw))
    r = torch.randn(embeds.shape, generator=gen)
    rd = [torch.randn(d.shape, generator=gen) for d in deep]
    loss_v = (embeds * r).sum() + sum((d * w).sum() for d, w in zip(deep, rd))
    loss_v.backward()
    golden["vision.embeds"] = embeds.detach().contiguous()
    golden["vision.r"] = r
    for j, (d, w) in enumerate(zip(deep, rd)):
        golden[f"vision.deepstack.{j}"] = d.detach().contiguous()
        golden[f"vision.r_deepstack.{j}"] = w
    prefix = next(n for n, m in model.named_modules() if m is visual)
    for name, p in visual.named_parameters():
        assert p.grad is not None, f"no tower gradient for {name}"
        golden[f"vision.grad.{prefix}.{name}"] = p.grad.detach().float().contiguous()

    # The whole model, sample by sample.
    samples = []
    for k, (images, text) in enumerate(zip(SAMPLE_IMAGES, TEXT)):
        ids = []
        for i, n in enumerate(text):
            ids += torch.randint(0, 100, (n,), generator=gen).tolist()
            if i < len(images):
                g = GRIDS[images[i]]
                ids += [VISION_START] + [IMAGE_TOKEN] * (g[0] * g[1] * g[2] // MERGE**2) + [VISION_END]
        samples.append(torch.tensor(ids, dtype=torch.int64))
    total = sum(len(s) for s in samples)
    model.zero_grad(set_to_none=True)
    loss_total = 0.0
    for k, (ids, images) in enumerate(zip(samples, SAMPLE_IMAGES)):
        kwargs = {}
        if images:
            kwargs["pixel_values"] = torch.cat([pixel_of[i] for i in images])
            kwargs["image_grid_thw"] = grid_thw[images]
        # transformers >= 5.x marks the image tokens (mm_token_type_ids, 1
        # for image pads); 4.57 finds them from vision_start.
        types = (ids == IMAGE_TOKEN).to(torch.int32)[None, :]
        if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
            pos, _ = model.model.get_rope_index(ids[None, :], types, image_grid_thw=kwargs.get("image_grid_thw"))
            kwargs["mm_token_type_ids"] = types
        else:
            pos, _ = model.model.get_rope_index(ids[None, :], kwargs.get("image_grid_thw"), None, None)
        out = model(input_ids=ids[None, :], use_cache=False, **kwargs)
        logits = out.logits[0].float()
        targets = torch.empty_like(ids)
        targets[:-1] = ids[1:]
        targets[-1] = torch.randint(0, 100, (1,), generator=gen)
        lp = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
        loss = -lp.sum() / total
        loss.backward()
        loss_total += loss.item()
        golden[f"s{k}.tokens"] = ids
        golden[f"s{k}.position_ids"] = pos[:, 0, :].to(torch.int64).contiguous()
        golden[f"s{k}.targets"] = targets
        golden[f"s{k}.logits"] = logits.detach().contiguous()
        golden[f"s{k}.logprobs"] = lp.detach().contiguous()
    golden["loss"] = torch.tensor([loss_total], dtype=torch.float32)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        grad = p.grad.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, hidden] in transformers' module
            base = name[: -len("gate_up_proj")]
            inter = grad.shape[1] // 2
            for e in range(grad.shape[0]):
                golden[f"grad.{base}{e}.gate_proj.weight"] = grad[e, :inter].contiguous()
                golden[f"grad.{base}{e}.up_proj.weight"] = grad[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):  # [E, hidden, I]
            base = name[: -len("down_proj")]
            for e in range(grad.shape[0]):
                golden[f"grad.{base}{e}.down_proj.weight"] = grad[e].contiguous()
        else:
            golden["grad." + name] = grad.contiguous()

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    model.save_pretrained(args.out, safe_serialization=True)
    save_file(golden, str(args.out / "golden.safetensors"), metadata={"format": "pt"})

    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    files = sorted(os.listdir(args.out))
    print(f"wrote {args.out}: {files}, {size} bytes; tokens {total}, loss {loss_total:.6f}")
    print("parameters:", ", ".join(f"{n} {tuple(p.shape)}" for n, p in model.named_parameters()))
    for k in range(len(samples)):
        print(f"s{k}: {len(samples[k])} tokens, positions t/h/w max", golden[f"s{k}.position_ids"].max(1).values.tolist())
    if size > MAX_FIXTURE_BYTES:
        raise SystemExit(f"fixture is {size} bytes, over the {MAX_FIXTURE_BYTES}-byte limit")


if __name__ == "__main__":
    main()

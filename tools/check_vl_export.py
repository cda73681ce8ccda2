#!/usr/bin/env python3
"""tools/check_vl_export.py: a Qwen3-VL directory exported by slime loads in transformers.

  check_vl_export.py --dir DIR [--tolerance 1e-4]
  check_vl_export.py --check-imports      exit 0 when torch and transformers import, else 4

DIR is written by nn::save_hf_vl (examples/qwen3_vl_rl writes <out>/hf). The
script

 1. loads DIR with Qwen3VLForConditionalGeneration (or the MoE class, from
    config.json's model_type; f32, eager attention) with output_loading_info
    and fails on any missing, unexpected or mismatched key; then checks that
    every tensor of the directory's safetensors equals the loaded parameter
    exactly (after an upcast to f32) and that every parameter is covered by a
    file tensor (lm_head.weight may be absent when the embeddings are tied);
 2. when DIR holds export_check.safetensors (tokens, pixel_values,
    image_grid_thw, and slime's per-token logprobs of the exported model, f32
    on the CPU: position t scores token t + 1, the last position target 0),
    runs transformers on the same tokens and image and compares each
    logprob within --tolerance (absolute; both sides f32, different
    reduction orders: ~1e-6 on the tiny model);
 3. prints one summary line; exits 0 when everything matches, 1 on a
    mismatch (each printed first), 4 (skipped) when torch or transformers
    cannot be imported.
"""
import argparse
import json
import pathlib
import sys


def check_imports():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from safetensors.torch import load_file  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        print(f"check_vl_export.py: skipped (cannot import torch / transformers / safetensors: {e})")
        return 4
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=pathlib.Path)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--check-imports", action="store_true")
    args = parser.parse_args()
    rc = check_imports()
    if args.check_imports or rc:
        return rc
    if args.dir is None:
        parser.error("--dir is required")

    import torch
    from safetensors.torch import load_file
    import transformers

    config = json.loads((args.dir / "config.json").read_text())
    cls = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}.get(
        config.get("model_type"))
    if cls is None:
        print(f"check_vl_export.py: {args.dir}: model_type {config.get('model_type')!r} is not Qwen3-VL")
        return 1
    model, info = getattr(transformers, cls).from_pretrained(
        args.dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    model.eval()
    errors = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            errors.append(f"from_pretrained reported {kind}: {list(info[kind])[:10]}")

    files = {}
    index = args.dir / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    for shard in shards:
        files.update(load_file(str(args.dir / shard)))
    params = dict(model.named_parameters())
    tied = bool(config.get("tie_word_embeddings", False))
    for name, t in files.items():
        p = params.get(name)
        if p is None:
            errors.append(f"file tensor {name} is no parameter of {cls}")
        elif tuple(p.shape) != tuple(t.shape) or not torch.equal(p.detach().float(), t.float()):
            errors.append(f"{name}: the loaded parameter differs from the file's tensor {tuple(t.shape)}")
    for name in params:
        if name not in files and not (tied and name == "lm_head.weight"):
            errors.append(f"parameter {name} has no tensor in the files")

    compared = 0
    worst = 0.0
    check = args.dir / "export_check.safetensors"
    if check.exists():
        c = load_file(str(check))
        ids = c["tokens"].long()[None, :]
        image_token = config["image_token_id"]
        kwargs = dict(input_ids=ids, pixel_values=c["pixel_values"].float(), image_grid_thw=c["image_grid_thw"].long(),
                      use_cache=False)
        import inspect
        if "mm_token_type_ids" in inspect.signature(model.model.forward).parameters:
            kwargs["mm_token_type_ids"] = (ids == image_token).to(torch.int32)
        with torch.no_grad():
            logits = model(**kwargs).logits[0].float()
        targets = torch.cat([ids[0, 1:], torch.zeros(1, dtype=torch.long)])
        lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        diff = (lp - c["logprobs"].float()).abs()
        worst = float(diff.max())
        compared = int(diff.numel())
        if worst > args.tolerance:
            errors.append(f"logprobs differ from transformers by up to {worst:.3g} (> {args.tolerance:g})")

    for e in errors:
        print(f"check_vl_export.py: {args.dir}: {e}")
    print(f"check_vl_export.py: {args.dir}: {cls}, {len(files)} tensors, {compared} logprobs compared "
          f"(largest difference {worst:.3g}): {'ok' if not errors else 'FAILED'}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())

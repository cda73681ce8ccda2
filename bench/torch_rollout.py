#!/usr/bin/env python3
"""Baseline of bench_rollout: transformers' generate with a static cache.

Qwen3ForCausalLM with bench_rollout's "dense" config (hidden 1024, 8 layers,
16 heads / 4 KV heads, head_dim 64, intermediate 3072, vocab 32000), random
weights, bf16; B prompts of 64 tokens, exactly 64 new tokens each (sampling,
temperature 1, no top-k / top-p, no stop), cache_implementation="static",
torch.compile off (eager). Rows "rollout/dense/decode/b<B>" with "us" = one
generate call and tokens_per_s.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util  # noqa: E402

PROMPT, NEW = 64, 64


def main():
    args = bench_util.parser(__doc__, "torch_rollout.json", warmup=1, reps=3, batch=1).parse_args()
    import torch
    import transformers

    dev = bench_util.cuda_device()
    cfg = transformers.Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                   max_position_embeddings=4096, rope_theta=1e6)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    rows = []
    for b in (1, 32, 256):
        ids = (torch.arange(b, device=dev)[:, None] * 7919 + torch.arange(PROMPT, device=dev)[None, :] * 104729) % 32000
        mask = torch.ones_like(ids)

        def run():
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                     do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     cache_implementation="static", disable_compile=True, pad_token_id=0,
                                     eos_token_id=None)
            assert out.shape[1] == PROMPT + NEW

        us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
        rows.append({"bench": f"rollout/dense/decode/b{b}", "us": us, "tokens_per_s": b * NEW / (us * 1e-6)})
        print(rows[-1], flush=True)
    bench_util.write_doc(args.out, rows, bench_util.context(args, dev, transformers=transformers.__version__))


if __name__ == "__main__":
    main()

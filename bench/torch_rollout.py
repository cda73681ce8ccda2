#!/usr/bin/env python3
"""Baseline of bench_rollout: transformers' generate with a static cache.

Qwen3ForCausalLM with bench_rollout's "dense" config (hidden 1024, 8 layers,
16 heads / 4 KV heads, head_dim 64, intermediate 3072, vocab 32000) and
Qwen3MoeForCausalLM with its "moe" config (the same with 32 experts top-4,
moe_intermediate 384), random weights, bf16; B prompts of 64 tokens, exactly 64 new tokens each (sampling,
temperature 1, no top-k / top-p, no stop), cache_implementation="static",
torch.compile off (eager). Rows "rollout/<model>/decode/b<B>" with "us" = one
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
    common = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rope_theta=1e6)
    models = {
        "dense": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=3072, **common)),
        "moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=3072, moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common)),
    }
    rows = []
    for name, make in models.items():
        torch.manual_seed(0)
        model = make().to(dev, torch.bfloat16).eval()
        for b in (1, 32, 256):
            ids = (torch.arange(b, device=dev)[:, None] * 7919
                   + torch.arange(PROMPT, device=dev)[None, :] * 104729) % 32000
            mask = torch.ones_like(ids)

            def run():
                with torch.no_grad():
                    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                                         min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                         cache_implementation="static", disable_compile=True, pad_token_id=0,
                                         eos_token_id=None)
                assert out.shape[1] == PROMPT + NEW

            try:
                us = bench_util.time_us(run, args.warmup, args.reps, args.batch)
            except Exception as e:  # report, keep the other rows
                print(f"rollout/{name}/decode/b{b}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"bench": f"rollout/{name}/decode/b{b}", "us": us, "tokens_per_s": b * NEW / (us * 1e-6)})
            print(rows[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    bench_util.write_doc(args.out, rows, bench_util.context(args, dev, transformers=transformers.__version__))


if __name__ == "__main__":
    main()

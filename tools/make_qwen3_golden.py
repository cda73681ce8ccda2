#!/usr/bin/env python3
"""tools/make_qwen3_golden.py: the golden fixture of slime's Qwen3 dense model.

Builds a tiny random transformers Qwen3ForCausalLM (float32, eager attention,
fixed seed) and writes into tests/nn/data/qwen3_tiny/ (or --out):

  config.json, model.safetensors   the Hugging Face directory (save_pretrained)
  golden.safetensors               what tests/nn/test_qwen3_golden*.cpp compare:
    tokens      i64 [T]      3 sequences of lengths 1, 7, 19, packed
    cu_seqlens  i32 [4]      0, 1, 8, 27
    targets     i64 [T]      the next token within each sequence; the last
                             position of a sequence gets a fixed random id
    logits      f32 [T, V]   each sequence run alone with batch size 1
    logprobs    f32 [T]      log_softmax(logits)[t, targets[t]]
    entropy     f32 [T]      entropy of softmax(logits[t])
    loss        f32 [1]      L = -sum_t logprobs[t] / T
    grad.<name> f32          dL/d(parameter) for every HF parameter name,
                             from torch autograd (per-sequence losses summed)

Run: /path/to/python tools/make_qwen3_golden.py  (needs torch, transformers,
safetensors). The whole fixture must stay under 2 MB; the script checks.
"""
import argparse
import inspect
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

SEED = 20240611
LENGTHS = [1, 7, 19]
MAX_FIXTURE_BYTES = 2 * 1024 * 1024


def make_config():
    kwargs = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # one of the CUDA attention kernels' head dims
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        initializer_range=0.2,  # large enough that logits are not all tiny
        hidden_act="silu",
    )
    # transformers 5 takes rope_parameters; 4.x takes rope_theta.
    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        kwargs["rope_theta"] = 10000.0
    config = Qwen3Config(**kwargs)
    config._attn_implementation = "eager"
    return config


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=root / "tests/nn/data/qwen3_tiny")
    args = parser.parse_args()

    torch.manual_seed(SEED)
    config = make_config()
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "eager"
    model.eval()  # no dropout (attention_dropout is 0 anyway)
    with torch.no_grad():
        # Norm weights start at 1; perturb them so that their gradients and
        # their product with the normalised activations are exercised.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))

    gen = torch.Generator().manual_seed(SEED + 1)
    vocab = config.vocab_size
    sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in LENGTHS]
    total = sum(LENGTHS)
    targets = []
    for s in sequences:
        t = torch.empty_like(s)
        t[:-1] = s[1:]
        t[-1] = torch.randint(0, vocab, (1,), generator=gen)
        targets.append(t)

    model.zero_grad(set_to_none=True)
    logits_all, logprobs_all, entropy_all = [], [], []
    loss_total = 0.0
    for s, t in zip(sequences, targets):
        out = model(input_ids=s[None, :], use_cache=False)
        logits = out.logits[0].float()  # [L, V]
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(1, t[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1)
        loss = -lp.sum() / total
        loss.backward()  # per-sequence losses sum into .grad
        loss_total += loss.item()
        logits_all.append(logits.detach())
        logprobs_all.append(lp.detach())
        entropy_all.append(entropy.detach())

    golden = {
        "tokens": torch.cat(sequences).to(torch.int64),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32),
        "targets": torch.cat(targets).to(torch.int64),
        "logits": torch.cat(logits_all).contiguous(),
        "logprobs": torch.cat(logprobs_all).contiguous(),
        "entropy": torch.cat(entropy_all).contiguous(),
        "loss": torch.tensor([loss_total], dtype=torch.float32),
    }
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        golden["grad." + name] = p.grad.detach().float().contiguous()

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    model.save_pretrained(args.out, safe_serialization=True)
    save_file(golden, str(args.out / "golden.safetensors"), metadata={"format": "pt"})

    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    files = sorted(os.listdir(args.out))
    print(f"wrote {args.out}: {files}, {size} bytes; T = {total}, loss = {loss_total:.6f}")
    print(f"logits: mean |z| = {golden['logits'].abs().mean():.4f}, std = {golden['logits'].std():.4f}")
    if size > MAX_FIXTURE_BYTES:
        raise SystemExit(f"fixture is {size} bytes, over the {MAX_FIXTURE_BYTES}-byte limit")


if __name__ == "__main__":
    main()

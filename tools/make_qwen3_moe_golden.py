#!/usr/bin/env python3
"""tools/make_qwen3_moe_golden.py: the golden fixture of slime's Qwen3-MoE model.

Builds a tiny random transformers Qwen3MoeForCausalLM (float32, eager
attention; 2 layers, layer 0 dense through mlp_only_layers = [0], layer 1 with
8 experts, top-2, norm_topk_prob, output_router_logits with
router_aux_loss_coef = 0.1) and writes into tests/nn/data/qwen3_moe_tiny/ (or
--out):

  config.json         the Hugging Face config (save_pretrained's)
  model.safetensors   the weights in the per-expert naming of the hub's
                      Qwen3-MoE checkpoints (Qwen/Qwen3-30B-A3B):
                        model.layers.L.mlp.gate.weight                  [E, H]
                        model.layers.L.mlp.experts.e.gate_proj.weight   [I, H]
                        model.layers.L.mlp.experts.e.up_proj.weight     [I, H]
                        model.layers.L.mlp.experts.e.down_proj.weight   [H, I]
                      (transformers 5 holds the experts fused in memory as
                      experts.gate_up_proj [E, 2I, H] = cat(gate, up) and
                      experts.down_proj [E, H, I]; this script splits them, and
                      checks that from_pretrained reads the file back to the
                      same logits)
  golden.safetensors  what tests/nn/test_qwen3_moe_golden*.cpp compare:
    tokens        i64 [T]      3 sequences of lengths 1, 7, 19, packed
    cu_seqlens    i32 [4]      0, 1, 8, 27
    targets       i64 [T]      the next token within each sequence; the last
                               position of a sequence gets a fixed random id
    logits        f32 [T, V]   each sequence run alone with batch size 1
    router_logits.L f32 [T, E] the router logits of sparse layer L, packed
    logprobs      f32 [T]      log_softmax(logits)[t, targets[t]]
    entropy       f32 [T]      entropy of softmax(logits[t])
    aux_loss      f32 [1]      load_balancing_loss_func over the router logits
                               of all T tokens (every sparse layer; the packed
                               batch as one batch without padding)
    loss          f32 [1]      L = -sum_t logprobs[t] / T + coef * aux_loss
    grad.<name>   f32          dL/d(parameter) for every name of
                               model.safetensors, from torch autograd

The routing must not sit on a tie: a bf16 model (the GPU test) sees router
logits a few 1e-2 off, and a token whose k-th and (k+1)-th expert swap would
differ by a whole expert's output. The script draws models until every token's
gap between the k-th and (k+1)-th router logit is at least MIN_TOPK_MARGIN.

Run: /path/to/python tools/make_qwen3_moe_golden.py  (needs torch,
transformers >= 5 or 4.x with Qwen3-MoE, safetensors). The whole fixture must
stay under 1.5 MB; the script checks.
"""
import argparse
import inspect
import os
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

SEED = 20240917
LENGTHS = [1, 7, 19]
AUX_COEF = 0.1
MIN_TOPK_MARGIN = 0.1
MAX_FIXTURE_BYTES = 1536 * 1024


def make_config():
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,  # the dense MLP of layer 0
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,  # as Qwen3-30B-A3B
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        output_router_logits=True,  # HF then adds coef * aux_loss to the loss
        router_aux_loss_coef=AUX_COEF,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # not a Qwen3MoeConfig field, read with getattr (as the hub configs do); CUDA attention: 64/128
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        initializer_range=0.2,  # large enough that logits are not all tiny
        hidden_act="silu",
    )
    if "rope_parameters" in inspect.signature(Qwen3MoeConfig.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        kwargs["rope_theta"] = 10000.0
    config = Qwen3MoeConfig(**kwargs)
    config._attn_implementation = "eager"
    return config


def sparse_layers(config):
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    ]


def per_expert(named, config):
    """{HF checkpoint name: tensor} from named (name, tensor) pairs of the
    in-memory model: fused experts (transformers 5) split per expert; already
    per-expert names (transformers 4) pass through."""
    out = {}
    inter = config.moe_intermediate_size
    for name, t in named:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: v.detach().float().contiguous().clone() for k, v in out.items()}


def forward_all(model, sequences):
    """Per-sequence HF forwards: logits [L, V] and router logits per sparse
    layer [L, E] of each sequence (under autograd)."""
    outs = [model(input_ids=s[None, :], use_cache=False, output_router_logits=True) for s in sequences]
    logits = [o.logits[0].float() for o in outs]
    routers = [tuple(r.reshape(-1, r.shape[-1]) for r in o.router_logits) for o in outs]
    return logits, routers


def topk_margin(routers, k):
    """Smallest gap between the k-th and (k+1)-th router logit over tokens."""
    worst = float("inf")
    for per_seq in routers:
        for r in per_seq:
            top = torch.topk(r.detach(), k + 1, dim=-1).values
            worst = min(worst, (top[:, k - 1] - top[:, k]).min().item())
    return worst


def build(config, sequences):
    for attempt in range(200):
        torch.manual_seed(SEED + 1000 * attempt)
        model = Qwen3MoeForCausalLM(config).to(torch.float32)
        model.config._attn_implementation = "eager"
        model.eval()
        with torch.no_grad():
            # Norm weights start at 1; perturb them so that their gradients
            # and their product with the normalised activations are exercised.
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
            _, routers = forward_all(model, sequences)
        margin = topk_margin(routers, config.num_experts_per_tok)
        if margin >= MIN_TOPK_MARGIN:
            return model, attempt, margin
    raise SystemExit(f"no model with a top-k router margin >= {MIN_TOPK_MARGIN} in 200 draws")


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=root / "tests/nn/data/qwen3_moe_tiny")
    args = parser.parse_args()

    config = make_config()
    layers = sparse_layers(config)
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

    model, attempt, margin = build(config, sequences)

    model.zero_grad(set_to_none=True)
    logits, routers = forward_all(model, sequences)
    logits = torch.cat(logits)  # [T, V]
    # Router logits per sparse layer over the packed batch: [T, E] each.
    packed_routers = tuple(torch.cat([r[i] for r in routers]) for i in range(len(layers)))
    logp = torch.log_softmax(logits, dim=-1)
    tgt = torch.cat(targets)
    lp = logp.gather(1, tgt[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    aux = load_balancing_loss_func(packed_routers, config.num_experts, config.num_experts_per_tok, None)
    loss = -lp.sum() / total + config.router_aux_loss_coef * aux
    loss.backward()

    weights = per_expert(model.named_parameters(), config)
    grads = per_expert(((n, p.grad) for n, p in model.named_parameters()), config)
    assert weights.keys() == grads.keys()

    golden = {
        "tokens": torch.cat(sequences).to(torch.int64),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int32),
        "targets": tgt.to(torch.int64),
        "logits": logits.detach().contiguous(),
        "logprobs": lp.detach().contiguous(),
        "entropy": entropy.detach().contiguous(),
        "aux_loss": aux.detach().reshape(1).float(),
        "loss": loss.detach().reshape(1).float(),
    }
    for layer, r in zip(layers, packed_routers):
        golden[f"router_logits.{layer}"] = r.detach().float().contiguous()
    for name, g in grads.items():
        golden["grad." + name] = g

    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    model.config.save_pretrained(args.out)
    save_file(weights, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    save_file(golden, str(args.out / "golden.safetensors"), metadata={"format": "pt"})

    # transformers reads the per-expert file back to the same model.
    again = Qwen3MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager")
    again.eval()
    with torch.no_grad():
        check = torch.cat([again(input_ids=s[None, :], use_cache=False).logits[0] for s in sequences])
    if not torch.equal(check, golden["logits"]):
        raise SystemExit(f"from_pretrained of the per-expert file differs: max {(check - logits).abs().max()}")

    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    files = sorted(os.listdir(args.out))
    print(f"wrote {args.out}: {files}, {size} bytes; T = {total}, loss = {loss.item():.6f}, aux = {aux.item():.6f}")
    print(f"model draw {attempt}, smallest top-k router logit margin {margin:.4f}, sparse layers {layers}")
    print(f"logits: mean |z| = {logits.abs().mean():.4f}, std = {logits.std():.4f}")
    if size > MAX_FIXTURE_BYTES:
        raise SystemExit(f"fixture is {size} bytes, over the {MAX_FIXTURE_BYTES}-byte limit")


if __name__ == "__main__":
    main()

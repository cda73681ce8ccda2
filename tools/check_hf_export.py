#!/usr/bin/env python3
"""tools/check_hf_export.py: an exported Hugging Face directory loads back in transformers.

  check_hf_export.py --dir DIR [--slime-logprobs BIN] [--tolerance 1e-4]
  check_hf_export.py --check-imports      exit 0 when torch and transformers import, else 4

DIR is a model directory written by slime (config.json and model.safetensors,
or sharded safetensors with model.safetensors.index.json), Qwen3 dense or
Qwen3-MoE. The script

 1. loads DIR with AutoModelForCausalLM.from_pretrained(DIR, f32, eager
    attention) and checks that from_pretrained reported no missing, unexpected
    or mismatched keys; that every tensor of the directory's safetensors files
    equals the loaded parameter exactly (after an upcast to f32: an f32 export
    must come back bit for bit); and that every parameter of the model is
    covered by a tensor of the files (none left at its random initial value;
    lm_head.weight may be absent when tie_word_embeddings is set). Experts:
    the files hold one tensor per expert (model.layers.L.mlp.experts.E.
    {gate,up,down}_proj.weight, the hub's naming); transformers 4 keeps them as
    per-expert modules with the same names, transformers 5 fuses them into
    experts.gate_up_proj [E, 2I, H] (= cat(gate, up) per expert) and
    experts.down_proj [E, H, I]; both are compared accordingly.
 2. with --slime-logprobs, scores a few deterministic token sequences (ids
    drawn from a fixed-seed generator in [0, vocab), lengths 1 to 33, within
    max_position_embeddings) with transformers (f32 CPU, one sequence per
    forward) and with `slime-logprobs --device cpu` (f32), and compares each
    token's log p(token | prefix) and each position's next-token entropy.
    Tolerance: 1e-4 absolute (--tolerance). Both sides compute in f32 with
    different reduction orders; on the tiny models the differences are ~1e-6.
 3. prints one summary line; exits 0 when everything matches, 1 on a mismatch
    (each one is printed first), 4 (skip) when torch or transformers cannot be
    imported.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

SKIP = 4
LENGTHS = [1, 2, 7, 17, 33]
SEED = 5


def import_torch():
    """(torch, transformers, safetensors.torch) or None when any is missing."""
    try:
        import safetensors.torch
        import torch
        import transformers
    except Exception as e:  # ImportError, or a broken install (OSError from a missing .so)
        print(f"check_hf_export: SKIP: cannot import torch/transformers/safetensors: {e}")
        return None
    return torch, transformers, safetensors.torch


def read_files(d, load_file):
    """{name: tensor} over the directory's safetensors files (single file or an
    index), checking that the index names exactly the tensors in its files."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = ["model.safetensors"]
    tensors = {}
    problems = []
    for f in files:
        path = d / f
        if not path.exists():
            problems.append(f"{f}: named by the index but missing")
            continue
        for name, t in load_file(str(path)).items():
            if name in tensors:
                problems.append(f"{name}: in more than one file")
            if weight_map is not None and weight_map.get(name) != f:
                problems.append(f"{name}: in {f}, but the index says {weight_map.get(name)}")
            tensors[name] = t
    if weight_map is not None:
        for name in sorted(set(weight_map) - set(tensors)):
            problems.append(f"{name}: in the index but in no file")
    return tensors, problems


def per_expert_params(model, config):
    """{checkpoint name: loaded tensor} of every model parameter and persistent
    buffer, with transformers 5's fused experts split into the per-expert
    names the files use. The tied lm_head appears under both names."""
    inter = getattr(config, "moe_intermediate_size", None)
    hidden = config.hidden_size
    out = {}
    for name, t in model.state_dict(keep_vars=False).items():
        t = t.detach()
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            if t.dim() == 3 and t.shape[1:] != (2 * inter, hidden) and t.shape[1:] == (hidden, 2 * inter):  # [E, H, 2I]
                t = t.transpose(1, 2)
            assert t.dim() == 3 and t.shape[1:] == (2 * inter, hidden), f"{name}: unexpected shape {tuple(t.shape)}"
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            if t.dim() == 3 and t.shape[1:] != (hidden, inter) and t.shape[1:] == (inter, hidden):  # [E, I, H]
                t = t.transpose(1, 2)
            assert t.dim() == 3 and t.shape[1:] == (hidden, inter), f"{name}: unexpected shape {tuple(t.shape)}"
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def check_weights(torch, transformers, load_file, d):
    """Loads d; returns (model, problems, number of tensors compared)."""
    version = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit())
    dtype_kw = "dtype" if version >= (4, 56) else "torch_dtype"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), **{dtype_kw: torch.float32}, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        keys = info.get(kind) or []
        if keys:
            problems.append(f"from_pretrained {kind}: {sorted(map(str, keys))}")

    tensors, file_problems = read_files(d, load_file)
    problems += file_problems
    params = per_expert_params(model, model.config)
    compared = 0
    for name, t in tensors.items():
        p = params.get(name)
        if p is None:
            problems.append(f"{name}: in the files but not a parameter of {type(model).__name__}")
            continue
        if tuple(p.shape) != tuple(t.shape):
            problems.append(f"{name}: file shape {tuple(t.shape)}, loaded {tuple(p.shape)}")
            continue
        compared += 1
        if not torch.equal(p.float(), t.float()):
            diff = (p.float() - t.float()).abs().max().item()
            problems.append(f"{name}: loaded parameter differs from the file (max |diff| {diff:.3g})")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name in sorted(set(params) - set(tensors)):
        if tied and name == "lm_head.weight":
            if not torch.equal(params[name], params.get("model.embed_tokens.weight")):
                problems.append("lm_head.weight: tie_word_embeddings is set but it differs from the embedding")
            continue
        problems.append(f"{name}: a model parameter no file tensor covers (left at its random initial value)")
    return model, problems, compared


def sequences(vocab, max_len, torch):
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, vocab, (min(n, max_len),), generator=gen) for n in LENGTHS]


def hf_scores(torch, model, seqs):
    """Per sequence: (logprob of tokens 1.., entropy at every position), f32."""
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(input_ids=s[None, :], use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            lp = logp[:-1].gather(1, s[1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            out.append((lp.tolist(), ent.tolist()))
    return out


def parse_slime(text):
    """slime-logprobs' stdout -> [(logprobs of tokens 1.., entropies, tokens)]."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            out.append(([], [], []))
            continue
        if not line.strip():
            continue
        index, token, logp, ent = line.split("\t")
        lp, en, tok = out[-1]
        assert int(index) == len(tok), f"unexpected line {line!r}"
        tok.append(int(token))
        en.append(float(ent))
        if logp != "-":
            lp.append(float(logp))
    return out


def check_logprobs(torch, model, binary, d, tol):
    """Returns (problems, worst logprob diff, worst entropy diff, tokens)."""
    cfg = model.config
    seqs = sequences(cfg.vocab_size, cfg.max_position_embeddings, torch)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = pathlib.Path(tmp) / "tokens.txt"
        tokens.write_text("".join(" ".join(map(str, s.tolist())) + "\n" for s in seqs))
        run = subprocess.run(
            [binary, "--model", str(d), "--tokens", str(tokens), "--device", "cpu"], capture_output=True, text=True
        )
    if run.returncode != 0:
        return [f"slime-logprobs exited {run.returncode}: {run.stderr.strip()}"], 0.0, 0.0, 0
    got = parse_slime(run.stdout)
    want = hf_scores(torch, model, seqs)
    if len(got) != len(seqs):
        return [f"slime-logprobs printed {len(got)} sequences, expected {len(seqs)}"], 0.0, 0.0, 0
    problems = []
    worst_lp = worst_ent = 0.0
    for k, (s, (glp, gent, gtok), (wlp, went)) in enumerate(zip(seqs, got, want)):
        if gtok != s.tolist() or len(glp) != len(wlp) or len(gent) != len(went):
            problems.append(f"sequence {k}: slime-logprobs echoed other tokens or counts")
            continue
        for i, (a, b) in enumerate(zip(glp, wlp)):
            worst_lp = max(worst_lp, abs(a - b))
            if not abs(a - b) <= tol:
                problems.append(f"sequence {k} token {i + 1}: logprob slime {a:.6f}, transformers {b:.6f}")
        for i, (a, b) in enumerate(zip(gent, went)):
            worst_ent = max(worst_ent, abs(a - b))
            if not abs(a - b) <= tol:
                problems.append(f"sequence {k} position {i}: entropy slime {a:.6f}, transformers {b:.6f}")
    return problems, worst_lp, worst_ent, sum(len(s) for s in seqs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=pathlib.Path, help="the exported Hugging Face directory")
    parser.add_argument("--slime-logprobs", help="the slime-logprobs binary; without it step 2 is not run")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="absolute, on logprobs and entropies")
    parser.add_argument("--check-imports", action="store_true", help="only check the imports: exit 0, or 4")
    args = parser.parse_args()

    mods = import_torch()
    if mods is None:
        return SKIP
    if args.check_imports:
        return 0
    if args.dir is None:
        parser.error("--dir is required")
    torch, transformers, st = mods
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    d = args.dir
    if not (d / "config.json").is_file():
        print(f"check_hf_export: FAIL: {d}: no config.json")
        return 1
    model_type = json.loads((d / "config.json").read_text()).get("model_type")
    try:
        model, problems, compared = check_weights(torch, transformers, st.load_file, d)
    except Exception as e:
        print(f"check_hf_export: FAIL: {d}: transformers cannot load it: {type(e).__name__}: {e}")
        return 1
    summary = f"{compared} tensors equal"
    if args.slime_logprobs:
        lp_problems, worst_lp, worst_ent, n = check_logprobs(torch, model, args.slime_logprobs, d, args.tolerance)
        problems += lp_problems
        if n:
            summary += (
                f", {n} tokens: max |logprob diff| {worst_lp:.2e}, max |entropy diff| {worst_ent:.2e}"
                f" (tolerance {args.tolerance:g})"
            )
        else:
            summary += ", logprobs not compared"
    for p in problems[:50]:
        print(f"  {p}")
    if len(problems) > 50:
        print(f"  ... and {len(problems) - 50} more")
    status = "FAIL" if problems else "OK"
    print(
        f"check_hf_export: {status}: {d} ({model_type}, {type(model).__name__}, transformers "
        f"{transformers.__version__}): {summary}" + (f"; {len(problems)} problems" if problems else "")
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

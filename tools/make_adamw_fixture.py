#!/usr/bin/env python3
"""Writes tests/optim/data/adamw_fixture.safetensors: torch.optim.AdamW
(foreach=False, fp32, CPU) run for several steps with a new gradient every
step, on a few tensors of odd sizes, so that slime's AdamW is tested against
the reference implementation. tests/optim/test_adamw.cpp reads it.

Cases (metadata "cases" = number of cases; per case c, metadata
"c{c}.{lr,beta1,beta2,eps,weight_decay,grad_scale,steps,tensors}"; lr is a
comma-separated list, one learning rate per step, set on the param group
before each step):
    c0  default betas/eps, weight_decay 0.01, a warm-up-like lr per step
    c1  weight_decay 0, betas (0.8, 0.95), eps 1e-6, grad_scale 0.37
    c2  beta1 0.3 (PyTorch's lerp takes its other branch), weight_decay 0.1
Tensors, per case c and tensor i:
    c{c}.t{i}.init              the initial parameter, shape as given
    c{c}.t{i}.grad              [steps, numel] the raw gradient of each step
    c{c}.t{i}.param             [steps, numel] the parameter after each step
    c{c}.t{i}.exp_avg           [steps, numel] ... exp_avg after each step
    c{c}.t{i}.exp_avg_sq        [steps, numel] ... exp_avg_sq after each step
grad_scale is applied as slime applies it: torch receives grad * grad_scale
(one fp32 product), slime receives grad and grad_scale.

    . /tmp/torchenv/bin/activate
    python3 tools/make_adamw_fixture.py [out_dir]   # default tests/optim/data
"""
import os
import sys

import torch
from safetensors.torch import save_file

SHAPES = [(1,), (7,), (3, 5), (33,), (2, 3, 7), (129,)]
STEPS = 6
CASES = [
    dict(lrs=[1e-3 * (s + 1) / 3 for s in range(STEPS)], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
         grad_scale=1.0),
    dict(lrs=[3e-3] * STEPS, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0, grad_scale=0.37),
    dict(lrs=[1e-2, 8e-3, 6e-3, 4e-3, 2e-3, 1e-3], beta1=0.3, beta2=0.99, eps=1e-8, weight_decay=0.1,
         grad_scale=1.0),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "optim", "data")
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(20240605)
    tensors, meta = {}, {"producer": "tools/make_adamw_fixture.py", "torch": torch.__version__,
                         "cases": str(len(CASES))}
    for c, case in enumerate(CASES):
        params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float32)) for s in SHAPES]
        for i, p in enumerate(params):
            tensors[f"c{c}.t{i}.init"] = p.detach().clone()
        opt = torch.optim.AdamW(params, lr=case["lrs"][0], betas=(case["beta1"], case["beta2"]), eps=case["eps"],
                                weight_decay=case["weight_decay"], foreach=False, fused=False)
        hist = {k: [[] for _ in params] for k in ("grad", "param", "exp_avg", "exp_avg_sq")}
        for step in range(STEPS):
            for g in opt.param_groups:
                g["lr"] = case["lrs"][step]
            for i, p in enumerate(params):
                # Gradients of varying scale per step and per tensor.
                grad = torch.randn(p.shape, dtype=torch.float32) * (0.1 + 0.5 * step) * (1 + i)
                hist["grad"][i].append(grad.flatten().clone())
                p.grad = grad * case["grad_scale"] if case["grad_scale"] != 1.0 else grad.clone()
            opt.step()
            for i, p in enumerate(params):
                st = opt.state[p]
                hist["param"][i].append(p.detach().flatten().clone())
                hist["exp_avg"][i].append(st["exp_avg"].flatten().clone())
                hist["exp_avg_sq"][i].append(st["exp_avg_sq"].flatten().clone())
        for k, per_tensor in hist.items():
            for i, rows in enumerate(per_tensor):
                tensors[f"c{c}.t{i}.{k}"] = torch.stack(rows).contiguous()
        meta.update({
            f"c{c}.lr": ",".join(repr(float(x)) for x in case["lrs"]),
            f"c{c}.beta1": repr(case["beta1"]),
            f"c{c}.beta2": repr(case["beta2"]),
            f"c{c}.eps": repr(case["eps"]),
            f"c{c}.weight_decay": repr(case["weight_decay"]),
            f"c{c}.grad_scale": repr(case["grad_scale"]),
            f"c{c}.steps": str(STEPS),
            f"c{c}.tensors": str(len(SHAPES)),
        })
    path = os.path.join(out, "adamw_fixture.safetensors")
    save_file(tensors, path, metadata=meta)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()

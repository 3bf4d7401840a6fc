"""PyTorch reference for wick's gradient clipping (crates/wick-train/tests/clip.rs).

A small MLP (6 → 8, tanh, → 3, mean squared error) whose weights, inputs and targets are
closed-form (the test builds the same values), trained a few steps with
`torch.nn.utils.clip_grad_norm_` between `backward` and `step`, for AdamW and SGD with
momentum. Writes each step's loss, the norm `clip_grad_norm_` returned, and the parameters after
the last step, to the fixture the test reads:

    python scripts/torch-reference/clip_grad_norm.py crates/wick-train/tests/fixtures/torch-clip.json

Needs torch 2.5.1 (CPU); not part of CI.
"""

import json
import math
import sys

import torch

torch.set_default_dtype(torch.float32)


def values(shape, seed, scale):
    """scale · sin(seed + 0.7·k + 0.3·k²/n) over the flat index k (the test computes the same)."""
    n = math.prod(shape)
    flat = [scale * math.sin(seed + 0.7 * k + 0.3 * k * k / n) for k in range(n)]
    return torch.tensor(flat, dtype=torch.float32).reshape(shape)


def model():
    return {
        "w1": values((8, 6), 1.0, 0.6),
        "b1": values((8,), 2.0, 0.1),
        "w2": values((3, 8), 3.0, 0.5),
        "b2": values((3,), 4.0, 0.1),
    }


def run(kind, lr, max_norm, steps):
    params = {k: v.clone().requires_grad_(True) for k, v in model().items()}
    x, target = values((5, 6), 5.0, 1.0), values((5, 3), 6.0, 2.0)
    order = ["b1", "b2", "w1", "w2"]
    plist = [params[k] for k in order]
    if kind == "adamw":
        opt = torch.optim.AdamW(plist, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(plist, lr=lr, momentum=0.9)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        h = torch.tanh(x @ params["w1"].T + params["b1"])
        y = h @ params["w2"].T + params["b2"]
        loss = ((y - target) ** 2).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(plist, max_norm)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return {
        "kind": kind,
        "lr": lr,
        "max_norm": max_norm,
        "losses": losses,
        "norms": norms,
        "params": {k: params[k].detach().flatten().tolist() for k in order},
    }


def main():
    out = {
        "torch": torch.__version__,
        "runs": [run("adamw", 0.05, 0.45, 8), run("sgd", 0.05, 0.7, 8)],
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

"""Attention alone on a GPU, wick beside PyTorch's scaled_dot_product_attention, side by side.

Each round runs wick's timings of every shape in one process (`nn-gpu-check --time-attention`:
the op's forward + backward with the loss sum(y * g), g all ones, 20 passes after 3 of warm-up)
and then PyTorch's of the same shapes, in this process, the same way; rounds alternate so a
drifting device hits both. PyTorch takes `is_causal=True` for a causal mask (its flash or
memory-efficient kernels: what a user writes), wick its additive causal bias built once. bf16
rows are timed twice on wick's side: on tensor cores (its default on sm_80+) and on its CUDA-core
kernels. Prints each shape's median milliseconds and PyTorch's time over wick's.

    python scripts/torch-reference/attention_speed.py --wick <nn-gpu-check> [--rounds 2]

Needs torch with CUDA on the GPU machine (scripts/gpu-check.sh runs it); not part of CI.
"""

import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

# (batch, heads, tokens, head dimension, mask, where users meet it)
SHAPES = [
    (8, 12, 512, 64, "causal", "decoder 12 x 768, 8 x 512 tokens"),
    (2, 12, 1024, 64, "causal", "decoder 12 x 768, 2 x 1 024 tokens"),
    (32, 12, 128, 64, "none", "BERT-base, 32 x 128 tokens"),
    (64, 12, 197, 64, "none", "ViT-B/16, 64 images"),
    (32, 12, 128, 32, "none", "MiniLM's heads (d 32), 32 x 128 tokens"),
]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def specs():
    out = []
    for b, h, s, d, mask, _ in SHAPES:
        for name in DTYPES:
            out.append(f"{b},{h},{s},{d},{mask},{name}")
            if name == "bf16":
                out.append(f"{b},{h},{s},{d},{mask},{name},cores")
    return out


def wick_round(binary):
    run = subprocess.run([binary, "--time-attention", *specs()], capture_output=True, text=True, timeout=300)
    times = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            times[row["spec"]] = row.get("ms", float("nan"))
            if "error" in row:
                print(f"wick {row['spec']}: {row['error']}")
    if run.returncode != 0:
        print(f"wick exited {run.returncode}: {run.stderr.strip()[-400:]}")
    return times


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def torch_time(b, h, s, d, causal, dtype, device, passes=20):
    gen = torch.Generator(device=device).manual_seed(70)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    g = torch.ones(b, h, s, d, device=device, dtype=dtype)

    def one():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        (y * g).sum().backward()
        q.grad = k.grad = v.grad = None

    for _ in range(3):
        one()
    sync(device)
    start = time.perf_counter()
    for _ in range(passes):
        one()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / passes


def torch_round(device, passes):
    times = {}
    for b, h, s, d, mask, _ in SHAPES:
        for name, dtype in DTYPES.items():
            times[f"{b},{h},{s},{d},{mask},{name}"] = torch_time(b, h, s, d, mask == "causal", dtype, device, passes)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True, help="the nn-gpu-check binary")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="PyTorch's device (cpu only to try the script)")
    ap.add_argument("--passes", type=int, default=20)
    args = ap.parse_args()
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU"
    print(f"torch {torch.__version__}, {name}")
    wick, ours = {}, {}
    for _ in range(args.rounds):
        for spec, ms in wick_round(args.wick).items():
            wick.setdefault(spec, []).append(ms)
        for spec, ms in torch_round(args.device, args.passes).items():
            ours.setdefault(spec, []).append(ms)
    print("| shape (B, H, S, D) | mask | dtype | wick ms | wick ms, CUDA cores | PyTorch ms | PyTorch / wick |")
    print("|---|---|---|---|---|---|---|")
    for b, h, s, d, mask, what in SHAPES:
        for name in DTYPES:
            spec = f"{b},{h},{s},{d},{mask},{name}"
            w = statistics.median(wick.get(spec, [float("nan")]))
            c = statistics.median(wick.get(spec + ",cores", [float("nan")])) if name == "bf16" else None
            t = statistics.median(ours[spec])
            cores = f"{c:.3f}" if c is not None else "–"
            print(f"| {b}, {h}, {s}, {d} ({what}) | {mask} | {name} | {w:.3f} | {cores} | {t:.3f} | {t / w:.2f}x |")


if __name__ == "__main__":
    main()

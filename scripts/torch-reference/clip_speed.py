"""What gradient clipping costs a training step, in wick and in PyTorch, side by side.

For each model, every round runs four configurations in turn — wick without and with
`--clip-grad-norm`, PyTorch without and with `clip_grad_norm_` between backward and step (the
builders and timing of `zoo_speed.py`, same shapes, batch and optimizer) — so a noisy machine's
drifts hit all four. Prints each side's median step time without and with clipping, what
clipping adds (milliseconds and per cent), PyTorch's clipped step over wick's, and wick's
optimizer phase (the norm, the coefficient and the update) without and with clipping.

    python scripts/torch-reference/clip_speed.py --wick target/release/zoo-speed \\
        [--models decoder,resnet18,bert-base] [--rounds 3] [--steps 3] [--threads 2] [--max-norm 1.0] \\
        [--image 224] [--batch 32] [--device cuda]

Needs torch 2.5.1, torchvision 0.20.1 and transformers 4.46.3 (CPU is enough); not part of CI.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from zoo_speed import torch_times, wick_run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True, help="the zoo-speed binary")
    ap.add_argument("--models", default="decoder,resnet18,bert-base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--image", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (GPU 0, for both)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = (["--image", str(args.image)] if args.image else []) + (["--batch", str(args.batch)] if args.batch else [])
    configs = json.loads(subprocess.run([args.wick, "--list"] + sizes, check=True, capture_output=True,
                                        text=True).stdout)
    where = torch.cuda.get_device_name(0) if args.device != "cpu" else f"{args.threads} threads"
    print(f"torch {torch.__version__}, {where}, max norm {args.max_norm}")
    print("| model | sizes | wick ms | wick clipped ms | wick adds | PyTorch ms | PyTorch clipped ms | PyTorch adds "
          "| PyTorch / wick, clipped | wick's update phase ms, without → with |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        spec = configs[model]
        shape = f'{spec["image"]}², batch {spec["batch"]}' if "image" in spec else \
            f'{spec["seq"]} tok, batch {spec["batch"]}'
        runs = {k: [] for k in ("w", "wc", "t", "tc")}
        update = {"w": [], "wc": []}
        for _ in range(args.rounds):
            for key, clip in (("w", None), ("wc", args.max_norm)):
                line = wick_run(args.wick, model, "train", args.steps, args.warmup, sizes, args.device, clip)
                runs[key] += line["ms"]
                # The optimizer's phase alone (norm, coefficient and update): less noisy than a step.
                update[key].append(line["forward_backward_optimizer_ms"][2])
            runs["t"] += torch_times(spec, "train", args.steps, args.warmup, args.device)[0]
            runs["tc"] += torch_times(spec, "train", args.steps, args.warmup, args.device, args.max_norm)[0]
        w, wc, t, tc = (statistics.median(runs[k]) for k in ("w", "wc", "t", "tc"))
        print(f"| {model} | {shape} | {w:.1f} | {wc:.1f} | {wc - w:+.1f} ({(wc / w - 1) * 100:+.1f} %) | {t:.1f} "
              f"| {tc:.1f} | {tc - t:+.1f} ({(tc / t - 1) * 100:+.1f} %) | {tc / wc:.2f}x "
              f"| {statistics.median(update['w']):.2f} → {statistics.median(update['wc']):.2f} |", flush=True)


if __name__ == "__main__":
    main()

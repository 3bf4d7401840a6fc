"""wick's estimator on zoo-speed's vision configurations, as JSON for
`scripts/torch-reference/zoo_speed.py --estimates` (the estimate beside the measured GPU peak).

    python3 scripts/zoo_estimates.py --wick target/release/wick --out benchmarks/zoo-estimates-cuda.json \\
        [--models resnet18,resnet50,mobilenet_v2] [--image 224] [--batches 8,32] [--on cuda]

zoo-speed's modes map onto the estimator's: `train` is an f32 step with SGD and momentum, `amp` the
same under bf16 autocast (f32 masters), `eval` f32 inference. The estimator's named models have
torchvision's 1000 classes where zoo-speed's have 10: the estimate holds the larger classifier
(ResNet-50: 2048 x 990 more weights, about 8 MB each for the parameters, gradients and momentum).
The estimator runs on the CPU (it profiles the model at small batches), so the figures are made
here, without a GPU, and committed.
"""

import argparse
import json
import os
import subprocess
import tempfile

MODES = {"train": ("sgd-momentum", "f32"), "amp": ("sgd-momentum", "amp-bf16"), "eval": ("inference", "f32")}
# zoo-speed's vision models that the estimator knows under the same name and shapes (zoo-speed's
# ViT is ViT-S/16, not a named model).
VISION = ("resnet18", "resnet50", "mobilenet_v2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True, help="the wick binary (release)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="resnet18,resnet50,mobilenet_v2")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--batches", default="32")
    ap.add_argument("--on", default="cuda")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        if model not in VISION:
            raise SystemExit(f"no estimator name for {model}; known: {', '.join(VISION)}")
        for batch in (int(b) for b in args.batches.split(",")):
            for mode, (estimate_mode, precision) in MODES.items():
                out = subprocess.run([args.wick, "estimate", model, "--image", str(args.image), "--batch",
                                      str(batch), "--mode", estimate_mode, "--precision", precision, "--on", args.on,
                                      "--json"], check=True, capture_output=True, text=True).stdout
                e = json.loads(out)["estimates"][0]
                rows.append({"model": model, "image": args.image, "batch": batch, "mode": mode, "on": args.on,
                             "bytes": e["total"], "estimate": e})
                print(f"{model} {args.image}² batch {batch} {mode}: {e['total'] / 2**20:.0f} MiB", flush=True)
    # Written whole, then renamed: a failed run leaves the old file.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.out)))
    with os.fdopen(fd, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Times two (or more) `zoo-speed` binaries against each other: each configuration runs every
binary in turn (the order reversed every other round, so neither always runs first on a machine
whose speed drifts), and the medians of all timed steps are compared.

    python3 scripts/zoo-speed-ab.py --rounds 4 OLD_BINARY NEW_BINARY \\
        --configs resnet18:amp:224:8,resnet50:amp:224:8,bert:amp

A configuration is model:mode, model:mode:image:batch for the vision models, or
model:mode::batch for the text models. Prints one line
per configuration: each binary's median milliseconds a step and first / last, then the same for
each binary's fastest step (less sensitive to a busy machine's slow steps)."""
import argparse
import json
import statistics
import subprocess

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("binaries", nargs="+")
parser.add_argument("--configs", required=True)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

configs = [c.split(":") for c in args.configs.split(",")]
times = {}
for r in range(args.rounds):
    for c in configs:
        for b in args.binaries if r % 2 == 0 else args.binaries[::-1]:
            cmd = [b, "--model", c[0], "--mode", c[1], "--steps", str(args.steps)]
            if len(c) == 4:
                cmd += (["--image", c[2]] if c[2] else []) + ["--batch", c[3]]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
            times.setdefault((":".join(c), b), []).extend(json.loads(line)["ms"])
for c in configs:
    key = ":".join(c)
    medians = [statistics.median(times[(key, b)]) for b in args.binaries]
    best = [min(times[(key, b)]) for b in args.binaries]
    cells = "  ".join(f"{m:.1f} ms" for m in medians)
    fastest = "  ".join(f"{m:.1f}" for m in best)
    print(
        f"{key}  {cells}  first/last {medians[0] / medians[-1]:.3f}"
        f"  (fastest steps {fastest} ms: {best[0] / best[-1]:.3f})",
        flush=True,
    )

#!/usr/bin/env python3
"""candle-transformers models governed by wick (`byo-model`) against the same models alone
(`byo-model-alone`), in turn (the order reversed every other round), medians over the rounds.

    python3 scripts/byo-model-ab.py --bin target/release --rounds 5 \\
        --configs minilm:DIR:8:128,bert-base:DIR:1:128,llama:DIR:1:128 [--history]

A configuration is model:folder:batch:seq. Prints a Markdown table: each program's median
forward milliseconds, load milliseconds and peak resident set, and governed / alone."""
import argparse
import json
import os
import statistics
import subprocess

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--bin", required=True)
parser.add_argument("--configs", required=True)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--history", action="store_true", help="the governed run records its history")
args = parser.parse_args()

programs = [os.path.join(args.bin, "byo-model"), os.path.join(args.bin, "byo-model-alone")]
runs = {}
for r in range(args.rounds):
    for c in args.configs.split(","):
        model, folder, batch, seq = c.split(":")
        for p in programs if r % 2 == 0 else programs[::-1]:
            cmd = [p, "--model", model, "--dir", folder, "--batch", batch, "--seq", seq, "--steps", str(args.steps)]
            if args.history and p.endswith("byo-model"):
                cmd.append("--history")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs.setdefault((c, p), []).append(json.loads(out.stdout.strip().splitlines()[-1]))

print("| model | batch × seq | forward governed | alone | ratio | load governed | alone | peak RSS governed | alone |")
print("|---|---|---|---|---|---|---|---|---|")
for c in args.configs.split(","):
    model, _, batch, seq = c.split(":")
    med = {k: [statistics.median(r[k] for r in runs[(c, p)]) for p in programs] for k in ("step_ms", "load_ms", "peak_rss_mib")}
    s, l, m = med["step_ms"], med["load_ms"], med["peak_rss_mib"]
    print(f"| {model} | {batch} × {seq} | {s[0]:.1f} ms | {s[1]:.1f} ms | {s[0] / s[1]:.3f} | {l[0]:.0f} ms | {l[1]:.0f} ms "
          f"| {m[0]:.0f} MiB | {m[1]:.0f} MiB |", flush=True)

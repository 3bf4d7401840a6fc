"""Cross-entropy over a vocabulary, the op alone, wick beside PyTorch in turn.

For each case (rows x vocabulary, f32 or bf16 logits), each round runs wick's bench binary for
the case (a fresh process: `cargo bench -p wick-nn --bench cross_entropy -- CASE`) and then
PyTorch's `torch.nn.functional.cross_entropy` on logits of the same shape in this process: the
loss alone, and the loss with the logits' gradient (`backward`, the gradient freed each call).
bf16 logits run under `torch.autocast("cpu", torch.bfloat16)`, as a model under autocast hands
them over (autocast computes the loss in f32). Each side's figure is the median over rounds of
its median of 7 calls after 2 untimed; the ratio is PyTorch's time over wick's.

    python scripts/torch-reference/cross_entropy.py --wick target/release/deps/cross_entropy-HASH \\
        [--cases 128x32000:f32,2048x32000:bf16] [--rounds 3] [--threads 2]

Needs torch 2.5.1 (CPU); not part of CI.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch

DEFAULT = ("128x32000:f32,2048x32000:f32,8192x32000:f32,2048x50257:f32,2048x128256:f32,"
           "128x32000:bf16,2048x32000:bf16,8192x32000:bf16,2048x128256:bf16")


def median_ms(f):
    for _ in range(2):
        f()
    t = []
    for _ in range(7):
        s = time.perf_counter()
        f()
        t.append((time.perf_counter() - s) * 1e3)
    return statistics.median(t)


def torch_case(rows, vocab, dtype):
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(rows, vocab, generator=g) * 2.0).to(dtype).requires_grad_(True)
    targets = torch.tensor([(i * 7919) % vocab for i in range(rows)])
    ctx = (lambda: torch.autocast("cpu", torch.bfloat16)) if dtype == torch.bfloat16 else None

    def loss():
        if ctx is None:
            return torch.nn.functional.cross_entropy(logits, targets)
        with ctx():
            return torch.nn.functional.cross_entropy(logits, targets)

    def forward():
        with torch.no_grad():
            loss()

    def step():
        logits.grad = None
        loss().backward()

    return median_ms(forward), median_ms(step)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True)
    ap.add_argument("--cases", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads, {a.rounds} rounds")
    print("| rows × vocabulary | logits | wick loss ms | PyTorch loss ms | ratio | wick loss + grad ms "
          "| PyTorch loss + grad ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    env = {"RAYON_NUM_THREADS": str(a.threads), "OMP_NUM_THREADS": str(a.threads)}
    for case in a.cases.split(","):
        shape, dt = case.split(":")
        rows, vocab = (int(v) for v in shape.split("x"))
        dtype = torch.float32 if dt == "f32" else torch.bfloat16
        w, t = [], []
        for _ in range(a.rounds):
            out = subprocess.run([a.wick, case], capture_output=True, text=True, check=True,
                                 env={**os.environ, **env})
            line = json.loads(out.stdout.strip().splitlines()[-1])
            w.append((line["forward_ms"], line["forward_backward_ms"]))
            t.append(torch_case(rows, vocab, dtype))
        wf, wb = (statistics.median(x[i] for x in w) for i in (0, 1))
        tf, tb = (statistics.median(x[i] for x in t) for i in (0, 1))
        print(f"| {rows} × {vocab} | {dt} | {wf:.1f} | {tf:.1f} | {tf / wf:.2f}x | {wb:.1f} | {tb:.1f} "
              f"| {tb / wb:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

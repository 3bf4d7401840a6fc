"""PyTorch's f32 products at the shapes of `cargo bench -p wick-kernels --bench f32_products`
(`y = x @ W.T`, as `torch.nn.functional.linear` without a bias), G multiply-adds a second, the
fastest of three batches of about 2·10⁹ multiply-adds; the weights read from memory, as in a model.

    python scripts/torch-reference/f32_products.py [--threads 2] [--rows 128,197,256,1024]
"""

import argparse
import time

import torch
import torch.nn.functional as F

LAYERS = [
    ("BERT-base", "qkv", 768, 2304), ("BERT-base", "out", 768, 768), ("BERT-base", "fc1", 768, 3072),
    ("BERT-base", "fc2", 3072, 768), ("MiniLM", "qkv", 384, 1152), ("MiniLM", "out", 384, 384),
    ("MiniLM", "fc1", 384, 1536), ("MiniLM", "fc2", 1536, 384), ("decoder-512", "qkv", 512, 1536),
    ("decoder-512", "out", 512, 512), ("decoder-512", "gate+up", 512, 2816), ("decoder-512", "down", 1408, 512),
    ("decoder-512", "head", 512, 32000),
]


def rate(macs, f):
    reps = max(3, int(2e9 / macs))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t) / reps)
    return macs / best / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="128,197,256,1024")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    print("| model | layer | m × k × n | G multiply-adds/s |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for m in map(int, args.rows.split(",")):
            for model, layer, k, n in LAYERS:
                # Weights read from memory, as the bench's: copies past 96 MiB, taken in turn.
                copies = max(1, (96 << 20) // (n * k * 4))
                x, ws = torch.rand(m, k) - 0.5, [torch.rand(n, k) - 0.5 for _ in range(copies)]
                turn = [0]

                def product():
                    turn[0] += 1
                    return F.linear(x, ws[turn[0] % copies])

                r = rate(m * k * n, product)
                print(f"| {model} | {layer} | {m} × {k} × {n} | {r:.1f} |")


if __name__ == "__main__":
    main()

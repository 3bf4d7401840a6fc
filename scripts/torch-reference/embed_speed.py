"""Sentences a second of all-MiniLM-L6-v2 embeddings, wick beside PyTorch on the same CPU, and
how far apart their embeddings are.

wick: `embed-speed` (examples/src/bin/embed_speed.rs; `SentenceEmbedder::embed`). PyTorch: the
same computation as sentence-transformers (tokenised with the model's tokenizer, truncated at
`max_seq_length`, padded to the batch's longest; BertModel under `torch.inference_mode()`; mean
pooling under the mask; L2 normalisation), on the same sentences. They take turns, round by
round; each side's figure is the median of its batches' times.

    python scripts/torch-reference/embed_speed.py --wick target/release/embed-speed \\
        --model DIR [--batches-of 1,32] [--rounds 3] [--batches 8] [--threads 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
from transformers import AutoTokenizer, BertModel

WORDS = ["memory", "the", "model", "runs", "on", "a", "small", "machine", "and", "every", "batch", "fits", "in",
         "its", "budget", "today"]


def sentence(i):
    """Sentence i, as embed_speed.rs's `sentence`."""
    n = 6 + (i * 7) % 35
    return " ".join(WORDS[(i * 3 + j * 5) % len(WORDS)] for j in range(n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches-of", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_len = json.load(open(os.path.join(args.model, "sentence_bert_config.json")))["max_seq_length"]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = BertModel.from_pretrained(args.model).eval()

    def embed(texts):
        enc = tok(texts, truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)

    print(f"torch {torch.__version__}, {args.threads} threads")
    print("| batch | wick sentences/s | PyTorch sentences/s | ratio (wick / PyTorch) | largest difference |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batches_of.split(",")):
        w, t, worst = [], [], 0.0
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "e.json")
                line = subprocess.run([args.wick, "--model", args.model, "--batch", str(batch), "--batches",
                                       str(args.batches), "--warmup", str(args.warmup), "--embeddings", out],
                                      check=True, capture_output=True, text=True).stdout
                w += json.loads(line.strip().splitlines()[-1])["ms"]
                theirs = torch.tensor(json.load(open(out)))
            with torch.inference_mode():
                mine = embed([sentence(i) for i in range(batch)])
                worst = max(worst, (mine - theirs).abs().max().item())
                for b in range(args.warmup + args.batches):
                    texts = [sentence(b * batch + i) for i in range(batch)]
                    start = time.perf_counter()
                    embed(texts).tolist()
                    if b >= args.warmup:
                        t.append((time.perf_counter() - start) * 1e3)
        ws, ts = batch / statistics.median(w) * 1e3, batch / statistics.median(t) * 1e3
        print(f"| {batch} | {ws:.1f} | {ts:.1f} | {ws / ts:.2f}x | {worst:.1e} |", flush=True)


if __name__ == "__main__":
    main()

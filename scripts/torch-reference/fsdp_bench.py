"""Sharded data-parallel training: wick's ZeRO stages against PyTorch DDP and FSDP, side by side.

For each model, in turns (rounds), 2 processes x 1 thread at one global batch:

    wick ZeRO-0 (replicated)        PyTorch DDP (gloo, bucket_cap_mb=25)
    wick ZeRO-3                     PyTorch FSDP FULL_SHARD (gloo, one unit per decoder layer)
                                    PyTorch FSDP FULL_SHARD + activation checkpointing per layer
                                    (wick's stage 3 always recomputes its blocks)

wick runs `dist_bench` (built with `--features mpi`) under mpirun, PyTorch under torchrun. The
figure per configuration is the median step over every timed step of every round (rank 0's
clock, after a barrier); memory is each rank's resident peak (`ru_maxrss`, the same reading for
both; wick's caching-heap peak beside it).

    python scripts/torch-reference/fsdp_bench.py --wick target/release/examples/dist_bench \\
        [--models decoder-512,decoder-1024] [--batch 8] [--rounds 2] [--steps 3] [--warmup 2]

Needs torch 2.5.1 and transformers 4.46.3 (a venv) and Open MPI's mpirun; not part of CI.
"""

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_bench import run  # noqa: E402  (the command runner with its hang timeout and retry)


def config(model):
    """dist_bench's decoder-512 / decoder-1024: 8 layers over a 32 000-token vocabulary."""
    h = {"decoder-512": 512, "decoder-1024": 1024}[model]
    return dict(vocab_size=32000, hidden_size=h, num_hidden_layers=8, num_attention_heads=h // 64,
                intermediate_size=h * 11 // 4, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)


def torch_worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config(args.model)))
    model.train()
    if args.mode == "fsdp-ckpt":
        # transformers' own per-layer checkpointing (torch's checkpoint_wrapper applied to the
        # FSDP units fails here: the recomputed rotary tensors' metadata differ).
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        net = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=policy,
                   device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch.manual_seed(1 + rank)
    ids = torch.randint(0, 32000, (args.batch // world, 65))
    ms = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = net(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if i >= args.warmup:
            ms.append((time.perf_counter() - start) * 1e3)
    peaks = [None] * world
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print(json.dumps({"ms": ms, "peak_rss_mib": peaks}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick")
    ap.add_argument("--models", default="decoder-512,decoder-1024")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--torch-worker", action="store_true")
    ap.add_argument("--model", default="decoder-512")
    ap.add_argument("--mode", default="ddp")
    args = ap.parse_args()
    if args.torch_worker:
        return torch_worker(args)
    me = os.path.abspath(__file__)
    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    mpirun = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", "-x", "RAYON_NUM_THREADS"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", me]
    configs = [("wick ZeRO-0", "wick", ["--zero", "0"]), ("PyTorch DDP", "torch", "ddp"),
               ("wick ZeRO-3", "wick", ["--zero", "3"]), ("PyTorch FSDP", "torch", "fsdp"),
               ("PyTorch FSDP + checkpointing", "torch", "fsdp-ckpt")]
    print(f"# {args.batch} global, 2 processes x 1 thread, rounds {args.rounds}, steps {args.steps} "
          f"(+{args.warmup} warm-up)", flush=True)
    table = []
    for model in args.models.split(","):
        figures = {name: {"ms": [], "rss": [], "heap": []} for name, _, _ in configs}
        for _ in range(args.rounds):
            for name, who, how in configs:
                if who == "wick":
                    r = run(mpirun + [args.wick, "train", "--model", model] + common + how, env, timeout=300)
                    figures[name]["heap"].append(max(r["heap_peak_mib"]))
                else:
                    r = run(torchrun + ["--torch-worker", "--model", model, "--mode", how] + common, env, timeout=300)
                print(json.dumps({"model": model, "config": name, **r}), flush=True)
                figures[name]["ms"] += r["ms"]
                figures[name]["rss"].append(max(r["peak_rss_mib"]))
        for name, _, _ in configs:
            f = figures[name]
            table.append((model, name, statistics.median(f["ms"]), max(f["rss"]), max(f["heap"]) if f["heap"] else None))
    print()
    print("| model | configuration | step (ms) | samples/s | resident peak per rank (MiB) | wick heap peak per rank (MiB) |")
    print("|---|---|---|---|---|---|")
    for model, name, ms, rss, heap in table:
        heap = f"{heap:.0f}" if heap is not None else "—"
        print(f"| {model} | {name} | {ms:.0f} | {args.batch / ms * 1e3:.2f} | {rss:.0f} | {heap} |")


if __name__ == "__main__":
    main()

"""Sharded data-parallel training: wick's ZeRO stages against PyTorch DDP and FSDP, side by side.

For each model (the decoders of 58 M and 168 M parameters; MiniLM-L6 and BERT-base at 128 tokens,
ViT-S/16, ResNet-18 and MobileNetV2 at 224²), in turns (rounds), 2 processes x 1 thread at one
global batch:

    wick ZeRO-0 (replicated)        PyTorch DDP (gloo, bucket_cap_mb=25)
    wick ZeRO-3 (blocks recomputed) PyTorch FSDP FULL_SHARD + activation checkpointing per block
    wick ZeRO-3, no recompute       PyTorch FSDP FULL_SHARD (gloo, one unit per block: decoder or
                                    encoder layer, residual block, inverted residual — wick's blocks)

wick runs `dist_bench` (built with `--features mpi`) under mpirun, PyTorch under torchrun. The
figure per configuration is the median step over every timed step of every round (rank 0's
clock, after a barrier); memory is each rank's resident peak (`ru_maxrss`, the same reading for
both; wick's caching-heap peak beside it).

    python scripts/torch-reference/fsdp_bench.py --wick target/release/examples/dist_bench \\
        [--models decoder-512,decoder-1024,minilm,bert-base,vit,resnet18,mobilenet_v2] [--batch 8]
        [--rounds 2] [--steps 3] [--warmup 2] [--configs zero0,ddp,zero3,zero3-kept,fsdp,fsdp-ckpt]

Needs torch 2.5.1, torchvision 0.20.1 and transformers 4.46.3 (a venv) and Open MPI's mpirun;
not part of CI.
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


def bert_config(model):
    """dist_bench's MiniLM-L6 and BERT-base shapes (30 522 tokens, 128 per sentence)."""
    h, layers, mlp = {"minilm": (384, 6, 1536), "bert-base": (768, 12, 3072)}[model]
    return {"vocab_size": 30522, "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": 12,
            "intermediate_size": mlp, "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12}


def build(model, per_rank):
    """The model (as zoo_speed.py builds each zoo family), the block class FSDP wraps one unit
    around (wick's stage-3 blocks), its inputs at `per_rank` and its training loss of the wrapped
    network, and whether the optimizer is AdamW (SGD with momentum for the CNNs, as dist_bench)."""
    import torch
    import torch.nn.functional as F
    import transformers
    import zoo_speed
    if model.startswith("decoder-"):
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config(model)))
        ids = torch.randint(0, 32000, (per_rank, 65))

        def loss(n):
            logits = n(input_ids=ids[:, :-1]).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

        return net, LlamaDecoderLayer, loss, True
    if model in ("minilm", "bert-base"):
        from transformers.models.bert.modeling_bert import BertLayer
        net, _, _ = zoo_speed.build({"kind": "bert", "config": bert_config(model), "batch": per_rank, "seq": 128},
                                    "cpu")
        ids = torch.randint(1, 30522, (per_rank, 128))
        mask = torch.ones_like(ids)
        head = torch.randn(net.config.hidden_size, 2) * 0.5
        labels = torch.arange(per_rank) % 2

        def loss(n):
            hidden = n(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            return F.cross_entropy(((hidden * m).sum(1) / m.sum(1)) @ head, labels)

        return net, BertLayer, loss, True
    spec = {"batch": per_rank, "image": 224, "classes": 10}
    if model == "vit":
        from torchvision.models.vision_transformer import EncoderBlock as block
        spec.update(kind="vit", config={"image_size": 224, "patch_size": 16, "layers": 12, "heads": 6,
                                        "hidden": 384, "mlp_dim": 1536, "num_classes": 10})
    elif model == "resnet18":
        from torchvision.models.resnet import BasicBlock as block
        spec.update(kind="resnet", depth=18, width=64)
    elif model == "mobilenet_v2":
        from torchvision.models.mobilenetv2 import InvertedResidual as block
        spec.update(kind="mobilenet_v2", width_mult=1.0)
    else:
        raise SystemExit(f"unknown model {model}")
    net, _, _ = zoo_speed.build(spec, "cpu")
    x, y = torch.randn(per_rank, 3, 224, 224), torch.arange(per_rank) % 10
    return net, block, (lambda n: F.cross_entropy(n(x), y)), model == "vit"


def torch_worker(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model, block, loss_of, adamw = build(args.model, args.batch // world)
    model.train()
    hf = hasattr(model, "gradient_checkpointing_enable")
    if args.mode == "fsdp-ckpt" and hf:
        # transformers' own per-layer checkpointing (torch's checkpoint_wrapper applied to the
        # FSDP units fails for the decoder: the recomputed rotary tensors' metadata differ).
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        net = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=ModuleWrapPolicy({block}),
                   device_id=torch.device("cpu"))
        if args.mode == "fsdp-ckpt" and not hf:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
            wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            apply_activation_checkpointing(net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, block))
    if adamw:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1 + rank)
    ms = []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(net).backward()
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
    ap.add_argument("--configs", default="zero0,ddp,zero3,zero3-kept,fsdp,fsdp-ckpt")
    args = ap.parse_args()
    if args.torch_worker:
        return torch_worker(args)
    me = os.path.abspath(__file__)
    common = ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    mpirun = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", "-x", "RAYON_NUM_THREADS"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", me]
    every = {"zero0": ("wick ZeRO-0", "wick", ["--zero", "0"]), "ddp": ("PyTorch DDP", "torch", "ddp"),
             "zero3": ("wick ZeRO-3", "wick", ["--zero", "3"]),
             "zero3-kept": ("wick ZeRO-3, no recompute", "wick", ["--zero", "3", "--no-recompute"]),
             "fsdp": ("PyTorch FSDP", "torch", "fsdp"),
             "fsdp-ckpt": ("PyTorch FSDP + checkpointing", "torch", "fsdp-ckpt")}
    configs = [every[c] for c in args.configs.split(",")]
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

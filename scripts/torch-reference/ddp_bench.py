"""Data-parallel training speed: wick against PyTorch DDP (gloo), side by side on this machine.

For each model, in turns (rounds), times a training step at one global batch run three ways,
by wick (`dist_bench`, built with `--features mpi`) and by PyTorch 2.5.1:

    1 process x 1 thread      the whole batch
    1 process x 2 threads     the whole batch
    2 processes x 1 thread    half the batch each: wick under `mpirun`, PyTorch DDP over gloo
                              (`torchrun --standalone`, `DistributedDataParallel(bucket_cap_mb=25)`)

The figure per configuration is the median step over every timed step of every round (rank 0's
clock, after a barrier); throughput is the global batch over it. Also the all-reduce of 1/4/25/100 MB
of f32: wick's gradient buckets and one plain MPI all-reduce (from `dist_bench allreduce`), and
`torch.distributed.all_reduce` over gloo.

    python scripts/torch-reference/ddp_bench.py --wick target/release/examples/dist_bench \\
        [--models decoder,resnet18] [--batch 8] [--image 224] [--rounds 3] [--steps 4] [--warmup 2]

Needs torch 2.5.1, torchvision 0.20.1, transformers 4.46.3 and Open MPI's mpirun; not part of CI.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def spec(model, batch, image):
    if model == "decoder":
        return {"kind": "llama", "batch": batch, "seq": 64, "optimizer": "adamw",
                "config": {"vocab_size": 64, "hidden_size": 128, "num_layers": 4, "num_heads": 4,
                           "intermediate_size": 256, "max_seq": 64, "rms_eps": 1e-6, "rope_theta": 10000.0}}
    return {"kind": "resnet", "depth": 18, "classes": 10, "width": 64, "image": image, "batch": batch,
            "optimizer": "sgd"}


def torch_worker(args):
    """One PyTorch process: alone, or one DDP rank under torchrun."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    import zoo_speed
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    s = spec(args.model, args.batch // world, args.image)
    model, _, _ = zoo_speed.build(s, "cpu")
    model.train()
    net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25) if world > 1 else model
    torch.manual_seed(1 + rank)
    if s["kind"] == "llama":
        ids = torch.randint(0, 64, (s["batch"], s["seq"] + 1))

        def loss_fn():
            logits = net(input_ids=ids[:, :-1]).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    else:
        x = torch.randn(s["batch"], 3, s["image"], s["image"])
        y = torch.arange(s["batch"]) % s["classes"]

        def loss_fn():
            return F.cross_entropy(net(x), y)
    opt = zoo_speed.optimizer(s, net.parameters())
    ms = []
    for i in range(args.warmup + args.steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        t = (time.perf_counter() - start) * 1e3
        if i >= args.warmup:
            ms.append(t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if world > 1:
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        dist.destroy_process_group()
    else:
        peaks = [peak]
    if rank == 0:
        print(json.dumps({"ms": ms, "peak_rss_mib": peaks}), flush=True)


def torch_allreduce(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for mb in (1, 4, 25, 100):
        t = torch.ones(mb * (1 << 20) // 4)
        times = []
        for _ in range(args.reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        rows.append({"mb": mb, "gloo_s": statistics.median(times)})
    if dist.get_rank() == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def run(cmd, env, timeout=900):
    """The command's JSON line; a run that hangs (seen once with gloo: one DDP worker gone, the
    other waiting in a collective) is killed after `timeout` seconds and tried once more."""
    full = dict(os.environ, **ROOT_ENV, **env)
    for attempt in range(2):
        try:
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=full, timeout=timeout)
            return last_json(out.stdout)
        except subprocess.TimeoutExpired:
            print(f"(timed out after {timeout} s, attempt {attempt + 1}: {' '.join(cmd[:6])} ...)", flush=True)
    raise SystemExit("the command hung twice")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick")
    ap.add_argument("--models", default="decoder,resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--torch-worker", action="store_true")
    ap.add_argument("--torch-allreduce", action="store_true")
    ap.add_argument("--model", default="decoder")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.torch_worker:
        return torch_worker(args)
    if args.torch_allreduce:
        return torch_allreduce(args)
    py = sys.executable
    me = os.path.abspath(__file__)
    common = ["--batch", str(args.batch), "--image", str(args.image), "--steps", str(args.steps),
              "--warmup", str(args.warmup)]
    mpirun = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", "-x", "RAYON_NUM_THREADS=1"]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    layouts = [("1x1", 1), ("1x2", 2), ("2x1", 1)]
    print("| model | layout | wick ms/step | PyTorch ms/step | wick samples/s | PyTorch samples/s | "
          "ratio (wick / PyTorch throughput) | wick comm share | peak RSS per rank, wick / PyTorch (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    raw = {}
    for model in args.models.split(","):
        figures = {k: {"wick": [], "torch": [], "comm": [], "wpeak": [], "tpeak": []} for k, _ in layouts}
        for _ in range(args.rounds):
            for layout, threads in layouts:
                wcmd = [args.wick, "train", "--model", model] + common
                tcmd = ["--torch-worker", "--model", model, "--threads", str(threads)] + common
                env = {"RAYON_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
                if layout == "2x1":
                    w = run(mpirun + wcmd, env)
                    t = run(torchrun + [me] + tcmd, env)
                else:
                    w = run(wcmd, env)
                    t = run([py, me] + tcmd, env)
                f = figures[layout]
                f["wick"] += w["ms"]
                f["comm"] += w["comm_ms"]
                f["torch"] += t["ms"]
                f["wpeak"].append(max(w["peak_rss_mib"]))
                f["tpeak"].append(max(t["peak_rss_mib"]))
        raw[model] = figures
        for layout, _ in layouts:
            f = figures[layout]
            wm, tm = statistics.median(f["wick"]), statistics.median(f["torch"])
            share = statistics.median(f["comm"]) / wm
            print(f"| {model} | {layout} | {wm:.1f} | {tm:.1f} | {args.batch / wm * 1e3:.1f} | "
                  f"{args.batch / tm * 1e3:.1f} | {tm / wm:.2f}x | {share:.1%} | "
                  f"{max(f['wpeak']):.0f} / {max(f['tpeak']):.0f} |", flush=True)
    w = run(mpirun + [args.wick, "allreduce", "--reps", str(args.reps)], {})
    t = run(torchrun + [me, "--torch-allreduce", "--reps", str(args.reps)], {"OMP_NUM_THREADS": "1"})
    print()
    print("| MB | raw MPI all-reduce ms | wick buckets ms | wick / raw (bandwidth) | PyTorch gloo ms |")
    print("|---|---|---|---|---|")
    for a, b in zip(w["allreduce"], t):
        print(f"| {a['mb']} | {a['raw_s'] * 1e3:.2f} | {a['bucketed_s'] * 1e3:.2f} | "
              f"{a['raw_s'] / a['bucketed_s']:.2f}x | {b['gloo_s'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()

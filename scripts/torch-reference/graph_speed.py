"""Training steps as CUDA graphs: wick's captured step beside its eager fused step, PyTorch eager and
`torch.compile(mode="reduce-overhead")`, on the same GPU in one run (issue 47's table).

For each model of `zoo-speed --list` named in `--models` and each mode (train: f32; amp:
bf16 autocast with f32 masters in wick, f32 parameters in PyTorch; eval: the forward pass, wick's
through `wick::cuda_graph::GraphForward`, PyTorch's under `inference_mode`), in turn for `--rounds`
rounds:

- wick eager: `zoo-speed --cuda-graph --graph-eager` (the fused device step, never captured);
- wick graph: `zoo-speed --cuda-graph` (captured after the warm-up, replayed at every timed step);
- PyTorch eager: zoo_speed.py's step (AdamW's default CUDA implementation, `zero_grad(set_to_none)`);
- PyTorch reduce-overhead: the same with the model `torch.compile(mode="reduce-overhead")` (CUDA
  graphs through CUDAGraph Trees), its compile and re-captures in the warm-up; where it fails on
  the machine the row says why.

Each side's figure is the median step time over its timed steps and rounds; wick's lines also give
the host's milliseconds to issue a step (`host_ms`: what a graph saves). The ratios are PyTorch's
time over wick's graphed step (above 1: wick is faster).

    python scripts/torch-reference/graph_speed.py --wick .devbuild/zoo-speed --models bert,decoder,vit \\
        [--modes train,amp] [--rounds 2] [--steps 10] [--warmup 3] [--batches 16] [--seqs 128]

Needs a CUDA GPU, torch and zoo_speed.py beside it; not part of CI.
"""

import argparse
import json
import statistics
import subprocess

import torch

import zoo_speed


def wick_line(binary, model, mode, steps, warmup, sizes, eager):
    """zoo-speed's JSON line for the graphed (or, with `eager`, the eager fused) step."""
    extra = ["--graph-eager"] if eager else []
    out = subprocess.run([binary, "--model", model, "--mode", mode, "--steps", str(steps), "--warmup", str(warmup),
                          "--device", "cuda", "--cuda-graph"] + extra + sizes,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def torch_compiled_times(spec, mode, steps, warmup):
    """Milliseconds of each timed step with the model under torch.compile(mode="reduce-overhead")
    (zoo_speed.torch_times with `compile_mode`), or the reason it did not run."""
    try:
        times, _ = zoo_speed.torch_times(spec, mode, steps, warmup, "cuda", compile_mode="reduce-overhead")
        return times, None
    # The compiler's failure (or a loss that is not finite) is a row's result, not the run's end.
    except (Exception, SystemExit) as e:
        return [], f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True, help="zoo-speed built with --features cuda")
    ap.add_argument("--models", default="bert,decoder,vit")
    ap.add_argument("--modes", default="train,amp")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batches", default=None, help="inputs per batch (zoo-speed's --batch)")
    ap.add_argument("--seqs", default=None, help="tokens per sequence (zoo-speed's --seq)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_speed.py needs a CUDA GPU")
    sizes = (["--batch", args.batches] if args.batches else []) + (["--seq", args.seqs] if args.seqs else [])
    configs = json.loads(subprocess.run([args.wick, "--list"] + sizes, check=True, capture_output=True,
                                        text=True).stdout)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| model | batch | mode | wick eager ms (host) | wick graph ms (host) | PyTorch eager ms "
          "| PyTorch reduce-overhead ms | graph vs wick eager | PyTorch eager / wick graph "
          "| reduce-overhead / wick graph |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    raw = []
    for model in args.models.split(","):
        spec = configs[model]
        for mode in args.modes.split(","):
            we, weh, wg, wgh, te, tc, why, refused = [], [], [], [], [], [], None, None
            for _ in range(args.rounds):
                try:
                    eager = wick_line(args.wick, model, mode, args.steps, args.warmup, sizes, True)
                    graph = wick_line(args.wick, model, mode, args.steps, args.warmup, sizes, False)
                except subprocess.CalledProcessError as e:
                    lines = (e.stderr or "").strip().splitlines()
                    why = next((l for l in lines if l.startswith("Error")), lines[-1] if lines else "no output")
                    break
                we += eager["ms"]
                weh += eager["host_ms"]
                wg += graph["ms"]
                wgh += graph["host_ms"]
                refused = graph.get("refused")
                times, _ = zoo_speed.torch_times(spec, mode, args.steps, args.warmup, "cuda")
                te += times
                if not args.no_compile:
                    times, reason = torch_compiled_times(spec, mode, args.steps, args.warmup)
                    tc += times
                    why = why or reason
            if not wg:
                print(f"| {model} | {spec['batch']} | {mode} | FAILED: {(why or '')[:300]} |", flush=True)
                continue
            m = statistics.median
            compiled = f"{m(tc):.2f}" if tc else f"did not run ({why})"
            text = (f"| {model} | {spec['batch']} | {mode} | {m(we):.2f} ({m(weh):.2f}) | {m(wg):.2f} ({m(wgh):.2f})"
                    f"{' REFUSED: ' + refused if refused else ''} | {m(te):.2f} | {compiled} | {m(we) / m(wg):.2f}x "
                    f"| {m(te) / m(wg):.2f}x | {(m(tc) / m(wg)) if tc else float('nan'):.2f}x |")
            print(text, flush=True)
            raw.append({"model": model, "mode": mode, "wick_eager": we, "wick_eager_host": weh, "wick_graph": wg,
                        "wick_graph_host": wgh, "torch_eager": te, "torch_reduce_overhead": tc, "refused": refused,
                        "compile_failure": why})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()

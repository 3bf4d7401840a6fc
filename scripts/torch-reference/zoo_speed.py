"""Step time of wick's zoo next to PyTorch's, side by side on the same machine.

For every configuration that `zoo-speed --list` prints (the same model shapes, batch, inputs'
sizes and optimizer), times an f32 training step (forward, backward, optimizer step), an AMP
training step (`torch.autocast("cpu", torch.bfloat16)` with f32 parameters in PyTorch; a bf16
model with f32 masters in wick) and an eval forward pass (`model.eval()`, `torch.inference_mode()`
in PyTorch). wick and PyTorch take turns: each round runs the wick binary for the configuration
(a fresh process; its warm-up steps are not timed) and then PyTorch in this process, so slow
drifts of a noisy machine hit both. The figure per side is the median over every timed step of
every round; the ratio is PyTorch's time over wick's (above 1: wick is faster).

    python scripts/torch-reference/zoo_speed.py --wick target/release/zoo-speed \\
        [--models resnet18,decoder] [--modes train,amp,eval] [--rounds 3] [--steps 3] [--threads 2] \\
        [--image 224] [--batches 1,8,32] [--seqs 128,256] [--device cuda] [--set hidden_size=768 ...]

`--device cuda` runs both on GPU 0 (wick's binary built with `--features cuda`): autocast is
`torch.autocast("cuda", torch.bfloat16)`, every step ends with the device synchronised, and the
table adds each side's peak allocated memory over the timed steps (`torch.cuda.max_memory_allocated`
after a reset at the end of the warm-up; wick's engine reports the same figure for its pool).
`--set KEY=VALUE` (repeatable, with one model in `--models`) changes a field of that model's
configuration on both sides (zoo-speed's `--set`: its `--list` prints the changed shapes, which
PyTorch's side builds), e.g. the 512 × 8 decoder made 12 × 768 wide with
`--models decoder-512 --set hidden_size=768 --set num_layers=12 --set num_heads=12`.
`--estimates FILE` (JSON from `scripts/zoo_estimates.py`) adds wick's estimator's figure for the
same step beside them.

Needs torch 2.5.1, torchvision 0.20.1 and transformers 4.46.3 (CPU is enough); not part of CI.
"""

import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
import torchvision


def resnet(depth, num_classes, width):
    """torchvision's ResNet-18 or -50 (width 64 is torchvision's own), via the AMP reference's
    builder for any first-stage width."""
    from torchvision.models.resnet import BasicBlock, Bottleneck
    from amp_trial import ResNet
    block, layers = (BasicBlock, [2, 2, 2, 2]) if depth == 18 else (Bottleneck, [3, 4, 6, 3])
    return ResNet(block, layers, num_classes, width)


def build(spec, device):
    """The model, its training loss and its eval forward for one configuration, on `device`
    (the model and its inputs are made on the CPU, seeded, then moved)."""
    kind = spec["kind"]
    torch.manual_seed(0)
    if kind == "llama":
        import transformers
        c = spec["config"]
        config = transformers.LlamaConfig(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
            num_key_value_heads=c["num_heads"], max_position_embeddings=c["max_seq"], rms_norm_eps=c["rms_eps"],
            rope_theta=c["rope_theta"], hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
            mlp_bias=False, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, c["vocab_size"], (spec["batch"], spec["seq"] + 1)).to(device)
        model.to(device)

        def loss():
            logits = model(input_ids=ids[:, :-1]).logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

        return model, loss, lambda: model(input_ids=ids[:, :-1]).logits
    if kind == "bert":
        import transformers
        c = spec["config"]
        config = transformers.BertConfig(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"], intermediate_size=c["intermediate_size"],
            max_position_embeddings=c["max_position_embeddings"], type_vocab_size=c["type_vocab_size"],
            layer_norm_eps=c["layer_norm_eps"], hidden_act="gelu", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        model = transformers.BertModel(config, add_pooling_layer=False)
        ids = torch.randint(1, c["vocab_size"], (spec["batch"], spec["seq"])).to(device)
        mask = torch.ones_like(ids)
        head = (torch.randn(c["hidden_size"], 2) * 0.5).to(device)
        labels = (torch.arange(spec["batch"]) % 2).to(device)
        model.to(device)

        def loss():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
            return F.cross_entropy(pooled.float() @ head, labels)

        return model, loss, lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state
    n, size, classes = spec["batch"], spec["image"], spec["classes"]
    if kind == "vit":
        c = spec["config"]
        model = torchvision.models.vision_transformer.VisionTransformer(
            image_size=c["image_size"], patch_size=c["patch_size"], num_layers=c["layers"], num_heads=c["heads"],
            hidden_dim=c["hidden"], mlp_dim=c["mlp_dim"], num_classes=c["num_classes"])
    elif kind == "resnet":
        model = resnet(spec["depth"], classes, spec["width"])
    elif kind == "mobilenet_v2":
        model = torchvision.models.mobilenet_v2(num_classes=classes, width_mult=spec["width_mult"], dropout=0.0)
    else:
        raise SystemExit(f"unknown kind {kind}")
    x = torch.randn(n, 3, size, size).to(device)
    y = (torch.arange(n) % classes).to(device)
    model.to(device)
    return model, lambda: F.cross_entropy(model(x).float(), y), lambda: model(x)


def optimizer(spec, params):
    if spec["optimizer"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def sync(device):
    """Waits for a GPU's queued work (nothing to wait for on the CPU)."""
    if device != "cpu":
        torch.cuda.synchronize()


def torch_times(spec, mode, steps, warmup, device, clip=None, compile_mode=None):
    """Milliseconds of each timed step, and the peak allocated bytes over them (None on the CPU);
    with `clip`, training clips the gradients to that total norm between backward and step; with
    `compile_mode`, the model is `torch.compile`d in place with that mode (nn.Module.compile: the
    zoo's loss closures call `model(...)`, which then runs the compiled module) and each step
    starts with `torch.compiler.cudagraph_mark_step_begin()` (CUDA graph trees), untimed."""
    model, loss_fn, eval_fn = build(spec, device)
    if compile_mode:
        model.compile(mode=compile_mode)
    begin = torch.compiler.cudagraph_mark_step_begin if compile_mode else (lambda: None)
    times = []
    sync(device)

    def timed(i, start):
        sync(device)
        if i == warmup - 1 and device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)

    if mode == "eval":
        model.eval()
        with torch.inference_mode():
            for i in range(warmup + steps):
                begin()
                start = time.perf_counter()
                eval_fn()
                timed(i, start)
    else:
        model.train()
        opt = optimizer(spec, model.parameters())
        for i in range(warmup + steps):
            begin()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if mode == "amp":
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = loss_fn()
            else:
                loss = loss_fn()
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            timed(i, start)
            if not torch.isfinite(loss):
                raise SystemExit(f"PyTorch loss {loss.item()}")
    peak = torch.cuda.max_memory_allocated() if device != "cpu" else None
    del model, loss_fn, eval_fn
    if device != "cpu":
        torch.cuda.empty_cache()
    return times, peak


def wick_run(binary, model, mode, steps, warmup, sizes, device, clip=None):
    """zoo-speed's JSON line for one configuration (`ms`, and `peak_allocated` on a GPU)."""
    extra = ["--clip-grad-norm", str(clip)] if clip and mode != "eval" else []
    out = subprocess.run([binary, "--model", model, "--mode", mode, "--steps", str(steps), "--warmup", str(warmup),
                          "--device", device] + sizes + extra,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def estimated(estimates, model, image, batch, mode):
    """The estimator's bytes for this step from `scripts/zoo_estimates.py`'s JSON, or None."""
    for e in estimates:
        # A text model's row has no image side (the estimates file carries its run's for every row).
        if (e["model"], e["batch"], e["mode"]) == (model, batch, mode) and image in (None, e["image"]):
            return e["bytes"]
    return None


def mib(b):
    return "-" if b is None else f"{b / 2**20:.0f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wick", required=True, help="the zoo-speed binary")
    ap.add_argument("--models", default=None)
    ap.add_argument("--modes", default="train,amp,eval")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clip-grad-norm", type=float, default=None,
                    help="train with the gradients clipped to this total norm (clip_grad_norm_ on PyTorch's side)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--image", type=int, default=None, help="side of the vision models' images (zoo-speed's default: 112)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (GPU 0, for both)")
    ap.add_argument("--estimates", default=None, help="wick estimator figures (scripts/zoo_estimates.py's JSON)")
    ap.add_argument("--batches", default=None,
                    help="comma-separated inputs per batch (images, or sequences for the text models), one table "
                         "row each (default: zoo-speed's 16 images, 8 sequences)")
    ap.add_argument("--seqs", default=None,
                    help="comma-separated tokens per sequence for the text models, one table row each "
                         "(default: zoo-speed's per model)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a field of the model's configuration (zoo-speed's --set; repeatable; one model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.set and (not args.models or "," in args.models):
        raise SystemExit("--set changes one model's configuration: name exactly one with --models")
    if args.set and args.estimates:
        raise SystemExit("--estimates holds the default configurations' figures, not a model changed by --set")
    image = ["--image", str(args.image)] if args.image else []
    image += [a for kv in args.set for a in ("--set", kv)]
    seqs = [["--seq", q] for q in args.seqs.split(",")] if args.seqs else [[]]
    batches = [["--batch", b] + q for q in seqs for b in args.batches.split(",")] if args.batches else seqs
    raw, failed = [], []
    gpu = args.device != "cpu"
    estimates = json.load(open(args.estimates)) if args.estimates else []
    where = torch.cuda.get_device_name(0) if gpu else f"{args.threads} threads"
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, {where}")
    if gpu:
        print("| model | image | batch | mode | wick ms | PyTorch ms | ratio (PyTorch / wick) | wick peak MiB "
              "| PyTorch peak MiB | wick estimate MiB | estimate / wick peak |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    else:
        print("| model | image / tokens | batch | mode | wick ms | PyTorch ms | ratio (PyTorch / wick) |")
        print("|---|---|---|---|---|---|---|")
    for batch in batches:
        sizes = image + batch
        named = ["--model", args.models] if args.set else []
        configs = json.loads(subprocess.run([args.wick, "--list"] + named + sizes, check=True, capture_output=True,
                                            text=True).stdout)
        models = args.models.split(",") if args.models else list(configs)
        for model in models:
            spec = configs[model]
            shape = (spec["image"], spec["batch"]) if "image" in spec else (f'{spec["seq"]} tok', spec["batch"])
            for mode in args.modes.split(","):
                w, t, wp, tp = [], [], [], []
                for _ in range(args.rounds):
                    try:
                        line = wick_run(args.wick, model, mode, args.steps, args.warmup, sizes, args.device, args.clip_grad_norm)
                    except subprocess.CalledProcessError as e:
                        # One configuration failing (a GPU path never run before, say) leaves the rest.
                        lines = (e.stderr or "").strip().splitlines()
                        why = next((l for l in lines if l.startswith("Error")), lines[-1] if lines else "no output")
                        print(f"| {model} | {shape[0]} | {shape[1]} | {mode} | FAILED: {why[:300]} |", flush=True)
                        failed.append(f"{model} {mode}")
                        break
                    w += line["ms"]
                    wp.append(line.get("peak_allocated"))
                    times, peak = torch_times(spec, mode, args.steps, args.warmup, args.device, args.clip_grad_norm)
                    t += times
                    tp.append(peak)
                if not w:
                    continue
                wm, tm = statistics.median(w), statistics.median(t)
                row = {"model": model, "image": shape[0], "batch": shape[1], "mode": mode, "wick_ms": w,
                       "torch_ms": t}
                text = f"| {model} | {shape[0]} | {shape[1]} | {mode} | {wm:.1f} | {tm:.1f} | {tm / wm:.2f}x |"
                if gpu:
                    wpeak = max((p for p in wp if p is not None), default=None)
                    tpeak = max((p for p in tp if p is not None), default=None)
                    est = estimated(estimates, model, spec.get("image"), shape[1], mode)
                    row.update({"wick_peak": wpeak, "torch_peak": tpeak, "estimate": est})
                    ratio = f"{est / wpeak:.2f}" if est and wpeak else "-"
                    text += f" {mib(wpeak)} | {mib(tpeak)} | {mib(est)} | {ratio} |"
                raw.append(row)
                print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    if failed:
        raise SystemExit(f"wick failed on: {', '.join(failed)}")


if __name__ == "__main__":
    main()

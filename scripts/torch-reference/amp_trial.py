"""PyTorch reference for wick's AMP trial (wick_tools::trial).

Trains the start that `amp-trial --out DIR` exported (the f32 initial parameters of a torchvision
model or of a Hugging Face BertModel / LlamaForCausalLM, and the inputs) with torch.optim.AdamW and the trial's
settings, in f64, f32, under torch.autocast bf16 (f32 parameters, PyTorch's per-op policy: O1), and
with bf16 compute copies of every parameter but the norms' made from f32 masters each step (wick's
scheme: O2 with f32 norms), then prints the first-step gradient errors against f64, each run's
losses next to wick's, and the gap of each low-precision run to its f32.

    python scripts/torch-reference/amp_trial.py DIR
    python scripts/torch-reference/amp_trial.py --ensemble K --binary target/release/amp-trial DIR
    python scripts/torch-reference/amp_trial.py --write-reference FILE DIR [DIR ...]

The second form also perturbs the exported start K times (each weight times 1 + 1e-3·N(0, 1):
the same problem to f32, other bf16 roundings), runs wick (`amp-trial --start`) and PyTorch on
each, and prints the distribution of the bf16-vs-f32 loss gap of both: on an ill-conditioned
task one number is one draw from that distribution. The third writes PyTorch's f64 and
autocast-bf16 losses of each exported trial to FILE (the reference the AMP test reads).

Needs torch 2.5.1, torchvision 0.20.1 and (for BERT and LLaMA) transformers 4.46.3 — CPU is enough; not part
of CI (see BENCHMARKS.md).
"""

import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
import torchvision
from safetensors.torch import load_file, save_file


class ResNet(torchvision.models.resnet.ResNet):
    """torchvision's ResNet with the first stage `width` wide (torchvision fixes it at 64)."""

    def __init__(self, block, layers, num_classes, width):
        torch.nn.Module.__init__(self)
        self._norm_layer, self.inplanes, self.dilation, self.groups, self.base_width = (
            torch.nn.BatchNorm2d, width, 1, 1, 64)
        self.conv1 = torch.nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(width)
        self.relu = torch.nn.ReLU(inplace=True)
        self.maxpool = torch.nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = torch.nn.AdaptiveAvgPool2d((1, 1))
        self.fc = torch.nn.Linear(8 * width * block.expansion, num_classes)


def hf_llama_name(name):
    """wick's LLaMA parameter name → Hugging Face LlamaForCausalLM's."""
    layer = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
             "up": "mlp.up_proj", "down": "mlp.down_proj"}
    parts = name.split(".")
    if parts[0] == "layers":
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.weight"
    return {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}[name]


def build(name, state, vit=None, bert=None, llama=None):
    classes = 10
    if name == "llama":
        import transformers
        config = transformers.LlamaConfig(
            vocab_size=llama["vocab_size"], hidden_size=llama["hidden_size"],
            intermediate_size=llama["intermediate_size"], num_hidden_layers=llama["num_layers"],
            num_attention_heads=llama["num_heads"], num_key_value_heads=llama["num_heads"],
            max_position_embeddings=llama["max_seq"], rms_norm_eps=llama["rms_eps"], rope_theta=llama["rope_theta"],
            hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
        model = transformers.LlamaForCausalLM(config)
    elif name == "bert":
        import transformers
        config = transformers.BertConfig(
            vocab_size=bert["vocab_size"], hidden_size=bert["hidden_size"],
            num_hidden_layers=bert["num_hidden_layers"], num_attention_heads=bert["num_attention_heads"],
            intermediate_size=bert["intermediate_size"], max_position_embeddings=bert["max_position_embeddings"],
            type_vocab_size=bert["type_vocab_size"], layer_norm_eps=bert["layer_norm_eps"], hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertModel(config, add_pooling_layer=False)
    elif name == "vit":
        model = torchvision.models.vision_transformer.VisionTransformer(
            image_size=vit["image_size"], patch_size=vit["patch_size"], num_layers=vit["layers"],
            num_heads=vit["heads"], hidden_dim=vit["hidden"], mlp_dim=vit["mlp_dim"], num_classes=vit["num_classes"])
    elif name == "mobilenet_v2":
        model = torchvision.models.mobilenet_v2(num_classes=classes, width_mult=0.5, dropout=0.0)
    elif name in ("resnet18", "resnet50"):
        from torchvision.models.resnet import BasicBlock, Bottleneck
        block, layers = (BasicBlock, [2, 2, 2, 2]) if name == "resnet18" else (Bottleneck, [3, 4, 6, 3])
        model = ResNet(block, layers, classes, width=state["conv1.weight"].shape[0])
    else:
        raise SystemExit(f"no reference builder for {name}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Only the batch-norm buffers may come from the constructor (fresh statistics in both).
    missing = [m for m in missing
               if not m.endswith(("running_mean", "running_var", "num_batches_tracked", "position_ids"))]
    if missing or unexpected:
        raise SystemExit(f"state does not match torchvision: missing {missing}, unexpected {unexpected}")
    return model


def task_loss(name, model, inputs, dtype, cast=None):
    """The trial's loss: cross-entropy of the images' logits, or for BERT of the mean-pooled
    last hidden states through the fixed f32 readout (outside autocast, as in wick)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if name == "llama":
        ids = inputs["input.ids"]
        logits = model(input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(wide), ids[:, 1:].reshape(-1))
    if name != "bert":
        logits = model(inputs["input.images"].to(cast or dtype))
        return F.cross_entropy(logits.to(wide), inputs["input.labels"])
    mask = inputs["input.mask"]
    hidden = model(input_ids=inputs["input.ids"], attention_mask=mask).last_hidden_state
    with torch.autocast("cpu", enabled=False):
        m = mask.to(wide).unsqueeze(-1)
        pooled = (hidden.to(wide) * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.cross_entropy(pooled @ inputs["input.head"].to(wide), inputs["input.labels"])


def make_model(name, state, cfg, dtype):
    model = build(name, {k: v.to(dtype) for k, v in state.items()}, cfg.get("vit"), cfg.get("bert"), cfg.get("llama"))
    return model.to(dtype).train()


def mode_dtype(mode):
    return torch.float64 if mode == "f64" else torch.float32


def mode_loss(name, model, inputs, mode):
    """The task's loss computed as `mode` says: plainly in f64/f32, under autocast bf16, or through
    bf16 compute copies of every parameter but the norms', cast inside the graph so the
    gradients reach the f32 masters."""
    dtype = mode_dtype(mode)
    if mode in ("f64", "f32"):
        return task_loss(name, model, inputs, dtype)
    if mode == "autocast-bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return task_loss(name, model, inputs, dtype)
    if mode == "copies-bf16":
        norm_params = {f"{m}.{p}" for m, module in model.named_modules()
                       if isinstance(module, (torch.nn.BatchNorm2d, torch.nn.LayerNorm))
                       for p, _ in module.named_parameters(recurse=False)}
        copies = {k: (p if k in norm_params else p.to(torch.bfloat16)) for k, p in model.named_parameters()}
        wrapped = lambda *args, **kwargs: torch.func.functional_call(model, copies, args, kwargs)
        return task_loss(name, wrapped, inputs, dtype, cast=torch.bfloat16)
    raise ValueError(mode)


def train(name, state, inputs, cfg, mode):
    torch.manual_seed(0)
    model = make_model(name, state, cfg, mode_dtype(mode))
    a = cfg["adamw"]
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(a["beta1"], a["beta2"]), eps=a["eps"],
                            weight_decay=a["weight_decay"])
    losses = []
    for _ in range(cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = mode_loss(name, model, inputs, mode)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    with torch.no_grad():
        losses.append(mode_loss(name, model, inputs, mode).item())
    return losses


def first_gradients(name, state, inputs, cfg, mode):
    """The first step's parameter gradients in f64, from a forward/backward in `mode`."""
    model = make_model(name, state, cfg, mode_dtype(mode))
    mode_loss(name, model, inputs, mode).backward()
    return {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}


def gradient_errors(directory, name, state, inputs, cfg):
    """Median over parameters of |g - g_f64| / |g_f64| for wick's and PyTorch's first gradients."""
    reference = first_gradients(name, state, inputs, cfg, "f64")
    runs = {"torch f32": first_gradients(name, state, inputs, cfg, "f32"),
            "torch autocast bf16": first_gradients(name, state, inputs, cfg, "autocast-bf16")}
    rename = hf_llama_name if name == "llama" else (lambda k: k)
    for dtype in ("f32", "bf16", "f16"):
        grads = load_file(f"{directory}/grads-{dtype}.safetensors")
        runs[f"wick {dtype}"] = {rename(k): v.double() for k, v in grads.items()}
    # Parameters with a non-zero reference gradient (blocks behind a zero-initialised residual
    # scale get none in the first step).
    names = [k for k, g in reference.items() if g.norm() > 1e-12]
    for label, grads in runs.items():
        errors = sorted(((grads[k] - reference[k]).norm() / reference[k].norm()).item() for k in names)
        print(f"first gradients, {label:>20} vs torch f64: median relative error {errors[len(errors) // 2]:.2e} "
              f"over {len(names)} parameters")


def gap(a, b):
    return 100 * abs(a[-1] - b[-1]) / abs(b[-1])


def compare(directory, modes=("f64", "f32", "autocast-bf16", "copies-bf16"), quiet=False):
    cfg = json.load(open(f"{directory}/wick.json"))
    tensors = load_file(f"{directory}/start.safetensors")
    inputs = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith("input.")]}
    name = cfg["model"]
    if name == "llama":
        tensors = {hf_llama_name(k): v for k, v in tensors.items()}
    runs = {mode: train(name, tensors, inputs, cfg, mode) for mode in modes}
    if not quiet:
        gradient_errors(directory, name, tensors, inputs, cfg)
        print(f"torch {torch.__version__}, {name}, {cfg['steps']} AdamW steps, lr {cfg['adamw']['lr']}")
        for label, losses in [*(("torch " + k, v) for k, v in runs.items()),
                              *(("wick " + k, v) for k, v in cfg["losses"].items())]:
            print(f"{label:>20}: {losses[0]:.5f} -> {losses[-1]:.5f}   " + " ".join(f"{l:.4f}" for l in losses))
        if "f64" in runs:
            print(f"torch f32 vs f64: {gap(runs['f32'], runs['f64']):.3f} %")
        print(f"wick f32 vs torch f32: {gap(cfg['losses']['f32'], runs['f32']):.3f} %")
        print(f"torch autocast bf16 vs torch f32: {gap(runs['autocast-bf16'], runs['f32']):.2f} %")
        if "copies-bf16" in runs:
            print(f"torch bf16 copies vs torch f32: {gap(runs['copies-bf16'], runs['f32']):.2f} %")
        print(f"wick bf16 vs wick f32: {gap(cfg['losses']['bf16'], cfg['losses']['f32']):.2f} %")
        print(f"wick f16 vs wick f32: {gap(cfg['losses']['f16'], cfg['losses']['f32']):.2f} %")
    return cfg, runs


def ensemble(directory, count, binary):
    tensors = load_file(f"{directory}/start.safetensors")
    rows = []
    for k in range(1, count + 1):
        g = torch.Generator().manual_seed(k)
        perturbed = {n: (t if n.startswith("input.") else t * (1 + 1e-3 * torch.randn(t.shape, generator=g)))
                     for n, t in tensors.items()}
        run_dir = os.path.join(directory, f"ensemble-{k}")
        os.makedirs(run_dir, exist_ok=True)
        save_file(perturbed, f"{run_dir}/perturbed.safetensors")
        subprocess.run([binary, "--start", f"{run_dir}/perturbed.safetensors", "--out", run_dir], check=True,
                       stdout=subprocess.DEVNULL)
        cfg, runs = compare(run_dir, modes=("f32", "autocast-bf16"), quiet=True)
        w = cfg["losses"]
        row = (gap(w["f32"], runs["f32"]), gap(w["bf16"], w["f32"]), gap(runs["autocast-bf16"], runs["f32"]),
               gap(w["f16"], w["f32"]))
        rows.append(row)
        print(f"start {k:2}: wick f32 vs torch f32 {row[0]:.3f} %, bf16 gap: wick {row[1]:.2f} %, "
              f"torch autocast {row[2]:.2f} %; wick f16 gap {row[3]:.2f} %", flush=True)
    for i, label in [(1, "wick bf16"), (2, "torch autocast bf16"), (3, "wick f16")]:
        v = [r[i] for r in rows]
        print(f"{label:>20} gap over {count} starts: mean {statistics.mean(v):.2f} %, median "
              f"{statistics.median(v):.2f} %, min {min(v):.2f} %, max {max(v):.2f} %, "
              f"within 2 %: {sum(x <= 2 for x in v)}/{count}")


def write_reference(path, directories):
    """Writes PyTorch's f64 and autocast-bf16 losses of each exported trial to `path` (JSON), the
    reference `tools/tests/amp.rs` checks wick's f32 training against."""
    models = {}
    for directory in directories:
        cfg, runs = compare(directory, modes=("f64", "autocast-bf16"), quiet=True)
        models[cfg["model"]] = {"f64": runs["f64"], "autocast_bf16": runs["autocast-bf16"]}
    reference = {
        "what": "losses before each of 12 AdamW steps and after the last, trained by PyTorch from the start "
                "`amp-trial --model M --out DIR` exports (wick_tools::trial)",
        "made_by": "python scripts/torch-reference/amp_trial.py --write-reference PATH DIR...",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "models": models,
    }
    with open(path, "w") as f:
        json.dump(reference, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


def main():
    args = sys.argv[1:]
    if len(args) == 1:
        compare(args[0])
    elif len(args) >= 3 and args[0] == "--write-reference":
        write_reference(args[1], args[2:])
    elif len(args) == 5 and args[0] == "--ensemble" and args[2] == "--binary":
        compare(args[4])
        ensemble(args[4], int(args[1]), args[3])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()

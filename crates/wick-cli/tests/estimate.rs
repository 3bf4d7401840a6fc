//! `wick estimate`: the table's parts add up, grow with the batch and the optimizer's state as
//! they must (SGD < momentum < AdamW by exactly one and two parameter copies; AMP adds f32
//! masters), the JSON and text forms agree, and bad arguments say what was expected; `wick
//! fit-batch` finds the largest batch whose real, measured step fits the budget.

use std::process::Command;

fn wick(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wick")).args(args).output().expect("wick runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn estimate(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["estimate"];
    all.extend_from_slice(args);
    all.push("--json");
    let (ok, out, err) = wick(&all);
    assert!(ok, "{err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn field(e: &serde_json::Value, k: &str) -> u64 {
    e[k].as_u64().unwrap_or_else(|| panic!("no {k} in {e}"))
}

#[test]
fn the_parts_add_up_and_follow_the_optimizer_and_the_batch() {
    let small = estimate(&["resnet18", "--image", "64", "--batch", "4"]);
    let large = estimate(&["resnet18", "--image", "64", "--batch", "16"]);
    assert_eq!(small["parameters"], 11_689_512, "torchvision's ResNet-18 count");
    let rows = small["estimates"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    let params = field(&rows[0], "parameters");
    assert_eq!(params, 11_689_512 * 4);
    for e in rows {
        let parts: u64 =
            ["parameters", "gradients", "optimizer_state", "master_weights", "activations", "workspace", "allowance"]
                .iter()
                .map(|k| field(e, k))
                .sum();
        assert_eq!(parts, field(e, "total"), "{e}");
    }
    let state: Vec<u64> = rows.iter().map(|e| field(e, "optimizer_state")).collect();
    assert_eq!(state, vec![0, 0, params, 2 * params]);
    assert_eq!((field(&rows[0], "gradients"), field(&rows[0], "activations")), (0, 0));
    assert!(rows[1..].iter().all(|e| field(e, "gradients") == params));
    for (s, l) in rows.iter().zip(large["estimates"].as_array().unwrap()) {
        // Inference is profiled under no_grad: nothing kept, its peak all transient.
        // (a fixed part — the first layers' buffers — is a third of it at batch 4).
        let (kept, factor) = if field(s, "gradients") == 0 { ("workspace", 2) } else { ("activations", 3) };
        assert!(field(l, kept) > factor * field(s, kept), "{kept} grow with the batch");
        assert!(field(l, "total") > field(s, "total"));
    }
    // bf16 autocast: half-size parameters (norms stay f32), f32 masters and state.
    let amp = estimate(&["resnet18", "--image", "64", "--batch", "4", "--precision", "amp-bf16", "--mode", "adamw"]);
    let e = &amp["estimates"][0];
    assert!(field(e, "parameters") < params * 6 / 10, "{e}");
    assert_eq!(field(e, "master_weights"), params);
    assert_eq!(field(e, "optimizer_state"), 2 * params);
    // The text table says the same and how it was obtained.
    let (ok, text, _) = wick(&["estimate", "resnet18", "--image", "64", "--batch", "4", "--mode", "sgd"]);
    assert!(ok && text.contains("TrainSgd") && text.contains("profiled on the CPU"), "{text}");
}

#[test]
fn text_models_profile_at_their_sequence_length() {
    let short = estimate(&["minilm", "--seq", "16", "--batch", "8", "--mode", "adamw"]);
    let long = estimate(&["minilm", "--seq", "32", "--batch", "8", "--mode", "adamw"]);
    assert_eq!(short["parameters"], long["parameters"]);
    let act = |v: &serde_json::Value| field(&v["estimates"][0], "activations");
    assert!(act(&long) > act(&short) * 3 / 2, "activations grow with the sequence");
}

#[test]
fn checkpointing_is_profiled_as_it_runs_and_matches_its_measured_peak() {
    // Batch 12 at 96² was never profiled (2, 4, 8, 16); the real checkpointed step runs it.
    let args = ["resnet18", "--image", "96", "--mode", "sgd", "--batch", "12", "--measure"];
    let plain = estimate(&args);
    let mut with = args.to_vec();
    with.push("--checkpointing");
    let ckpt = estimate(&with);
    assert_eq!((plain["checkpointing"].as_bool(), ckpt["checkpointing"].as_bool()), (Some(false), Some(true)));
    let (p, c) = (&plain["estimates"][0], &ckpt["estimates"][0]);
    // Only the blocks' inputs are kept; one block is recomputed at a time during backward.
    assert!(field(c, "activations") * 2 < field(p, "activations"), "{c} vs {p}");
    assert!(field(c, "workspace") > field(p, "workspace"), "the recomputation is transient: {c} vs {p}");
    assert_eq!(field(c, "gradients"), field(p, "gradients"));
    let peaks = |e: &serde_json::Value| e["measured_peaks"][0].as_u64().unwrap() as f64;
    assert!(peaks(&ckpt) < peaks(&plain) * 0.9, "checkpointing lowers the real peak");
    for (e, m) in [(c, peaks(&ckpt)), (p, peaks(&plain))] {
        let total = field(e, "total") as f64;
        assert!((total / m - 1.0).abs() < 0.03, "estimate {total} vs measured {m}");
    }
    let (ok, text, _) =
        wick(&["estimate", "resnet18", "--image", "64", "--batch", "4", "--mode", "sgd", "--checkpointing"]);
    assert!(ok && text.contains("activation checkpointing"), "{text}");
}

#[test]
fn bad_arguments_say_what_was_expected() {
    let (ok, _, err) = wick(&["estimate", "resnet19"]);
    assert!(!ok && err.contains("resnet18") && err.contains("mobilenet_v2"), "{err}");
    let (ok, _, err) = wick(&["estimate", "resnet18", "--batch", "0"]);
    assert!(!ok && err.contains("--batch"), "{err}");
    let (ok, _, err) = wick(&["estimate", "minilm", "--seq", "4096"]);
    assert!(!ok && err.contains("512 positions"), "{err}");
    let (ok, _, err) = wick(&["estimate", "--config", "/nonexistent/config.json"]);
    assert!(!ok && err.contains("/nonexistent/config.json"), "{err}");
    let (ok, _, err) = wick(&["estimate"]);
    assert!(!ok && err.contains("<MODEL>"), "{err}");
    let (ok, _, err) = wick(&["estimate", "resnet18", "--precision", "amp-bf16", "--mode", "sgd"]);
    assert!(!ok && err.contains("plain SGD is not a mixed-precision mode"), "{err}");
    let (ok, _, err) = wick(&["estimate", "resnet18", "--on", "cuda", "--measure"]);
    assert!(!ok && err.contains("--measure runs the step on the CPU"), "{err}");
    // A ZeRO option its stage would ignore, for `fit-batch` too.
    let (ok, _, err) = wick(&["estimate", "resnet18", "--ranks", "2", "--zero", "1", "--no-recompute"]);
    assert!(!ok && err.contains("--no-recompute") && err.contains("--zero 3"), "{err}");
    let (ok, _, err) =
        wick(&["fit-batch", "resnet18", "--budget", "8GiB", "--ranks", "2", "--zero", "3", "--no-overlap"]);
    assert!(!ok && err.contains("--no-overlap is for ZeRO stages 0-2"), "{err}");
}

#[test]
fn gpu_estimates_say_they_are_not_a_bound_yet() {
    // Measured on an H200 (BENCHMARKS.md): wick's older GPU path kept 1.15-5.6x what the estimate
    // says; the present one is not yet checked on a device.
    let (ok, out, err) =
        wick(&["estimate", "resnet18", "--image", "32", "--mode", "inference", "--on", "cuda", "--json"]);
    assert!(ok && err.contains("not checked against a GPU's measured peak yet"), "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(json["warning"].as_str().is_some_and(|w| w.contains("1.15-5.6x")), "{json}");
    let (ok, out, err) = wick(&["estimate", "resnet18", "--image", "32", "--mode", "inference", "--json"]);
    assert!(ok && !err.contains("not checked against a GPU"), "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(json["warning"].is_null(), "{json}");
    // On a GPU the update runs in place in wick's multi-tensor kernels: no new state beside the
    // old (the CPU's update makes the new state of one parameter at a time), so a GPU training
    // step is estimated at most at the CPU's, the gradients, state and parameters the same. Each
    // call profiles the model in its own process, and backward's measured workspace moves by a
    // few hundred bytes between processes (host allocations of the thread pool), so the totals
    // compare within the estimate's own noise allowance; wick-zoo's estimator test orders the
    // three updates from one profile exactly. (Before the profile allocated the products'
    // per-thread scratch first, a loaded machine moved it by 2 MiB a thread: 4.8 against 11.3 MB
    // in one CI run, beyond the allowance.)
    let total = |on: &str| -> serde_json::Value {
        let (ok, out, err) = wick(&["estimate", "resnet18", "--image", "32", "--mode", "adamw", "--on", on, "--json"]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()["estimates"][0].clone()
    };
    let (cpu, gpu) = (total("cpu"), total("cuda"));
    for k in ["parameters", "gradients", "optimizer_state", "activations"] {
        assert_eq!(cpu[k], gpu[k], "{k}");
    }
    let n = |e: &serde_json::Value, k: &str| e[k].as_u64().unwrap();
    assert!(n(&gpu, "total") <= n(&cpu, "total") + n(&cpu, "allowance"), "GPU {gpu} against CPU {cpu}");
}

#[test]
fn fit_batch_finds_the_largest_batch_whose_measured_peak_fits() {
    let (ok, out, err) = wick(&[
        "fit-batch",
        "resnet18",
        "--image",
        "64",
        "--mode",
        "sgd",
        "--budget",
        "300MiB",
        "--target-batch",
        "1000",
        "--json",
    ]);
    assert!(ok, "{err}");
    let fit: serde_json::Value = serde_json::from_str(&out).unwrap();
    let largest = fit["largest_batch"].as_u64().unwrap();
    let margin = fit["margin"].as_f64().unwrap();
    assert!(largest > 8, "{fit}");
    assert_eq!(fit["budget_bytes"], 300u64 << 20);
    // The boundary: the estimate with the margin fits at `largest` and not one above.
    let total = |b: u64| {
        let e = estimate(&["resnet18", "--image", "64", "--mode", "sgd", "--batch", &b.to_string()]);
        field(&e["estimates"][0], "total") as f64 * (1.0 + margin)
    };
    assert!(total(largest) <= (300u64 << 20) as f64 && total(largest + 1) > (300u64 << 20) as f64);
    // The real step at that batch fits the budget.
    let measured =
        estimate(&["resnet18", "--image", "64", "--mode", "sgd", "--batch", &largest.to_string(), "--measure"]);
    let peak = measured["measured_peaks"][0].as_u64().unwrap();
    assert!(peak <= 300 << 20, "measured {peak} at batch {largest}");
    // Accumulation: micro-batches that divide the target exactly, no larger than the largest.
    let (micro, steps) = (fit["micro_batch"].as_u64().unwrap(), fit["accumulation_steps"].as_u64().unwrap());
    assert!(micro * steps == 1000 && micro <= largest, "{fit}");
}

#[test]
fn fit_batch_budgets_from_a_gpu_name_or_a_device() {
    let (ok, out, err) =
        wick(&["fit-batch", "resnet18", "--image", "64", "--gpu", "H200", "--max-batch", "64", "--json"]);
    assert!(ok, "{err}");
    let fit: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(fit["budget_bytes"].as_u64(), Some((143_771u64 << 20) - (512 << 20)));
    assert_eq!(fit["largest_batch"], 64, "capped by --max-batch");
    let (ok, _, err) = wick(&["fit-batch", "resnet18", "--gpu", "A200"]);
    assert!(!ok && err.contains("A100-80GB"), "{err}");
    let (ok, _, err) = wick(&["fit-batch", "resnet18", "--budget", "12 parsecs"]);
    assert!(!ok && err.contains("unknown unit"), "{err}");
    let (ok, _, err) = wick(&["fit-batch", "resnet18"]);
    assert!(!ok && err.contains("--budget"), "{err}");
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        let (ok, _, err) = wick(&["fit-batch", "resnet18", "--device", "cuda:0"]);
        assert!(!ok && err.contains("no driver"), "{err}");
    }
    let (ok, _, err) = wick(&["fit-batch", "resnet18", "--device", "gpu0"]);
    assert!(!ok && err.contains("expected cuda:N"), "{err}");
}

#[test]
fn a_llama_config_is_profiled_through_two_layers_and_matches_its_measured_peak() {
    let dir = std::env::temp_dir().join(format!("wick-estimate-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.json");
    let (v, h, layers, i) = (1000u64, 256u64, 8u64, 688u64);
    std::fs::write(
        &config,
        format!(
            r#"{{"model_type": "llama", "vocab_size": {v}, "hidden_size": {h}, "num_hidden_layers": {layers},
                "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": {i},
                "max_position_embeddings": 256, "rms_norm_eps": 1e-6}}"#
        ),
    )
    .unwrap();
    let path = config.to_str().unwrap();
    let e = estimate(&["--config", path, "--seq", "64", "--batch", "24", "--mode", "sgd", "--measure"]);
    // Embedding, LM head and final norm; per layer Q, K, V, O, gate, up, down and two norms.
    assert_eq!(e["parameters"].as_u64(), Some(2 * v * h + h + layers * (4 * h * h + 3 * i * h + 2 * h)));
    let total = field(&e["estimates"][0], "total") as f64;
    let peak = e["measured_peaks"][0].as_u64().unwrap() as f64;
    assert!((total / peak - 1.0).abs() < 0.03, "estimate {total} vs measured {peak}");
    // Grouped-query attention is refused with the reason.
    std::fs::write(
        &config,
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}"#,
    )
    .unwrap();
    let (ok, _, err) = wick(&["estimate", "--config", path]);
    assert!(!ok && err.contains("grouped-query attention"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The estimator's validation sweep: every zoo model family at real vocabularies and widths, at
/// batches between the profile's (which `wick estimate` then profiles too) and beyond them
/// (extrapolated), in every mode `--measure` runs (inference,
/// plain SGD, momentum and AdamW as one trainer step; f32, bf16 autocast with f32 masters, and
/// activation checkpointing). Each estimate must be at or above the measured peak and at most
/// 3 % above it. (The release-build sweep at larger sizes is BENCHMARKS.md's "Estimator sweep
/// (issue 28)".) About 260 s on 2 cores: a long test (`scripts/long-tests.sh`, CI on every
/// change); the default run keeps the single-mode checks above (checkpointing, the LLaMA config).
#[test]
#[ignore = "long: the estimator's validation sweep, run by scripts/long-tests.sh"]
fn the_estimate_is_never_under_the_measured_peak_and_at_most_3_percent_over() {
    let dir = std::env::temp_dir().join(format!("wick-estimate-sweep-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A decoder with a LLaMA-sized vocabulary (32 000 tokens), two layers 256 wide.
    let llama = dir.join("llama.json");
    std::fs::write(
        &llama,
        r#"{"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 688, "max_position_embeddings": 512}"#,
    )
    .unwrap();
    let llama = llama.to_str().unwrap();
    let cases: &[&[&str]] = &[
        // BERT's real 30 522-token vocabulary (the table that exposed the retained graph).
        &["minilm", "--seq", "200", "--batch", "6"],
        &["minilm", "--seq", "200", "--batch", "6", "--precision", "amp-bf16"],
        &["minilm", "--seq", "120", "--batch", "5", "--checkpointing"],
        &["--config", llama, "--seq", "96", "--batch", "5"],
        &["--config", llama, "--seq", "96", "--batch", "5", "--precision", "amp-bf16"],
        &["--config", llama, "--seq", "96", "--batch", "5", "--checkpointing"],
        // Beyond the profiled batches (training to 16): extrapolated.
        &["--config", llama, "--seq", "64", "--batch", "24"],
        &["resnet18", "--image", "96", "--batch", "24"],
        &["resnet50", "--image", "64", "--batch", "7", "--checkpointing"],
        &["mobilenet_v2", "--image", "96", "--batch", "10", "--precision", "amp-bf16"],
        &["vit_b_16", "--batch", "3"],
    ];
    let mut failures = Vec::new();
    println!("| model | mode | estimate MiB | measured MiB | error |");
    println!("|---|---|---|---|---|");
    for args in cases {
        let mut all = args.to_vec();
        all.extend(["--mode", "all", "--measure"]);
        let e = estimate(&all);
        let mut measured = 0;
        for (est, peak) in e["estimates"].as_array().unwrap().iter().zip(e["measured_peaks"].as_array().unwrap()) {
            let mode = est["mode"].as_str().unwrap_or("?");
            let peak = peak.as_u64().unwrap_or_else(|| panic!("{mode} not measured for {args:?}"));
            measured += 1;
            let total = field(est, "total");
            let error = total as f64 / peak as f64 - 1.0;
            let mib = |b: u64| b as f64 / 1048576.0;
            println!(
                "| {} | {mode} | {:.1} | {:.1} | {:+.2} % |",
                args.join(" "),
                mib(total),
                mib(peak),
                error * 100.0
            );
            if !(0.0..=0.03).contains(&error) {
                failures
                    .push(format!("{args:?} {mode}: estimate {total} vs measured {peak} ({:+.2} %)", error * 100.0));
            }
        }
        // Plain SGD is not a mixed-precision mode: the other three under AMP.
        let expected = if args.contains(&"amp-bf16") { 3 } else { 4 };
        assert_eq!(measured, expected, "{args:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `--ranks N --zero S`: one rank's figures — the optimizer's state and the f32 masters divided
/// over the ranks from stage 1 on (rounded up), parameters and gradients whole up to stage 2,
/// the reduction's buffers in the workspace, and at stage 3 the parameters sharded too; a bad
/// stage or rank count refused.
#[test]
fn ranks_and_zero_stages_give_one_ranks_share() {
    let args = ["resnet18", "--image", "64", "--batch", "4", "--mode", "adamw", "--precision", "amp-bf16"];
    let one = estimate(&args);
    let e1 = &one["estimates"][0];
    for (zero, shared) in [("0", 1u64), ("1", 4), ("2", 4)] {
        let mut a = args.to_vec();
        a.extend(["--ranks", "4", "--zero", zero]);
        let out = estimate(&a);
        assert_eq!(out["ranks"]["ranks"], 4);
        let e = &out["estimates"][0];
        for k in ["parameters", "gradients", "activations"] {
            assert_eq!(field(e, k), field(e1, k), "ZeRO-{zero}: {k} stays whole");
        }
        for k in ["optimizer_state", "master_weights"] {
            assert_eq!(field(e, k), field(e1, k).div_ceil(shared), "ZeRO-{zero}: {k}");
        }
        assert!(field(e, "workspace") >= field(e1, "workspace"), "the reduction's buffers come on top");
    }
    // Stage 3: the parameters sharded too — the optimizer's state and the masters a share of
    // one process's (each piece rounded up by at most one element), the parameters and their
    // gradients below one process's; the largest block named with its bytes.
    let mut a = args.to_vec();
    a.extend(["--ranks", "4", "--zero", "3"]);
    let out = estimate(&a);
    let e = &out["estimates"][0];
    let tensors = out["ranks"]["blocks"]["tensors"].as_u64().unwrap();
    for k in ["optimizer_state", "master_weights"] {
        let (share, per_piece) = (field(e1, k).div_ceil(4), if k == "master_weights" { 4 } else { 8 });
        assert!((share..=share + tensors * per_piece).contains(&field(e, k)), "ZeRO-3: {k} {}", field(e, k));
    }
    for k in ["parameters", "gradients"] {
        assert!(field(e, k) < field(e1, k), "ZeRO-3: {k} sharded: {} against {}", field(e, k), field(e1, k));
    }
    let (name, bytes) = (&out["largest_block"][0], out["largest_block"][1].as_u64().unwrap());
    assert!(name.as_str().is_some_and(|n| n.starts_with("layer")) && bytes > 0, "{}", out["largest_block"]);
    // Stage 3 keeping the blocks' activations (`--no-recompute`): the same shards, the activations
    // of every block instead of their inputs (the profile runs the blocks kept).
    let mut kept = a.clone();
    kept.push("--no-recompute");
    let out_kept = estimate(&kept);
    let k = &out_kept["estimates"][0];
    assert_eq!(out_kept["ranks"]["recompute"], false);
    for key in ["optimizer_state", "master_weights", "parameters"] {
        assert_eq!(field(k, key), field(e, key), "kept ZeRO-3: {key}");
    }
    assert!(field(k, "activations") > field(e, "activations"), "kept activations {k} against recomputed {e}");
    // On a GPU (stages 0-2 over NCCL) the buckets are reduced after backward: no bucket in
    // flight beside its activations, so --no-overlap changes nothing there; on the CPU it takes
    // the bucket in flight off the workspace.
    for zero in ["0", "2"] {
        let mut on_gpu = args.to_vec();
        on_gpu.extend(["--ranks", "2", "--zero", zero, "--on", "cuda"]);
        let overlapped = estimate(&on_gpu);
        on_gpu.push("--no-overlap");
        let after = estimate(&on_gpu);
        assert_eq!(overlapped["ranks"]["overlap"], serde_json::Value::Null, "ZeRO-{zero} on cuda");
        assert_eq!(overlapped["estimates"], after["estimates"], "ZeRO-{zero} on cuda");
        let host = |extra: &[&'static str]| {
            let mut a = args.to_vec();
            a.extend(["--ranks", "2", "--zero", zero]);
            a.extend(extra);
            field(&estimate(&a)["estimates"][0], "workspace")
        };
        assert!(host(&[]) > host(&["--no-overlap"]), "ZeRO-{zero} on the CPU: a bucket in flight");
    }
    // Stage 3 on GPU ranks: the same shards (parameters, masters, state) as on the host, no
    // reduction in flight and no prefetch (refused there).
    let mut cuda = a.clone();
    cuda.extend(["--on", "cuda"]);
    let on_gpu = estimate(&cuda);
    assert_eq!(on_gpu["ranks"]["overlap"], serde_json::Value::Null);
    assert_eq!(on_gpu["ranks"]["prefetch"], false);
    for key in ["optimizer_state", "master_weights", "parameters"] {
        assert_eq!(field(&on_gpu["estimates"][0], key), field(e, key), "ZeRO-3 on cuda: {key}");
    }
    cuda.push("--prefetch");
    cuda.insert(0, "estimate");
    let (ok, _, err) = wick(&cuda);
    assert!(!ok && err.contains("--prefetch") && err.contains("GPU"), "{err}");
    for bad in [["--ranks", "0"], ["--zero", "4"]] {
        let mut a = args.to_vec();
        a.extend(bad);
        a.insert(0, "estimate");
        let (ok, _, err) = wick(&a);
        assert!(!ok && err.contains(bad[0]), "{err}");
    }
}

/// `fit-batch --ranks N --zero S`: the largest batch per rank under one rank's estimate (ZeRO-1's
/// smaller share of the AdamW state fits at least as large a batch as replicated), and an
/// effective batch split over the ranks first, each accumulating its share; one that does not
/// split evenly is not reachable.
#[test]
fn fit_batch_plans_per_rank() {
    let fit = |ranks: &str, zero: &str, target: &str| -> serde_json::Value {
        let args = [
            "fit-batch",
            "resnet18",
            "--image",
            "64",
            "--mode",
            "adamw",
            "--budget",
            "400MiB",
            "--ranks",
            ranks,
            "--zero",
            zero,
            "--target-batch",
            target,
            "--json",
        ];
        let (ok, out, err) = wick(&args);
        assert!(ok, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    let replicated = fit("2", "0", "96");
    let sharded = fit("2", "1", "96");
    assert_eq!(sharded["ranks"], 2);
    let (r, s) = (replicated["largest_batch"].as_u64().unwrap(), sharded["largest_batch"].as_u64().unwrap());
    assert!(s >= r && r > 0, "replicated {r}, ZeRO-1 {s}");
    let (micro, steps) = (sharded["micro_batch"].as_u64().unwrap(), sharded["accumulation_steps"].as_u64().unwrap());
    assert!(micro * steps * 2 == 96 && micro <= s, "{sharded}");
    assert!(fit("2", "1", "95")["micro_batch"].is_null(), "95 does not split over 2 ranks");
}

/// The CUDA graph pool's estimate (the step's own tensors: gradients, activations, transients,
/// with the allowance) against the measured step on the CPU less what outlives it (parameters,
/// masters, optimizer state): never under, within 5 % — what issue 47 asks of the graph pool, held
/// here on the CPU's step; the device's own comparison is scripts/gpu-check.sh's. The text form
/// names the pool under `--on cuda`.
#[test]
fn the_graph_pool_estimate_bounds_the_steps_own_tensors() {
    for args in [
        &["resnet18", "--image", "64", "--batch", "8", "--mode", "adamw"][..],
        &["minilm", "--seq", "32", "--batch", "8", "--mode", "sgd-momentum", "--precision", "amp-bf16"][..],
    ] {
        let mut with = args.to_vec();
        with.push("--measure");
        let out = estimate(&with);
        let e = &out["estimates"][0];
        let pool = out["graph_pools"][0].as_u64().unwrap();
        let parts: u64 = ["gradients", "activations", "workspace", "allowance"].iter().map(|k| field(e, k)).sum();
        assert_eq!(pool, parts, "{out}");
        let measured = out["measured_peaks"][0].as_u64().unwrap();
        let outlives = field(e, "parameters") + field(e, "optimizer_state") + field(e, "master_weights");
        let own = measured - outlives;
        let ratio = pool as f64 / own as f64;
        assert!((1.0..=1.05).contains(&ratio), "{args:?}: pool {pool} for {own} measured ({ratio:.4})");
    }
    let (ok, text, _) =
        wick(&["estimate", "resnet18", "--image", "64", "--batch", "4", "--mode", "adamw", "--on", "cuda"]);
    assert!(ok && text.contains("as a CUDA graph") && text.contains("TrainAdamW"), "{text}");
}

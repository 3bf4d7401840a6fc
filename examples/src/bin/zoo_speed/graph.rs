//! `zoo-speed --cuda-graph`: the training step (train, amp) through the fused device step, or the
//! forward pass (eval), captured as a CUDA graph after the warm-up and replayed; with
//! `--check-graph`, against an eager twin to the bit and the graph's memory given back.

use anyhow::{bail, Result};
use wick_examples::zoo_bench::Sizes;

use super::Args;
#[cfg(feature = "cuda")]
use {
    super::{build, f32_start, host_values, max_rel_err, Bench, Mode},
    candle_core::{DType, Tensor},
    serde_json::json,
    std::time::Instant,
    wick_nn::{Autocast, Model},
};

/// `--cuda-graph` without CUDA.
#[cfg(not(feature = "cuda"))]
pub(super) fn graph_steps(_: &Args, _: &str, _: Sizes, _: &wick::Engine) -> Result<()> {
    bail!("--cuda-graph needs a build with --features cuda and --device cuda")
}

/// `--cuda-graph`: the training step (train or amp) through the fused device step (eval:
/// `graph_eval`), eagerly for
/// `--warmup` steps, then captured as a CUDA graph and replayed for `--steps`; prints the step
/// times, the host's time to issue each step, the graph's nodes and memory, or why it was refused.
/// With `--check-graph`, the same seeded model is stepped eagerly beside it (the same fused step
/// and clipping) and every loss and final parameter must be the same bits; then the graph is
/// dropped and the device's graph memory trimmed back to where it was.
#[cfg(feature = "cuda")]
pub(super) fn graph_steps(args: &Args, name: &str, sizes: Sizes, engine: &wick::Engine) -> Result<()> {
    use wick::cuda_graph;
    use wick_train::amp::device_step::DeviceAmp;
    use wick_train::amp::graph_step::GraphStep;
    use wick_train::amp::GradScalerConfig;
    if args.mode == Mode::Eval {
        return graph_eval(args, name, sizes, engine);
    }
    let device = engine.device().clone();
    let autocast = if args.mode == Mode::Amp { Autocast::bf16() } else { Autocast::off() };
    let make = || -> Result<(Bench, DeviceAmp)> {
        let bench = build(name, sizes, &args.set, autocast.model_dtype(), &device)?;
        let start = f32_start(name, (sizes, &args.set), autocast, &device)?;
        let scaler = autocast.needs_loss_scaling().then(GradScalerConfig::default);
        let amp = DeviceAmp::new(&device, &bench.model.vars(), start.as_deref(), bench.optimizer, scaler)?;
        Ok((bench, amp))
    };
    device.synchronize()?;
    let memory_before = cuda_graph::graph_memory(&device)?;
    let (bench, amp) = make()?;
    let capture_after = if args.graph_eager { usize::MAX } else { args.warmup };
    let mut graphed = GraphStep::new(amp, &device, args.clip_grad_norm, capture_after)?;
    // The benchmark's batch is the same every step: the step reads it where it is.
    let forward = |_: &[Tensor]| bench.model.loss(&bench.batch).map_err(candle_core::Error::wrap);
    let (mut times, mut host, mut losses, mut own) = (Vec::new(), Vec::new(), Vec::new(), None::<usize>);
    engine.reset_peak_memory_stats();
    for step in 0..args.warmup + args.steps {
        // The last warm-up step's own tensors at their peak in wick's pool: what the graph's
        // pool will hold.
        let before = (step + 1 == args.warmup).then(|| {
            engine.reset_peak_memory_stats();
            engine.allocated().bytes
        });
        let start = Instant::now();
        graphed.step(&[], &forward)?;
        let issued = start.elapsed();
        device.synchronize()?;
        if let Some(before) = before {
            own = engine.peak_allocated().map(|p| p.bytes.saturating_sub(before));
        }
        if step >= args.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
            host.push(issued.as_secs_f64() * 1e3);
        }
        if args.check_graph || step + 1 == args.warmup + args.steps {
            losses.push(graphed.last_loss()?);
        }
    }
    let memory = cuda_graph::graph_memory(&device)?;
    graphed.account(engine)?;
    let report = engine.memory_report();
    let graph_line = report.holdings.iter().find(|h| h.what == wick_train::amp::graph_step::GRAPH_MEMORY);
    let shape = graphed.graph().map(|g| g.shape());
    let mut line = json!({
        "model": name,
        "mode": format!("{:?}", args.mode).to_lowercase(),
        "cuda_graph": match (graphed.graph().is_some(), args.graph_eager) {
            (true, _) => "replayed",
            (false, true) => "eager (--graph-eager)",
            (false, false) => "eager (refused)",
        },
        "refused": graphed.refused(),
        "ms": times,
        "host_ms": host,
        "loss": losses.last(),
        "graph": shape.map(|s| json!({
            "nodes": s.nodes, "kernels": s.kernels, "copies": s.copies, "allocations": s.allocations,
            "frees": s.frees, "allocated_bytes": s.allocated_bytes,
        })),
        "graph_memory_reserved": memory.reserved,
        "warmup_own_peak": own,
        "graph_pool_over_own": own.filter(|o| *o > 0).map(|o| memory.reserved as f64 / o as f64),
        "graph_memory_reserved_high": memory.reserved_high,
        "report_line": graph_line.map(|h| format!("{}: {} bytes", h.what, h.bytes)),
        "device": engine.name(),
        "peak_allocated": engine.max_memory_allocated(),
    });
    if args.check_graph {
        let (twin, mut amp) = make()?;
        let mut eager = Vec::new();
        for _ in 0..args.warmup + args.steps {
            let loss = twin.model.loss(&twin.batch)?;
            eager.push(loss.to_dtype(DType::F32)?.reshape(1)?.to_vec1::<f32>()?[0]);
            let grads = amp.scale_loss(&loss)?.backward()?;
            let unscaled = amp.unscale(&grads)?;
            drop(grads);
            amp.apply(unscaled, args.clip_grad_norm)?;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let same_losses = bits(&losses) == bits(&eager);
        let (mut same_params, mut worst) = (true, 0.0f64);
        for (a, b) in bench.model.vars().iter().zip(twin.model.vars().iter()) {
            let (x, y) = (host_values(a.as_tensor())?, host_values(b.as_tensor())?);
            same_params &= x.iter().map(|v| v.to_bits()).eq(y.iter().map(|v| v.to_bits()));
            worst = worst.max(max_rel_err(&x, &y));
        }
        // A refused capture ran every step eagerly: the same bits prove nothing then.
        let captured = graphed.graph().is_some();
        drop(graphed);
        drop(bench);
        cuda_graph::trim(&device)?;
        let after = cuda_graph::graph_memory(&device)?;
        let back = after.reserved <= memory_before.reserved && after.used <= memory_before.used;
        let ok = captured && same_losses && same_params && back;
        line["check_graph"] = json!(if ok { "pass" } else { "FAIL" });
        line["eager_losses"] = json!(eager);
        line["graph_losses"] = json!(losses);
        line["params_same_bits"] = json!(same_params);
        line["params_max_rel_err"] = json!(worst);
        line["graph_memory_after_drop"] = json!(after.reserved);
        line["graph_memory_before"] = json!(memory_before.reserved);
        println!("{line}");
        if !ok {
            bail!(
                "{name}: the step was not captured, the replayed steps differ from the eager ones, or the graph's \
                 memory was not given back"
            );
        }
        return Ok(());
    }
    println!("{line}");
    Ok(())
}

/// `--cuda-graph --mode eval`: the forward pass in evaluation (`no_grad`, batch norm on its
/// running statistics) through `wick::cuda_graph::GraphForward` — eagerly for `--warmup` calls,
/// then captured and replayed for `--steps`, the batch copied in and the output copied out; prints
/// the times, the host's time to issue each call, the graph's nodes, or why it was refused. With
/// `--check-graph`, every replayed output must be the eager forward pass's bits, and the device's
/// graph memory back where it was once the graph is dropped.
#[cfg(feature = "cuda")]
fn graph_eval(args: &Args, name: &str, sizes: Sizes, engine: &wick::Engine) -> Result<()> {
    use anyhow::Context;
    use wick::cuda_graph::{self, GraphForward};
    use wick_zoo::registry::ZooModel;
    let device = engine.device().clone();
    device.synchronize()?;
    let memory_before = cuda_graph::graph_memory(&device)?;
    let bench = build(name, sizes, &args.set, DType::F32, &device)?;
    let inputs = ZooModel::batch_tensors(&bench.eval).context("a zoo batch is tensors")?;
    let capture_after = if args.graph_eager { usize::MAX } else { args.warmup };
    let mut graphed = GraphForward::new(&device, capture_after)?;
    let forward = |given: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
        let batch = ZooModel::batch_with(&bench.eval, given).map_err(wick_nn::to_candle)?;
        Ok(vec![wick_nn::no_grad(|| bench.model.forward(&batch)).map_err(wick_nn::to_candle)?])
    };
    let eager = match args.check_graph {
        true => Some(host_values(&wick_nn::no_grad(|| bench.model.forward(&bench.eval))?)?),
        false => None,
    };
    let (mut times, mut host, mut same, mut own) = (Vec::new(), Vec::new(), true, None::<usize>);
    engine.reset_peak_memory_stats();
    for step in 0..args.warmup + args.steps {
        // The last warm-up step's own tensors at their peak in wick's pool: what the graph's
        // pool will hold.
        let before = (step + 1 == args.warmup).then(|| {
            engine.reset_peak_memory_stats();
            engine.allocated().bytes
        });
        let start = Instant::now();
        let out = graphed.run(&inputs, &forward)?;
        let issued = start.elapsed();
        device.synchronize()?;
        if let Some(before) = before {
            own = engine.peak_allocated().map(|p| p.bytes.saturating_sub(before));
        }
        if step >= args.warmup {
            times.push(start.elapsed().as_secs_f64() * 1e3);
            host.push(issued.as_secs_f64() * 1e3);
        }
        if let (Some(eager), Some(out)) = (&eager, out.first()) {
            let got = host_values(out)?;
            same &= got.len() == eager.len() && got.iter().zip(eager).all(|(a, b)| a.to_bits() == b.to_bits());
        }
    }
    let shape = graphed.graph().map(|g| g.shape());
    let memory = cuda_graph::graph_memory(&device)?;
    let mut line = json!({
        "model": name,
        "mode": "eval",
        "cuda_graph": match (graphed.graph().is_some(), args.graph_eager) {
            (true, _) => "replayed",
            (false, true) => "eager (--graph-eager)",
            (false, false) => "eager (refused)",
        },
        "refused": graphed.refused(),
        "ms": times,
        "host_ms": host,
        "graph": shape.map(|s| json!({
            "nodes": s.nodes, "kernels": s.kernels, "copies": s.copies, "allocations": s.allocations,
            "frees": s.frees, "allocated_bytes": s.allocated_bytes,
        })),
        "graph_memory_reserved": memory.reserved,
        "warmup_own_peak": own,
        "graph_pool_over_own": own.filter(|o| *o > 0).map(|o| memory.reserved as f64 / o as f64),
        "device": engine.name(),
        "peak_allocated": engine.max_memory_allocated(),
    });
    if eager.is_some() {
        let captured = graphed.graph().is_some();
        drop(graphed);
        drop(bench);
        cuda_graph::trim(&device)?;
        let after = cuda_graph::graph_memory(&device)?;
        let back = after.reserved <= memory_before.reserved && after.used <= memory_before.used;
        let ok = captured && same && back;
        line["check_graph"] = json!(if ok { "pass" } else { "FAIL" });
        line["outputs_same_bits"] = json!(same);
        line["graph_memory_after_drop"] = json!(after.reserved);
        line["graph_memory_before"] = json!(memory_before.reserved);
        println!("{line}");
        if !ok {
            bail!("{name} (eval): not captured, replayed outputs differ from the eager pass, or memory not given back");
        }
        return Ok(());
    }
    println!("{line}");
    Ok(())
}

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

/// The timed calls' milliseconds, the host's milliseconds to issue each, and the last warm-up
/// call's own tensors at their peak in wick's pool (what the graph's pool will hold).
#[cfg(feature = "cuda")]
#[derive(Default)]
struct Timing {
    ms: Vec<f64>,
    host_ms: Vec<f64>,
    own: Option<usize>,
}

#[cfg(feature = "cuda")]
impl Timing {
    /// Before call `step`: its start, and before the last warm-up call the pool's figure.
    fn begin(&self, args: &Args, engine: &wick::Engine, step: usize) -> (Instant, Option<usize>) {
        let before = (step + 1 == args.warmup).then(|| {
            engine.reset_peak_memory_stats();
            engine.allocated().bytes
        });
        (Instant::now(), before)
    }

    /// After call `step` was issued: the device waited for, and the figures taken.
    fn end(
        &mut self,
        (start, before): (Instant, Option<usize>),
        args: &Args,
        engine: &wick::Engine,
        step: usize,
    ) -> Result<()> {
        let issued = start.elapsed();
        engine.device().synchronize()?;
        if let Some(before) = before {
            self.own = engine.peak_allocated().map(|p| p.bytes.saturating_sub(before));
        }
        if step >= args.warmup {
            self.ms.push(start.elapsed().as_secs_f64() * 1e3);
            self.host_ms.push(issued.as_secs_f64() * 1e3);
        }
        Ok(())
    }
}

/// The JSON line's fields common to a graphed step and a graphed forward pass: what ran (replayed,
/// eager by `--graph-eager`, or eager after a refusal, and why), the times, the graph's nodes, the
/// device's graph memory beside the last warm-up call's own peak, the peak allocated.
#[cfg(feature = "cuda")]
fn result_line<K: PartialEq + std::fmt::Debug, T>(
    name: &str,
    args: &Args,
    shapes: &wick::cuda_graph::shapes::Shapes<K, T>,
    timing: &Timing,
    engine: &wick::Engine,
) -> Result<serde_json::Value> {
    let memory = wick::cuda_graph::graph_memory(engine.device())?;
    let shape = shapes.graph().map(|g| g.shape());
    Ok(json!({
        "model": name,
        "mode": format!("{:?}", args.mode).to_lowercase(),
        "cuda_graph": match (shape.is_some(), args.graph_eager) {
            (true, _) => "replayed",
            (false, true) => "eager (--graph-eager)",
            (false, false) => "eager (refused)",
        },
        "refused": shapes.refused(),
        "ms": timing.ms,
        "host_ms": timing.host_ms,
        "graph": shape.map(|s| json!({
            "nodes": s.nodes, "kernels": s.kernels, "copies": s.copies, "allocations": s.allocations,
            "frees": s.frees, "allocated_bytes": s.allocated_bytes,
        })),
        "graph_memory_reserved": memory.reserved,
        "graph_memory_reserved_high": memory.reserved_high,
        "warmup_own_peak": timing.own,
        "graph_pool_over_own": timing.own.filter(|o| *o > 0).map(|o| memory.reserved as f64 / o as f64),
        "device": engine.name(),
        "peak_allocated": engine.max_memory_allocated(),
    }))
}

/// Whether the device's graph memory is back where it was (`before`) once the graphs are
/// dropped and the pool trimmed; both figures go into `line`.
#[cfg(feature = "cuda")]
fn memory_back(
    device: &candle_core::Device,
    before: &wick::cuda_graph::GraphMemory,
    line: &mut serde_json::Value,
) -> Result<bool> {
    wick::cuda_graph::trim(device)?;
    let after = wick::cuda_graph::graph_memory(device)?;
    line["graph_memory_after_drop"] = json!(after.reserved);
    line["graph_memory_before"] = json!(before.reserved);
    Ok(after.reserved <= before.reserved && after.used <= before.used)
}

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
    let (mut timing, mut losses) = (Timing::default(), Vec::new());
    engine.reset_peak_memory_stats();
    for step in 0..args.warmup + args.steps {
        let mark = timing.begin(args, engine, step);
        graphed.step(&[], &forward)?;
        timing.end(mark, args, engine, step)?;
        if args.check_graph || step + 1 == args.warmup + args.steps {
            losses.push(graphed.last_loss()?);
        }
    }
    let mut line = result_line(name, args, graphed.shapes(), &timing, engine)?;
    graphed.account(engine)?;
    let report = engine.memory_report();
    let graph_line = report.holdings.iter().find(|h| h.what == wick_train::amp::graph_step::GRAPH_MEMORY);
    line["loss"] = json!(losses.last());
    line["report_line"] = json!(graph_line.map(|h| format!("{}: {} bytes", h.what, h.bytes)));
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
        let captured = graphed.shapes().graph().is_some();
        drop(graphed);
        drop(bench);
        let back = memory_back(&device, &memory_before, &mut line)?;
        let ok = captured && same_losses && same_params && back;
        line["check_graph"] = json!(if ok { "pass" } else { "FAIL" });
        line["eager_losses"] = json!(eager);
        line["graph_losses"] = json!(losses);
        line["params_same_bits"] = json!(same_params);
        line["params_max_rel_err"] = json!(worst);
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
    let (mut timing, mut same) = (Timing::default(), true);
    engine.reset_peak_memory_stats();
    for step in 0..args.warmup + args.steps {
        let mark = timing.begin(args, engine, step);
        let out = graphed.run(&inputs, &forward)?;
        timing.end(mark, args, engine, step)?;
        if let (Some(eager), Some(out)) = (&eager, out.first()) {
            let got = host_values(out)?;
            same &= got.len() == eager.len() && got.iter().zip(eager).all(|(a, b)| a.to_bits() == b.to_bits());
        }
    }
    let mut line = result_line(name, args, graphed.shapes(), &timing, engine)?;
    if eager.is_some() {
        let captured = graphed.shapes().graph().is_some();
        drop(graphed);
        drop(bench);
        let back = memory_back(&device, &memory_before, &mut line)?;
        let ok = captured && same && back;
        line["check_graph"] = json!(if ok { "pass" } else { "FAIL" });
        line["outputs_same_bits"] = json!(same);
        println!("{line}");
        if !ok {
            bail!("{name} (eval): not captured, replayed outputs differ from the eager pass, or memory not given back");
        }
        return Ok(());
    }
    println!("{line}");
    Ok(())
}

//! GPU check of the fused AMP kernels and the optimizer's step: each kernel against its CPU
//! reference (`wick_kernels::reference`, `wick_kernels::cpu::optim`) on random data, with NaN
//! and inf cases. Prints one line per
//! check and exits non-zero if any fails. Run by `scripts/gpu-check.sh`.
//!
//! Only copies and the AMP kernels run on the device (dtype conversions happen on the host), so
//! this check also runs from binaries whose candle kernels were not compiled
//! (`scripts/build-gpu-binaries.sh` without a real nvcc for candle).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use wick_kernels::reference::{unscale_and_check, update_scale, ScaleState};
use wick_nn::params::normal_tensor;
use wick_train::amp::cuda::{AmpKernels, StepItem};
use wick_train::optim::{AdamW, Optimizer};

/// `values` in `dtype` on `dev` (converted on the host).
fn upload(values: &[f32], dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::new(values, &Device::Cpu)?.to_dtype(dtype)?.to_device(dev)?)
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// Largest |a - b| / (1 + |b|) over finite pairs; NaN/inf must match exactly in kind.
fn max_rel_err(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            if x.is_finite() && y.is_finite() {
                (x - y).abs() / (1.0 + y.abs())
            } else if (x.is_nan() && y.is_nan()) || x == y {
                0.0
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max)
}

/// The tolerance of a result stored in `dtype` (half an ulp relative, with margin).
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 8e-3,
        DType::F16 => 1e-3,
        _ => 1e-6,
    }
}

fn check(name: &str, ok: bool, detail: String, failures: &mut usize) {
    println!("{} {name}: {detail}", if ok { "PASS" } else { "FAIL" });
    if !ok {
        *failures += 1;
    }
}

fn run() -> Result<()> {
    let engine = wick::Engine::cuda(0, None).context("opening cuda:0")?;
    let dev = engine.device().clone();
    let kernels = AmpKernels::load(&dev)?;
    let mut failures = 0;
    let scalar = |v: f32| Tensor::new(&[v], &dev);

    // Unscale + inf check: three tensors per dtype, clean, then with a NaN, then with an inf.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for case in ["finite", "nan", "inf"] {
            let lens = [1usize, 1000, 100_003];
            let mut cpu: Vec<Vec<f32>> = Vec::new();
            let mut gpu = Vec::new();
            for (i, n) in lens.iter().enumerate() {
                let t = (normal_tensor(&[*n], 1.0, 40 + i as u64, DType::F32, &Device::Cpu)? * 512.0)?;
                let mut v: Vec<f32> = t.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1()?;
                if i == 2 && case != "finite" {
                    v[n / 2] = if case == "nan" { f32::NAN } else { f32::INFINITY };
                }
                gpu.push(upload(&v, dtype, &dev)?);
                cpu.push(v);
            }
            let found = scalar(0.0)?;
            kernels.unscale_(&gpu.iter().collect::<Vec<_>>(), &scalar(1.0 / 1024.0)?, &found)?;
            let mut refs: Vec<&mut [f32]> = cpu.iter_mut().map(|v| v.as_mut_slice()).collect();
            let expected_inf = unscale_and_check(&mut refs, 1.0 / 1024.0);
            let got_inf = host(&found)?[0] != 0.0;
            let mut err = 0.0f32;
            for (g, c) in gpu.iter().zip(&cpu) {
                let rounded: Vec<f32> =
                    Tensor::new(c.as_slice(), &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1()?;
                err = err.max(max_rel_err(&host(g)?, &rounded));
            }
            check(
                &format!("unscale {dtype:?} {case}"),
                got_inf == expected_inf && err <= tolerance(dtype),
                format!("found_inf {got_inf} (reference {expected_inf}), max rel err {err:.2e}"),
                &mut failures,
            );
        }
    }

    // Scale update: 300 steps of a random overflow pattern, the device state against the reference.
    let (scale, tracker) = (scalar(65536.0)?, Tensor::new(&[0i32], &dev)?);
    let mut state = ScaleState { scale: 65536.0, growth_tracker: 0 };
    let mut bits = 0x9E37_79B9_7F4A_7C15u64;
    let mut agree = true;
    for _ in 0..300 {
        bits ^= bits << 13;
        bits ^= bits >> 7;
        bits ^= bits << 17;
        let overflow = bits.is_multiple_of(7);
        let flag = scalar(if overflow { 1.0 } else { 0.0 })?;
        kernels.update_scale_(&scale, &tracker, &flag, 2.0, 0.5, 5)?;
        update_scale(&mut state, overflow, 2.0, 0.5, 5);
        let tr: Vec<i32> = tracker.to_device(&Device::Cpu)?.to_vec1()?;
        agree &= host(&scale)?[0] == state.scale && tr[0] == state.growth_tracker;
    }
    check(
        "update_scale 300 steps",
        agree,
        format!("final scale {} tracker {}", state.scale, state.growth_tracker),
        &mut failures,
    );

    // The optimizer's step (`MasterWeights::step` on a CUDA device): SGD with momentum and
    // AdamW, three steps each, an f32 parameter and the f32 master of an f16 / bf16 model,
    // against the host's loops (`wick_kernels::cpu::optim`) to the bit.
    let rules = [
        Optimizer::SgdMomentum { lr: 0.05, momentum: 0.9 },
        Optimizer::AdamW(AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }),
    ];
    for rule in rules {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let n = 100_003;
            let start: Vec<f32> = normal_tensor(&[n], 0.5, 11, DType::F32, &Device::Cpu)?.to_vec1()?;
            let target = Tensor::new(start.as_slice(), &dev)?;
            let model = (dtype != DType::F32).then(|| upload(&start, dtype, &dev)).transpose()?;
            let mut state: Vec<Tensor> =
                (0..rule.states()).map(|_| Tensor::zeros(n, DType::F32, &dev)).collect::<Result<_, _>>()?;
            let (mut p, mut cs) = (start.clone(), vec![vec![0f32; n]; rule.states()]);
            let mut same = true;
            for step in 1..=3 {
                let g: Vec<f32> = normal_tensor(&[n], 1.0, 90 + step as u64, DType::F32, &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?
                    .to_vec1()?;
                let grad = upload(&g, dtype, &dev)?;
                if step == 2 {
                    // The state beside the old once, in place (as `MasterWeights::step` runs it)
                    // the other steps.
                    let next: Vec<Tensor> =
                        (0..rule.states()).map(|_| Tensor::zeros(n, DType::F32, &dev)).collect::<Result<_, _>>()?;
                    kernels.optimizer_step_(&target, &grad, (&state, &next), model.as_ref(), rule, step)?;
                    state = next;
                } else {
                    kernels.optimizer_step_(&target, &grad, (&state, &state), model.as_ref(), rule, step)?;
                }
                let mut new: Vec<Vec<f32>> = vec![vec![0f32; n]; rule.states()];
                match rule {
                    Optimizer::SgdMomentum { lr, momentum } => {
                        let (old, out) = (&cs[0], &mut new[0]);
                        wick_kernels::cpu::optim::sgd_momentum(&mut p, &g, old, out, (lr, momentum), 1.0);
                    }
                    Optimizer::AdamW(hyper) => {
                        let (m_new, v_new) = new.split_at_mut(1);
                        let moments = (&mut m_new[0][..], &mut v_new[0][..]);
                        wick_kernels::cpu::optim::adamw(&mut p, &g, (&cs[0], &cs[1]), moments, &hyper, step, 1.0);
                    }
                }
                cs = new;
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                same &= bits(&host(&target)?) == bits(&p);
                for (d, c) in state.iter().zip(&cs) {
                    same &= bits(&host(d)?) == bits(c);
                }
                if let Some(m) = &model {
                    let rounded: Vec<f32> =
                        Tensor::new(p.as_slice(), &Device::Cpu)?.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1()?;
                    same &= bits(&host(m)?) == bits(&rounded);
                }
            }
            let err = max_rel_err(&host(&target)?, &p);
            check(
                &format!("optimizer step {rule:?} {dtype:?}"),
                same,
                format!("3 steps, the host's to the bit: {same} (max rel err {err:.2e})"),
                &mut failures,
            );
        }
    }
    // The multi-tensor step (what `MasterWeights::step` runs on a device): three parameters of
    // different lengths per dtype, f32 and bf16 in one call (one launch each), two steps (the
    // second with a gradient-clipping coefficient), against the host's loops to the bit.
    for rule in rules {
        let lens = [1usize, 1000, 70_001];
        let mut targets = Vec::new();
        let mut models = Vec::new();
        let mut states = Vec::new();
        let mut hosts = Vec::new();
        for (k, dtype) in [DType::F32, DType::BF16].into_iter().flat_map(|d| lens.map(|n| (n, d))).enumerate() {
            let (n, dtype) = dtype;
            let start: Vec<f32> = normal_tensor(&[n], 0.5, 200 + k as u64, DType::F32, &Device::Cpu)?.to_vec1()?;
            targets.push(Tensor::new(start.as_slice(), &dev)?);
            models.push((dtype != DType::F32).then(|| upload(&start, dtype, &dev)).transpose()?);
            states.push((0..rule.states()).map(|_| Tensor::zeros(n, DType::F32, &dev)).collect::<Result<Vec<_>, _>>()?);
            hosts.push((start, vec![vec![0f32; n]; rule.states()], dtype));
        }
        let mut same = true;
        for step in 1..=2i32 {
            // The second step with a gradient-clipping coefficient folded in.
            let factor = if step == 2 { 0.37f32 } else { 1.0 };
            let mut grads = Vec::new();
            for (k, (p, cs, dtype)) in hosts.iter_mut().enumerate() {
                let n = p.len();
                let g: Vec<f32> =
                    normal_tensor(&[n], 1.0, 300 + 10 * step as u64 + k as u64, DType::F32, &Device::Cpu)?
                        .to_dtype(*dtype)?
                        .to_dtype(DType::F32)?
                        .to_vec1()?;
                grads.push(upload(&g, *dtype, &dev)?);
                let mut new: Vec<Vec<f32>> = vec![vec![0f32; n]; rule.states()];
                match rule {
                    Optimizer::SgdMomentum { lr, momentum } => {
                        wick_kernels::cpu::optim::sgd_momentum(p, &g, &cs[0], &mut new[0], (lr, momentum), factor)
                    }
                    Optimizer::AdamW(hyper) => {
                        let (m_new, v_new) = new.split_at_mut(1);
                        let moments = (&mut m_new[0][..], &mut v_new[0][..]);
                        wick_kernels::cpu::optim::adamw(p, &g, (&cs[0], &cs[1]), moments, &hyper, step, factor);
                    }
                }
                *cs = new;
            }
            let items: Vec<StepItem<'_>> = (0..targets.len())
                .map(|k| StepItem {
                    target: &targets[k],
                    grad: &grads[k],
                    state: &states[k],
                    model: models[k].as_ref(),
                })
                .collect();
            kernels.optimizer_step_multi_(&items, rule, step, None, factor)?;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (k, (p, cs, dtype)) in hosts.iter().enumerate() {
            same &= bits(&host(&targets[k])?) == bits(p);
            for (d, c) in states[k].iter().zip(cs) {
                same &= bits(&host(d)?) == bits(c);
            }
            if let Some(m) = &models[k] {
                let rounded: Vec<f32> =
                    Tensor::new(p.as_slice(), &Device::Cpu)?.to_dtype(*dtype)?.to_dtype(DType::F32)?.to_vec1()?;
                same &= bits(&host(m)?) == bits(&rounded);
            }
        }
        check(
            &format!("optimizer step, multi-tensor {rule:?}"),
            same,
            format!(
                "6 parameters (f32 and bf16, 1 to 70 001 elements), 2 steps (one clipped), the host's to the bit: {same}"
            ),
            &mut failures,
        );
        // A third step with the loss scaler's flag raised on the device changes nothing.
        let snapshot = |ts: &[Tensor]| ts.iter().map(|t| Ok(bits(&host(t)?))).collect::<Result<Vec<_>>>();
        let (before, before_states) = (snapshot(&targets)?, snapshot(&states.concat())?);
        let grads: Vec<Tensor> = targets
            .iter()
            .zip(&models)
            .map(|(t, m)| Ok(Tensor::ones(t.elem_count(), m.as_ref().map_or(DType::F32, |m| m.dtype()), &dev)?))
            .collect::<Result<_>>()?;
        let items: Vec<StepItem<'_>> = (0..targets.len())
            .map(|k| StepItem { target: &targets[k], grad: &grads[k], state: &states[k], model: models[k].as_ref() })
            .collect();
        kernels.optimizer_step_multi_(&items, rule, 3, Some(&Tensor::new(&[1f32], &dev)?), 1.0)?;
        let unchanged = snapshot(&targets)? == before && snapshot(&states.concat())? == before_states;
        check(
            &format!("optimizer step, multi-tensor {rule:?}, the inf flag raised"),
            unchanged,
            format!("parameters and state unchanged: {unchanged}"),
            &mut failures,
        );
    }
    // Gradient clipping's squared norm in one launch per dtype against the host's f64 sum of the
    // same values (f32 and bf16 tensors of 1 to 70 001 elements, and an empty one).
    let mut grads = Vec::new();
    let mut want = 0.0f64;
    for (k, (n, dtype)) in
        [DType::F32, DType::BF16].into_iter().flat_map(|d| [0usize, 1, 1000, 70_001].map(|n| (n, d))).enumerate()
    {
        let g: Vec<f32> = normal_tensor(&[n], 2.0, 500 + k as u64, DType::F32, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        want += wick_kernels::cpu::optim::sum_of_squares(&g);
        grads.push(upload(&g, dtype, &dev)?);
    }
    let refs: Vec<&Tensor> = grads.iter().collect();
    let got = kernels.squares_multi(&refs)?;
    let again = kernels.squares_multi(&refs)?;
    let rel = (got - want).abs() / want;
    check(
        "squared gradient norm, multi-tensor",
        rel <= 1e-12 && got.to_bits() == again.to_bits(),
        format!(
            "{got} vs the host's {want} (rel err {rel:.1e}), the same bits twice: {}",
            got.to_bits() == again.to_bits()
        ),
        &mut failures,
    );
    // Its time beside the composed update it replaced (the dozen tensor ops `MasterWeights::step`
    // ran on a device before), AdamW on 25 M f32 parameters (BERT-base's largest share): the
    // fused step in place, as the trainer runs it.
    let n = 25 << 20;
    let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let (p, g) = (Tensor::zeros(n, DType::F32, &dev)?, Tensor::ones(n, DType::F32, &dev)?);
    let st = vec![Tensor::zeros(n, DType::F32, &dev)?, Tensor::zeros(n, DType::F32, &dev)?];
    let time = |f: &mut dyn FnMut(i32) -> Result<()>| -> Result<f64> {
        f(1)?;
        dev.synchronize()?;
        let t = std::time::Instant::now();
        for step in 2..12 {
            f(step)?;
        }
        dev.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 100.0)
    };
    let fused =
        time(&mut |step| Ok(kernels.optimizer_step_(&p, &g, (&st, &st), None, Optimizer::AdamW(hyper), step)?))?;
    let mut master = p.copy()?;
    let mut cs = vec![Tensor::zeros(n, DType::F32, &dev)?, Tensor::zeros(n, DType::F32, &dev)?];
    let composed = time(&mut |step| {
        let m = ((&cs[0] * hyper.beta1)? + (&g * (1.0 - hyper.beta1))?)?;
        let v = ((&cs[1] * hyper.beta2)? + (g.sqr()? * (1.0 - hyper.beta2))?)?;
        let m_hat = (&m / (1.0 - hyper.beta1.powi(step)))?;
        let v_hat = (&v / (1.0 - hyper.beta2.powi(step)))?;
        let decayed = (&master * (1.0 - hyper.lr * hyper.weight_decay))?;
        master = (decayed - ((m_hat / (v_hat.sqrt()? + hyper.eps)?)? * hyper.lr)?)?;
        cs = vec![m, v];
        Ok(())
    })?;
    println!(
        "TIME optimizer step AdamW 25 M f32: fused {fused:.3} ms, composed {composed:.3} ms ({:.1}x)",
        composed / fused
    );
    scaler_on_device(&dev, &mut failures)?;
    clipped_step_on_device(&dev, &mut failures)?;
    if failures > 0 {
        bail!("{failures} AMP kernel check(s) failed");
    }
    println!("all AMP and optimizer kernel checks passed");
    Ok(())
}

/// The trainer's loss scaler on device gradients (`GradScaler::unscale`: the multi-tensor kernel
/// and one read of its flag) against the same scaler on the same gradients on the CPU: f32, f16 and
/// bf16 gradients, one a view into another's storage (copied, not unscaled twice), then an inf.
fn scaler_on_device(dev: &Device, failures: &mut usize) -> Result<()> {
    use candle_core::backprop::GradStore;
    use candle_core::Var;
    use wick_train::amp::GradScaler;
    let values: Vec<Vec<f32>> = (0..4)
        .map(|k| Ok(normal_tensor(&[1000 + 37 * k], 1e3, 60 + k as u64, DType::F32, &Device::Cpu)?.to_vec1()?))
        .collect::<Result<_>>()?;
    let dtypes = [DType::F32, DType::F16, DType::BF16, DType::F32];
    for poison in [false, true] {
        let mut outcome = Vec::new();
        for on in [&Device::Cpu, dev] {
            let vars: Vec<Var> =
                dtypes.iter().map(|&d| Ok(Var::from_tensor(&Tensor::zeros(1, d, on)?)?)).collect::<Result<_>>()?;
            let mut grads = GradStore::default();
            let mut held: Vec<Tensor> = Vec::new();
            for (i, (v, &d)) in values.iter().zip(&dtypes).enumerate() {
                let mut v = v.clone();
                if poison && i == 2 {
                    v[5] = f32::INFINITY;
                }
                let g = upload(&v, d, on)?;
                // The last gradient: a view into the first's storage.
                let g = if i == 3 { held[0].narrow(0, 3, 997)? } else { g };
                held.push(g.clone());
                grads.insert(vars[i].as_tensor(), g);
            }
            let refs: Vec<&Var> = vars.iter().collect();
            let mut scaler = GradScaler::new();
            let found = scaler.unscale(&mut grads, &refs)?;
            let unscaled = vars
                .iter()
                .map(|v| host(grads.get(v.as_tensor()).context("a gradient went missing")?))
                .collect::<Result<Vec<_>>>()?;
            outcome.push((found, unscaled));
        }
        let (cpu, gpu) = (&outcome[0], &outcome[1]);
        let err = cpu.1.iter().zip(&gpu.1).map(|(c, g)| max_rel_err(g, c)).fold(0.0, f32::max);
        let ok = cpu.0 == gpu.0 && cpu.0 == poison && (poison || err <= 1e-6);
        let what = if poison { "with an inf" } else { "finite" };
        check(
            &format!("GradScaler::unscale on the device ({what}; f32, f16, bf16 and a view)"),
            ok,
            format!("found inf: CPU {}, device {}; max rel err {err:.1e}", cpu.0, gpu.0),
            failures,
        );
    }
    Ok(())
}

/// The fused device step with gradient clipping (`DeviceAmp::unscale`, `apply` with the bound,
/// `last_step`: what `Updater` runs on a CUDA device, the norm, coefficient and AdamW's constants
/// computed on the device) against the host's clipped step
/// (`clip::grad_norm`, `MasterWeights::step_clipped`) on the same gradients: an f32 and a bf16
/// parameter with f32 masters, AdamW, three steps, without a loss scaler and with one (the
/// gradients uploaded multiplied by its initial scale). The norms and the parameters must agree;
/// then a NaN gradient must skip the step (the error's flag without a scaler) and change nothing.
fn clipped_step_on_device(dev: &Device, failures: &mut usize) -> Result<()> {
    use candle_core::backprop::GradStore;
    use candle_core::Var;
    use wick_train::amp::device_step::DeviceAmp;
    use wick_train::amp::{GradScalerConfig, MasterWeights};
    use wick_train::clip;
    let adamw = Optimizer::AdamW(AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 });
    let dtypes = [DType::F32, DType::BF16];
    let start: Vec<Vec<f32>> = (0..2)
        .map(|k| Ok(normal_tensor(&[3000 + 101 * k], 0.5, 80 + k as u64, DType::F32, &Device::Cpu)?.to_vec1()?))
        .collect::<Result<_>>()?;
    for scaled in [false, true] {
        let config = GradScalerConfig::default();
        let scale = if scaled { config.init_scale as f32 } else { 1.0 };
        let make = |on: &Device| -> Result<(Vec<Var>, Vec<Tensor>)> {
            let masters: Vec<Tensor> = start.iter().map(|v| upload(v, DType::F32, on)).collect::<Result<_>>()?;
            // Converted on the host: only copies and the AMP kernels run on the device.
            let vars = start
                .iter()
                .zip(&dtypes)
                .map(|(v, &d)| Ok(Var::from_tensor(&upload(v, d, on)?)?))
                .collect::<Result<Vec<_>>>()?;
            Ok((vars, masters))
        };
        let (dev_vars, dev_masters) = make(dev)?;
        let (cpu_vars, cpu_masters) = make(&Device::Cpu)?;
        let mut amp = DeviceAmp::new(dev, &dev_vars, Some(&dev_masters), adamw, scaled.then_some(config))?;
        let mut on_host = MasterWeights::with_masters(&cpu_vars, Some(&cpu_masters), adamw)?;
        let cpu_refs: Vec<&Var> = cpu_vars.iter().collect();
        let mut worst: (f64, f32) = (0.0, 0.0);
        for step in 0..3u64 {
            let grads: Vec<Vec<f32>> = (0..2)
                .map(|k| {
                    Ok(normal_tensor(&[3000 + 101 * k], 3.0, 90 + 7 * step + k as u64, DType::F32, &Device::Cpu)?
                        .to_vec1()?)
                })
                .collect::<Result<_>>()?;
            let (mut on_dev, mut on_cpu) = (GradStore::default(), GradStore::default());
            for (k, g) in grads.iter().enumerate() {
                let scaled_g: Vec<f32> = g.iter().map(|x| x * scale).collect();
                on_dev.insert(dev_vars[k].as_tensor(), upload(&scaled_g, dtypes[k], dev)?);
                on_cpu.insert(cpu_vars[k].as_tensor(), upload(g, dtypes[k], &Device::Cpu)?);
            }
            let unscaled = amp.unscale(&on_dev)?;
            amp.apply(unscaled, Some(1.0))?;
            let report = amp.last_step()?;
            let want = clip::grad_norm(&on_cpu, &cpu_refs)?;
            on_host.step_clipped(&on_cpu, clip::coefficient(want, 1.0))?;
            if report.skipped || report.bad_norm {
                bail!("the clipped device step was skipped on finite gradients: {report:?}");
            }
            let norm = report.norm.ok_or_else(|| anyhow::anyhow!("a clipped step reported no norm"))?;
            worst.0 = worst.0.max((norm - want).abs() / want);
        }
        // A NaN gradient: under the scaler a plain skip, without one the step's error (`bad_norm`);
        // either way nothing changes and the step count stays at the three applied steps.
        let before: Vec<Vec<f32>> = dev_vars.iter().map(|v| host(v.as_tensor())).collect::<Result<_>>()?;
        let mut nan = GradStore::default();
        for (k, v) in dev_vars.iter().enumerate() {
            let mut g = vec![0.5f32; 3000 + 101 * k];
            g[17] = f32::NAN;
            nan.insert(v.as_tensor(), upload(&g, dtypes[k], dev)?);
        }
        let unscaled = amp.unscale(&nan)?;
        amp.apply(unscaled, Some(1.0))?;
        let report = amp.last_step()?;
        let after: Vec<Vec<f32>> = dev_vars.iter().map(|v| host(v.as_tensor())).collect::<Result<_>>()?;
        let unchanged =
            before.iter().zip(&after).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
        let steps = amp.applied_steps()?;
        let what = if scaled { "with the loss scaler" } else { "no scaler" };
        check(
            &format!("a NaN gradient under clipping on the device ({what}): skipped, nothing changed, 3 steps counted"),
            report.skipped && report.bad_norm != scaled && unchanged && steps == 3,
            format!("{report:?}, parameters unchanged: {unchanged}, applied steps {steps}"),
            failures,
        );
        for (k, (d, c)) in dev_vars.iter().zip(&cpu_vars).enumerate() {
            let err = max_rel_err(&host(d.as_tensor())?, &host(c.as_tensor())?);
            worst.1 = worst.1.max(err / tolerance(dtypes[k]).max(1e-5));
        }
        check(
            &format!("clipped fused step on the device ({what}; f32 and bf16 parameters, AdamW, 3 steps)"),
            worst.0 <= 1e-6 && worst.1 <= 1.0,
            format!("norm rel err {:.1e}, parameters' error / tolerance {:.2}", worst.0, worst.1),
            failures,
        );
    }
    Ok(())
}

wick::main!(run);

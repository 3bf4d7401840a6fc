//! `--time-attention SPEC …`: attention's forward + backward time on cuda:0 at the shapes given,
//! one JSON line each, for `scripts/torch-reference/attention_speed.py`, which times PyTorch's
//! `scaled_dot_product_attention` at the same shapes in turns with this and prints both. A SPEC
//! is `B,H,S,D,MASK,DTYPE[,cores]`: MASK `causal` (wick's additive causal bias, built once, as a
//! model builds it once a pass) or `none`; DTYPE `f32`, `bf16` or `f16`; `cores` keeps f16/bf16
//! on the CUDA-core kernels instead of tensor cores. The loss is Σ y·g with g all ones, as
//! PyTorch's side.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use wick_nn::ops;
use wick_nn::params::normal_tensor;

/// One timing: the shape, its mask and dtype, and whether tensor cores may run it.
struct Spec {
    dims: [usize; 4],
    causal: bool,
    dtype: DType,
    tensor_cores: bool,
}

fn parse(spec: &str) -> Result<Spec> {
    let parts: Vec<&str> = spec.split(',').collect();
    if parts.len() < 6 || parts.len() > 7 {
        bail!("{spec:?}: want B,H,S,D,MASK,DTYPE[,cores]");
    }
    let mut dims = [0usize; 4];
    for (d, p) in dims.iter_mut().zip(&parts) {
        *d = p.parse().with_context(|| format!("{spec:?}: {p:?} is not a size"))?;
        if *d == 0 {
            bail!("{spec:?}: sizes start at 1");
        }
    }
    let causal = match parts[4] {
        "causal" => true,
        "none" => false,
        other => bail!("{spec:?}: mask {other:?} (causal or none)"),
    };
    let dtype = match parts[5] {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("{spec:?}: dtype {other:?} (f32, bf16 or f16)"),
    };
    let tensor_cores = match parts.get(6) {
        None => true,
        Some(&"cores") => false,
        Some(other) => bail!("{spec:?}: {other:?} (only `cores`)"),
    };
    Ok(Spec { dims, causal, dtype, tensor_cores })
}

/// Milliseconds a forward + backward pass, over `passes` after three of warm-up.
fn time(spec: &Spec, dev: &Device, passes: usize) -> Result<f64> {
    let [b, h, s, d] = spec.dims;
    let vars = (0..3)
        .map(|i| Var::from_tensor(&normal_tensor(&[b, h, s, d], 1.0, 70 + i, spec.dtype, dev)?))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let bias = if spec.causal { Some(ops::causal_bias(s, spec.dtype, dev)?) } else { None };
    let g = Tensor::ones((b, h, s, d), spec.dtype, dev)?;
    per_pass_ms(dev, passes, || {
        let y = ops::attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), bias.as_ref())?;
        drop((y * &g)?.sum_all()?.backward()?);
        Ok(())
    })
}

/// Milliseconds a `pass` takes on `dev`, over `passes` of them after three of warm-up, the device
/// synchronised before the clock starts and before it stops (every timing of this tool).
pub(crate) fn per_pass_ms(dev: &Device, passes: usize, mut pass: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        pass()?;
    }
    dev.synchronize()?;
    let start = Instant::now();
    for _ in 0..passes {
        pass()?;
    }
    dev.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / passes as f64)
}

/// Times every spec on `dev`, a JSON line each (an error line for one that fails; the others run).
pub(crate) fn run(specs: &[String], dev: &Device) -> Result<()> {
    for text in specs {
        let spec = parse(text)?;
        use_tensor_cores(spec.tensor_cores);
        match time(&spec, dev, 20) {
            Ok(ms) => println!("{{\"spec\":\"{text}\",\"ms\":{ms:.4}}}"),
            Err(e) => println!("{{\"spec\":\"{text}\",\"error\":\"{}\"}}", format!("{e:#}").replace('"', "'")),
        }
    }
    use_tensor_cores(true);
    Ok(())
}

/// Lets f16/bf16 attention run on tensor cores or keeps it on the CUDA-core kernels (a build
/// without CUDA has neither: nothing to set).
pub(crate) fn use_tensor_cores(on: bool) {
    #[cfg(feature = "cuda")]
    wick_nn::native::cuda::attention::set_tensor_cores(on);
    #[cfg(not(feature = "cuda"))]
    let _ = on;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let s = parse("8,12,512,64,causal,bf16").unwrap();
        assert_eq!((s.dims, s.causal, s.dtype, s.tensor_cores), ([8, 12, 512, 64], true, DType::BF16, true));
        let s = parse("2,4,9,100,none,f16,cores").unwrap();
        assert_eq!((s.dims, s.causal, s.dtype, s.tensor_cores), ([2, 4, 9, 100], false, DType::F16, false));
        for (bad, says) in [
            ("8,12,512,64,causal", "want B,H,S,D"),
            ("8,12,x,64,causal,f32", "not a size"),
            ("8,0,512,64,causal,f32", "start at 1"),
            ("8,12,512,64,diag,f32", "mask"),
            ("8,12,512,64,none,f64", "dtype"),
            ("8,12,512,64,none,bf16,tensor", "only `cores`"),
        ] {
            let e = parse(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_spec_times_on_the_cpu_too() {
        let ms = time(&parse("1,2,40,16,causal,f32").unwrap(), &Device::Cpu, 2).unwrap();
        assert!(ms > 0.0 && ms.is_finite(), "{ms}");
    }
}

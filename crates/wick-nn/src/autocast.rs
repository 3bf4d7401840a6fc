//! The autocast policy: which dtype each kind of op computes in under mixed precision (the
//! switch itself is [`Autocast`]).
//!
//! The op classes are PyTorch's (the `torch.amp` documentation's lists): matmul, linear and
//! convolution compute in the AMP dtype (bf16 or f16), where tensor cores and half-width memory
//! pay off; softmax, the norms, exp/log, reductions and every loss compute in f32
//! ([`fp32_compute`]), where half precision overflows or loses the small terms of long sums;
//! element-wise ops, reshapes, pooling and embeddings run in their input's dtype. The ops of this
//! crate apply the classes themselves — each f32-class op widens its inputs with
//! [`fp32_compute`], each convolution asks `conv_compute` — so these functions are the policy's
//! one source of truth.
//!
//! How the models apply it. The switch is the model's dtype: a model built in bf16 or f16 holds
//! its per-step compute copies in that dtype (the f32 masters live in
//! `wick_train::amp::MasterWeights`), low-precision ops run natively, and every f32-class op
//! computes in f32 and returns its result in the activation dtype. The saved activations stay in
//! the low-precision dtype (that is where AMP's memory saving comes from); the result is the f32
//! computation rounded once, exactly as PyTorch rounds an f32 softmax or layer-norm output when
//! the next matmul casts it. Losses return f32.
//!
//! Normalisation parameters stay f32 in a low-precision model ([`norm_param_dtype`]).
//!
//! Numerical safety: masks are additive and finite (`-1e4`, never `f32::MIN`, which is `-inf` in
//! f16 and turns a fully masked row into NaN); mean pooling and normalisation reduce in f32.
//!
//! **CPU fallback**: candle has no bf16 `conv2d` on the CPU, so under bf16 autocast on the CPU a
//! convolution computes in f32 (inputs cast up, output cast back) instead of failing; it still
//! saves only its bf16 input. f16 convolutions and every CUDA convolution run natively.

use candle_core::{DType, Device};

use crate::error::NnError;

fn rank(dtype: DType) -> u8 {
    match dtype {
        DType::F64 => 4,
        DType::F32 => 3,
        DType::BF16 | DType::F16 => 2,
        _ => 1,
    }
}

/// The widest of `dtypes` (f64 > f32 > bf16/f16; between bf16 and f16, the first given).
pub(crate) fn widest(dtypes: &[DType]) -> DType {
    dtypes
        .iter()
        .copied()
        .fold(None, |acc: Option<DType>, d| match acc {
            Some(a) if rank(a) >= rank(d) => Some(a),
            _ => Some(d),
        })
        .unwrap_or(DType::F32)
}

/// The mixed-precision switch: the dtype of low-precision compute, or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autocast {
    dtype: Option<DType>,
}

impl Autocast {
    /// Autocast to `dtype` (bf16 or f16); f32 turns it off. Anything else is an error.
    pub fn new(dtype: DType) -> Result<Self, NnError> {
        match dtype {
            DType::BF16 | DType::F16 => Ok(Autocast { dtype: Some(dtype) }),
            DType::F32 => Ok(Autocast::off()),
            other => Err(NnError::Invalid {
                what: "autocast".into(),
                message: format!("autocast dtype must be bf16, f16 or f32 (off), not {other:?}"),
            }),
        }
    }

    /// Parses "bf16", "f16"/"fp16" or "off"/"f32"/"fp32".
    pub fn parse(name: &str) -> Result<Self, NnError> {
        match name.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Autocast::bf16()),
            "f16" | "fp16" | "half" | "float16" => Ok(Autocast::f16()),
            "off" | "f32" | "fp32" | "float32" | "none" => Ok(Autocast::off()),
            other => Err(NnError::Invalid {
                what: "autocast".into(),
                message: format!("unknown precision `{other}` (expected bf16, f16 or off)"),
            }),
        }
    }

    /// Autocast off: everything in f32.
    pub fn off() -> Self {
        Autocast { dtype: None }
    }

    /// bf16 autocast.
    pub fn bf16() -> Self {
        Autocast { dtype: Some(DType::BF16) }
    }

    /// f16 autocast (needs a `wick_train::amp::GradScaler` for training).
    pub fn f16() -> Self {
        Autocast { dtype: Some(DType::F16) }
    }

    /// The default for a device, as in PyTorch: bf16 on the CPU, f16 on CUDA.
    pub fn default_for(device: &Device) -> Self {
        if device.is_cuda() {
            Autocast::f16()
        } else {
            Autocast::bf16()
        }
    }

    /// Whether low precision is on.
    pub fn enabled(&self) -> bool {
        self.dtype.is_some()
    }

    /// The dtype models are built in: the AMP dtype, or f32 when off.
    pub fn model_dtype(&self) -> DType {
        self.dtype.unwrap_or(DType::F32)
    }

    /// Whether losses need scaling (f16's narrow exponent range; bf16 has f32's).
    pub fn needs_loss_scaling(&self) -> bool {
        self.dtype == Some(DType::F16)
    }
}

/// The dtype of normalisation parameters (scales, shifts, running statistics) in a model built
/// in `model_dtype`: f32 under AMP, as Apex's O2 (`keep_batchnorm_fp32`) and PyTorch's autocast
/// (which never casts them) keep them. A scale near 1 moved by an optimizer step of ~1e-4 does
/// not move at all in bf16, whose resolution near 1 is 2^-8: the model would train on stale
/// norms while its f32 master drifts.
pub fn norm_param_dtype(model_dtype: DType) -> DType {
    fp32_compute(model_dtype)
}

/// The dtype an f32-class op computes in for an input of `dtype`: f32, or f64 for f64 inputs.
pub fn fp32_compute(dtype: DType) -> DType {
    widest(&[DType::F32, dtype])
}

/// The dtype a convolution with input `dtype` computes in on `device`: its own, except bf16 on
/// the CPU, which candle cannot convolve, falls back to f32.
pub(crate) fn conv_compute(dtype: DType, device: &Device) -> DType {
    if dtype == DType::BF16 && device.is_cpu() {
        DType::F32
    } else {
        dtype
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_dtypes() {
        let cpu = Device::Cpu;
        // f32-class ops widen half precision to f32 and never narrow f64 (finite differences).
        assert_eq!(fp32_compute(DType::BF16), DType::F32);
        assert_eq!(fp32_compute(DType::F16), DType::F32);
        assert_eq!(fp32_compute(DType::F64), DType::F64);
        assert_eq!(norm_param_dtype(DType::BF16), DType::F32);
        assert_eq!(norm_param_dtype(DType::F64), DType::F64);
        // Convolutions run in their own dtype, except bf16 on the CPU.
        assert_eq!(conv_compute(DType::BF16, &cpu), DType::F32, "CPU bf16 fallback");
        assert_eq!(conv_compute(DType::F16, &cpu), DType::F16);
        assert_eq!(widest(&[DType::BF16, DType::F32, DType::F16]), DType::F32);
        assert_eq!(widest(&[DType::F16, DType::BF16]), DType::F16, "the first of equal rank");
        assert_eq!(widest(&[]), DType::F32);
    }

    #[test]
    fn switch_parsing_and_errors() {
        assert_eq!(Autocast::parse("BF16").unwrap(), Autocast::bf16());
        assert_eq!(Autocast::parse("fp16").unwrap().model_dtype(), DType::F16);
        assert!(!Autocast::parse("off").unwrap().enabled());
        assert!(Autocast::parse("int8").unwrap_err().to_string().contains("unknown precision"));
        assert!(Autocast::new(DType::U8).is_err());
        assert_eq!(Autocast::default_for(&Device::Cpu), Autocast::bf16());
        assert!(Autocast::f16().needs_loss_scaling() && !Autocast::bf16().needs_loss_scaling());
    }
}

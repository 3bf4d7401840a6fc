//! The autocast policy: which dtype each kind of op computes in under mixed precision.
//!
//! The op classes are PyTorch's (the `torch.amp` documentation's lists for CUDA):
//! - **low precision** — matmul, linear, conv, bmm and the rest of the [`LOW_PRECISION_OPS`] —
//!   compute in the AMP dtype (bf16 or f16), where tensor cores and half-width memory pay off;
//! - **f32** — softmax, log_softmax, layer/group/RMS norm, exp/log/pow, sum/prod/cumsum, norms and
//!   every loss ([`FP32_OPS`]) — compute in f32, where half precision overflows or loses the
//!   small terms of long sums;
//! - **widest** — addcmul, addcdiv, cat-like ops ([`WIDEST_OPS`]) — compute in the widest dtype of
//!   their inputs;
//! - everything else (relu, add, reshape, pooling, embedding) runs in its input's dtype.
//!
//! How the zoo applies it. The switch is the model's dtype: a model built in bf16 or f16 holds
//! its per-step compute copies in that dtype (the f32 masters live in
//! [`crate::amp::MasterWeights`]), low-precision ops run natively, and every f32-class op is one
//! [`crate::fused::node`] that casts its inputs to f32, computes, and returns its result in the
//! activation dtype. The saved activations stay in the low-precision dtype (that is where AMP's
//! memory saving comes from); the result is the f32 computation rounded once, exactly as PyTorch
//! rounds an f32 softmax or layer-norm output when the next matmul casts it. Losses return f32.
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

use crate::error::ZooError;

/// PyTorch's "autocast to lower precision" ops.
pub const LOW_PRECISION_OPS: &[&str] = &[
    "matmul",
    "mm",
    "mv",
    "bmm",
    "baddbmm",
    "addbmm",
    "addmm",
    "addmv",
    "addr",
    "linear",
    "prelu",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "chain_matmul",
    "multi_dot",
    "attention",
];

/// PyTorch's "autocast to float32" ops, plus RMS norm and this crate's fused losses.
pub const FP32_OPS: &[&str] = &[
    "softmax",
    "log_softmax",
    "softmin",
    "layer_norm",
    "group_norm",
    "rms_norm",
    "batch_norm",
    "norm",
    "normalize",
    "exp",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "pow",
    "reciprocal",
    "rsqrt",
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "mean_pool",
    "softplus",
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "cosine_similarity",
];

/// PyTorch's "promote to the widest input type" ops (and cat/stack, which candle requires to
/// share a dtype).
pub const WIDEST_OPS: &[&str] =
    &["addcmul", "addcdiv", "atan2", "bilinear", "cross", "dot", "cat", "stack", "index_put", "scatter_add"];

/// How an op is treated under autocast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpClass {
    /// Computes in the AMP dtype.
    LowPrecision,
    /// Computes in f32.
    Fp32,
    /// Computes in the widest dtype among its inputs.
    Widest,
    /// Runs in its input's dtype.
    Passthrough,
}

/// The class of the op called `name` (PyTorch's op names).
pub fn op_class(name: &str) -> OpClass {
    if LOW_PRECISION_OPS.contains(&name) {
        OpClass::LowPrecision
    } else if FP32_OPS.contains(&name) {
        OpClass::Fp32
    } else if WIDEST_OPS.contains(&name) {
        OpClass::Widest
    } else {
        OpClass::Passthrough
    }
}

fn rank(dtype: DType) -> u8 {
    match dtype {
        DType::F64 => 4,
        DType::F32 => 3,
        DType::BF16 | DType::F16 => 2,
        _ => 1,
    }
}

/// The widest of `dtypes` (f64 > f32 > bf16/f16; between bf16 and f16, the first given).
pub fn widest(dtypes: &[DType]) -> DType {
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
    pub fn new(dtype: DType) -> Result<Self, ZooError> {
        match dtype {
            DType::BF16 | DType::F16 => Ok(Autocast { dtype: Some(dtype) }),
            DType::F32 => Ok(Autocast::off()),
            other => Err(ZooError::Invalid {
                what: "autocast".into(),
                message: format!("autocast dtype must be bf16, f16 or f32 (off), not {other:?}"),
            }),
        }
    }

    /// Parses "bf16", "f16"/"fp16" or "off"/"f32"/"fp32".
    pub fn parse(name: &str) -> Result<Self, ZooError> {
        match name.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Autocast::bf16()),
            "f16" | "fp16" | "half" | "float16" => Ok(Autocast::f16()),
            "off" | "f32" | "fp32" | "float32" | "none" => Ok(Autocast::off()),
            other => Err(ZooError::Invalid {
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

    /// f16 autocast (needs a [`crate::amp::GradScaler`] for training).
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

    /// The dtype `op` computes in, given its inputs' dtypes, on `device`.
    pub fn compute_dtype(&self, op: &str, inputs: &[DType], device: &Device) -> DType {
        self.compute_dtype_for(op_class(op), op, inputs, device)
    }

    fn compute_dtype_for(&self, class: OpClass, op: &str, inputs: &[DType], device: &Device) -> DType {
        let widest_input = widest(inputs);
        match class {
            OpClass::LowPrecision => match self.dtype {
                Some(low) if rank(widest_input) <= rank(DType::F32) => {
                    if low == DType::BF16 && device.is_cpu() && op.starts_with("conv") {
                        DType::F32
                    } else {
                        low
                    }
                }
                _ => widest_input,
            },
            OpClass::Fp32 => widest(&[DType::F32, widest_input]),
            OpClass::Widest | OpClass::Passthrough => widest_input,
        }
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
pub fn conv_compute(dtype: DType, device: &Device) -> DType {
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
    fn op_classes_follow_pytorch_lists() {
        for op in ["matmul", "linear", "conv2d", "bmm"] {
            assert_eq!(op_class(op), OpClass::LowPrecision, "{op}");
        }
        for op in ["softmax", "log_softmax", "layer_norm", "group_norm", "exp", "sum", "cumsum", "cross_entropy"] {
            assert_eq!(op_class(op), OpClass::Fp32, "{op}");
        }
        assert_eq!(op_class("addcmul"), OpClass::Widest);
        assert_eq!(op_class("relu"), OpClass::Passthrough);
    }

    #[test]
    fn compute_dtypes() {
        let cpu = Device::Cpu;
        let bf = Autocast::bf16();
        assert_eq!(bf.compute_dtype("matmul", &[DType::F32, DType::F32], &cpu), DType::BF16);
        assert_eq!(bf.compute_dtype("softmax", &[DType::BF16], &cpu), DType::F32);
        assert_eq!(bf.compute_dtype("conv2d", &[DType::BF16, DType::BF16], &cpu), DType::F32, "CPU bf16 fallback");
        assert_eq!(Autocast::f16().compute_dtype("conv2d", &[DType::F16], &cpu), DType::F16);
        assert_eq!(bf.compute_dtype("addcmul", &[DType::BF16, DType::F32], &cpu), DType::F32);
        assert_eq!(bf.compute_dtype("relu", &[DType::BF16], &cpu), DType::BF16);
        // Off: f32 stays f32, f64 stays f64 (finite-difference tests).
        let off = Autocast::off();
        assert_eq!(off.compute_dtype("matmul", &[DType::F32], &cpu), DType::F32);
        assert_eq!(off.compute_dtype("softmax", &[DType::F64], &cpu), DType::F64);
        assert_eq!(bf.compute_dtype("matmul", &[DType::F64], &cpu), DType::F64, "autocast never narrows f64");
        assert_eq!(fp32_compute(DType::F16), DType::F32);
        assert_eq!(conv_compute(DType::BF16, &cpu), DType::F32);
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

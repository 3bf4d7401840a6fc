//! How attention's kernels are launched on a device: on CUDA cores (`nn_attention.cu`, every
//! dtype) or on tensor cores (`nn_attention_tc.cu`: f16 and bf16 on compute capability 8.0 and
//! later, where the device gives the shared memory their tiles take), the rows a block takes, and
//! each kernel's shared memory — the kernels' tile layouts, which the emulator's check
//! (`kernels/emu/check_attention.cpp`) launches with the same figures, under AddressSanitizer in
//! `scripts/cuda-ci.sh`.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result};

use super::{err, function, suffix};

/// Threads of a block: 4 warps.
const BLOCK_THREADS: u32 = 128;

/// Shared memory a block may use without the function's opt-in (CUDA's static limit).
const DEFAULT_SHARED: usize = 48 * 1024;

static TENSOR_CORES: AtomicBool = AtomicBool::new(true);

/// Whether f16 and bf16 attention may run on tensor cores (the default); `false` keeps them on
/// the CUDA-core kernels, which every dtype and device runs — for comparing the two.
pub fn set_tensor_cores(on: bool) {
    TENSOR_CORES.store(on, Ordering::Relaxed);
}

/// The three launches of a pass.
#[derive(Clone, Copy)]
pub(crate) enum Kernel {
    Forward,
    Dq,
    DkDv,
}

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cores {
    Cuda,
    Tensor,
}

/// The kernels attention of one dtype and head dimension runs on one device.
pub(crate) struct Plan {
    cores: Cores,
    dtype: DType,
    d: usize,
}

impl Plan {
    /// Tensor cores for f16/bf16 where allowed ([`set_tensor_cores`]), the device is sm_80 or later
    /// and gives all three kernels' shared memory; the CUDA-core kernels otherwise.
    pub(crate) fn new(dev: &CudaDevice, dtype: DType, d: usize) -> Result<Plan> {
        let cuda = Plan { cores: Cores::Cuda, dtype, d };
        if !TENSOR_CORES.load(Ordering::Relaxed) || !matches!(dtype, DType::F16 | DType::BF16) {
            return Ok(cuda);
        }
        let tensor = Plan { cores: Cores::Tensor, dtype, d };
        let need = [Kernel::Forward, Kernel::Dq, Kernel::DkDv].map(|k| tensor.shared_bytes(k)).into_iter().max();
        let ok = attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? >= 8
            && need.unwrap_or(0)
                <= attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        Ok(if ok { tensor } else { cuda })
    }

    /// The kernel's function on `dev`.
    pub(crate) fn function(&self, dev: &CudaDevice, kernel: Kernel) -> Result<CudaFunction> {
        let sfx = suffix(self.dtype)?;
        let (module, kind) = match self.cores {
            Cores::Cuda => ("nn_attention", ""),
            Cores::Tensor => ("nn_attention_tc", "tc_"),
        };
        let pass = match kernel {
            Kernel::Forward => "",
            Kernel::Dq => "dq_",
            Kernel::DkDv => "dkdv_",
        };
        function(dev, module, &format!("wick_attention_{kind}{pass}{sfx}"))
    }

    /// Rows a block takes: tensor cores 4 warps of 16; CUDA cores 4 warps of 8 (of 4 in f64, whose
    /// values take twice the registers).
    fn block_rows(&self) -> usize {
        match (self.cores, self.dtype) {
            (Cores::Tensor, _) => 64,
            (Cores::Cuda, DType::F64) => 16,
            (Cores::Cuda, _) => 32,
        }
    }

    /// The shared memory a block of `kernel` uses. CUDA cores (the compute type's values): rows a
    /// block by d, 32 rows by d + 1, probabilities rows by 32; dk/dv's query tile's log-sum-exps,
    /// D and ends. Tensor cores (d padded to d16, a multiple of 16; ld = d16 + 8 and ldo = d16 + 4
    /// elements, whole 16 bytes): tiles of 64 rows by ld in the storage type (three forward, four
    /// backward), per warp one f32 score tile 16 × 68 (two backward), one probability tile
    /// 16 × 72 in the storage type (two in dk/dv) and forward's f32 output rows 16 × ldo; dk/dv's
    /// query tile's log-sum-exps, D (f32) and ends.
    fn shared_bytes(&self, kernel: Kernel) -> usize {
        let d = self.d;
        match self.cores {
            Cores::Cuda => {
                let size = if self.dtype == DType::F64 { 8 } else { 4 };
                let (rows, kd) = (self.block_rows(), d + 1);
                match kernel {
                    Kernel::Forward => (rows * d + 32 * kd + rows * 32) * size,
                    Kernel::Dq => (2 * rows * d + 2 * 32 * kd + rows * 32) * size,
                    Kernel::DkDv => (2 * rows * d + 2 * 32 * kd + 2 * rows * 32 + 64) * size + 32 * 4,
                }
            }
            Cores::Tensor => {
                let (e, d16) = (2, d.div_ceil(16) * 16);
                let (ld, ldo) = (d16 + 8, d16 + 4);
                match kernel {
                    Kernel::Forward => 3 * 64 * ld * e + 4 * 16 * 68 * 4 + 4 * 16 * ldo * 4 + 4 * 16 * 72 * e,
                    Kernel::Dq => 4 * 64 * ld * e + 4 * 32 * 68 * 4 + 4 * 16 * 72 * e,
                    Kernel::DkDv => 4 * 64 * ld * e + 4 * 32 * 68 * 4 + 2 * 4 * 16 * 72 * e + 64 * 4 * 2 + 64 * 4,
                }
            }
        }
    }

    /// A block per tile of rows of `heads` heads of `rows` rows (at most 65 535 blocks: the
    /// kernels loop over the rest), with the kernel's shared memory — opted into where it exceeds
    /// the default 48 KiB (the tensor-core kernels always; on CUDA cores the backward above head
    /// dimension 78 in f32, 51 in f64), refused where the device has less.
    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        dev: &CudaDevice,
        kernel: Kernel,
        heads: usize,
        rows: usize,
    ) -> Result<LaunchConfig> {
        let bytes = self.shared_bytes(kernel);
        if bytes > DEFAULT_SHARED {
            let most = attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            if bytes > most {
                return Err(err(format!(
                    "attention: head dimension {} in {:?} needs {bytes} bytes of shared memory a block; this device gives {most}",
                    self.d, self.dtype
                )));
            }
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| err(format!("attention: {e}")))?;
        }
        let blocks = heads.saturating_mul(rows.div_ceil(self.block_rows()));
        Ok(LaunchConfig {
            grid_dim: (blocks.clamp(1, 65_535) as u32, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: bytes as u32,
        })
    }
}

/// A device attribute (negative answers as 0).
fn attribute(dev: &CudaDevice, a: CUdevice_attribute) -> Result<usize> {
    let v = dev.cuda_stream().context().attribute(a).map_err(|e| err(format!("attention: {e}")))?;
    Ok(v.max(0) as usize)
}

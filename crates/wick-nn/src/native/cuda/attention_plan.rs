//! How attention's kernels are launched on a device: on CUDA cores (`nn_attention.cu`, every
//! dtype) or on tensor cores (`nn_attention_tc.cu`: f16 and bf16 on compute capability 8.0 and
//! later, where the device gives the shared memory their tiles take), and their launches: the rows
//! a block takes and each kernel's shared memory from `wick_kernels::launch` (the kernels' tile
//! layouts, which the emulator's check launches with too, under AddressSanitizer in
//! `scripts/cuda-ci.sh`).

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result};
use wick_kernels::launch::{attention_block_rows, attention_shared_bytes, AttentionCores, AttentionKernel};

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

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cores {
    Cuda,
    Tensor,
}

/// The kernels attention of one dtype and head dimension runs on one device.
#[derive(Clone, Copy)]
pub(crate) struct Plan {
    cores: Cores,
    dtype: DType,
    d: usize,
    /// The shared memory a block may opt into on the device, in bytes (read once).
    most_shared: usize,
}

impl Plan {
    /// Tensor cores for f16/bf16 where allowed ([`set_tensor_cores`]), the device is sm_80 or later
    /// and gives all three kernels' shared memory; the CUDA-core kernels otherwise.
    pub(crate) fn new(dev: &CudaDevice, dtype: DType, d: usize) -> Result<Plan> {
        let most_shared = attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let cuda = Plan { cores: Cores::Cuda, dtype, d, most_shared };
        if !TENSOR_CORES.load(Ordering::Relaxed) || !matches!(dtype, DType::F16 | DType::BF16) {
            return Ok(cuda);
        }
        let tensor = Plan { cores: Cores::Tensor, ..cuda };
        let fits = [AttentionKernel::Forward, AttentionKernel::Dq, AttentionKernel::DkDv]
            .iter()
            .all(|&k| tensor.shared_bytes(k) <= most_shared);
        let ok = fits && attribute(dev, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? >= 8;
        Ok(if ok { tensor } else { cuda })
    }

    /// The kernel's function on `dev`.
    pub(crate) fn function(&self, dev: &CudaDevice, kernel: AttentionKernel) -> Result<CudaFunction> {
        let sfx = suffix(self.dtype)?;
        let (module, kind) = match self.cores {
            Cores::Cuda => ("nn_attention", ""),
            Cores::Tensor => ("nn_attention_tc", "tc_"),
        };
        let pass = match kernel {
            AttentionKernel::Forward => "",
            AttentionKernel::Dq => "dq_",
            AttentionKernel::DkDv => "dkdv_",
        };
        function(dev, module, &format!("wick_attention_{kind}{pass}{sfx}"))
    }

    /// The kernels' kind and compute type, as `wick_kernels::launch` names them.
    fn cores(&self) -> AttentionCores {
        match (self.cores, self.dtype) {
            (Cores::Tensor, _) => AttentionCores::Tensor,
            (Cores::Cuda, DType::F64) => AttentionCores::CudaF64,
            (Cores::Cuda, _) => AttentionCores::CudaF32,
        }
    }

    fn shared_bytes(&self, kernel: AttentionKernel) -> usize {
        attention_shared_bytes(self.cores(), kernel, self.d)
    }

    /// A block per tile of rows of `heads` heads of `rows` rows (at most 65 535 blocks: the
    /// kernels loop over the rest), with the kernel's shared memory — opted into where it exceeds
    /// the default 48 KiB (the tensor-core kernels always; on CUDA cores the backward above head
    /// dimension 78 in f32, 51 in f64), refused where the device has less.
    pub(crate) fn launch(
        &self,
        f: &CudaFunction,
        kernel: AttentionKernel,
        heads: usize,
        rows: usize,
    ) -> Result<LaunchConfig> {
        let bytes = self.shared_bytes(kernel);
        if bytes > DEFAULT_SHARED {
            let most = self.most_shared;
            if bytes > most {
                return Err(err(format!(
                    "attention: head dimension {} in {:?} needs {bytes} bytes of shared memory a block; this device gives {most}",
                    self.d, self.dtype
                )));
            }
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                .map_err(|e| err(format!("attention: {e}")))?;
        }
        let blocks = heads.saturating_mul(rows.div_ceil(attention_block_rows(self.cores())));
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

//! Tensors made through the engine are pre-flighted: on the CPU candle's allocations cannot fail
//! (an over-budget `Vec` aborts the process and, in a notebook, every variable with it), so the
//! engine refuses a tensor that would not fit *before* candle allocates, as `OutOfMemory` with
//! advice. On CUDA the pool refuses by itself; the pre-flight then only spares the round trip.
//!
//! ```
//! use candle_core::DType;
//! let engine = wick::Engine::cpu();
//! let x = engine.zeros(&[2, 3], DType::F32)?;               // fits: a tensor
//! let err = engine.zeros(&[1usize << 40], DType::F32).unwrap_err();
//! assert!(err.is_out_of_memory());                          // 4 TiB: refused, nothing allocated
//! # Ok::<(), wick::Error>(())
//! ```

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor, WithDType};
use wick_memory::MemoryError;

use crate::engine::Engine;
use crate::error::Error;

/// Bytes of a tensor of `shape` in `dtype`, `usize::MAX` when that does not fit in a `usize`
/// (pre-flight then refuses it).
pub fn tensor_bytes(shape: &[usize], dtype: DType) -> usize {
    shape.iter().try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX)
}

impl Engine {
    /// Pre-flight for a tensor of `shape` and `dtype`.
    pub fn preflight_tensor(&self, shape: &[usize], dtype: DType, what: &str) -> Result<(), MemoryError> {
        self.preflight(tensor_bytes(shape, dtype), what)
    }

    /// Pre-flight for loading a safetensors file: the sum of its tensors, read from its header only.
    pub fn preflight_safetensors(&self, path: &std::path::Path) -> Result<usize, MemoryError> {
        let bytes = crate::tensor_files::safetensors_payload_bytes(path)?;
        self.preflight(bytes, &format!("weights {}", path.display()))?;
        Ok(bytes)
    }

    /// A pre-flighted `Tensor::zeros` on this engine's device.
    pub fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor, Error> {
        self.preflight(tensor_bytes(shape, dtype), &format!("zeros {shape:?} {dtype:?}"))?;
        Ok(Tensor::zeros(shape, dtype, self.device())?)
    }

    /// A pre-flighted `Tensor::ones`.
    pub fn ones(&self, shape: &[usize], dtype: DType) -> Result<Tensor, Error> {
        self.preflight(tensor_bytes(shape, dtype), &format!("ones {shape:?} {dtype:?}"))?;
        Ok(Tensor::ones(shape, dtype, self.device())?)
    }

    /// A pre-flighted standard-normal tensor in `dtype` (drawn in f32, or f64 for f64, then
    /// converted: both copies are pre-flighted together).
    pub fn randn(&self, shape: &[usize], dtype: DType) -> Result<Tensor, Error> {
        let draw = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let bytes =
            tensor_bytes(shape, draw).saturating_add(if dtype == draw { 0 } else { tensor_bytes(shape, dtype) });
        self.preflight(bytes, &format!("randn {shape:?} {dtype:?}"))?;
        let t = if draw == DType::F64 {
            Tensor::randn(0f64, 1.0, shape, self.device())?
        } else {
            Tensor::randn(0f32, 1.0, shape, self.device())?
        };
        Ok(t.to_dtype(dtype)?)
    }

    /// A tensor of `shape` from `data` (already allocated by the caller: on the CPU it is moved,
    /// not copied; on CUDA the device copy is pre-flighted). A length that does not match the
    /// shape is an error.
    pub fn from_vec<D: WithDType>(&self, data: Vec<D>, shape: &[usize]) -> Result<Tensor, Error> {
        if !self.device().is_cpu() {
            self.preflight(tensor_bytes(shape, D::DTYPE), &format!("from_vec {shape:?} {:?}", D::DTYPE))?;
        }
        Ok(Tensor::from_vec(data, shape, self.device())?)
    }

    /// Every tensor of a safetensors file, after a pre-flight of its payload (read from the
    /// header alone).
    pub fn load_safetensors(&self, path: &Path) -> Result<HashMap<String, Tensor>, Error> {
        self.preflight_safetensors(path)?;
        Ok(candle_core::safetensors::load(path, self.device())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_that_fit_are_made_and_others_refused_before_allocating() {
        let engine = Engine::cpu();
        assert_eq!(engine.zeros(&[2, 3], DType::F32).unwrap().dims(), &[2, 3]);
        assert_eq!(
            engine.ones(&[4], DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
            [1.0; 4]
        );
        let r = engine.randn(&[1000], DType::F64).unwrap().to_vec1::<f64>().unwrap();
        let mean = r.iter().sum::<f64>() / 1000.0;
        assert!(mean.abs() < 0.2, "mean {mean}");
        assert_eq!(engine.from_vec(vec![1u32, 2, 3, 4], &[2, 2]).unwrap().dims(), &[2, 2]);
        assert!(engine.from_vec(vec![1u32, 2, 3], &[2, 2]).is_err());
        // Over the budget: out of memory with the request named, and nothing allocated (the
        // process is alive to check it).
        for err in [
            engine.zeros(&[1 << 40], DType::F32).unwrap_err(),
            engine.ones(&[1 << 20, 1 << 20], DType::F64).unwrap_err(),
            engine.randn(&[1 << 38], DType::BF16).unwrap_err(),
            engine.zeros(&[usize::MAX, 2], DType::U8).unwrap_err(),
        ] {
            assert!(err.is_out_of_memory(), "{err}");
        }
        assert!(engine.zeros(&[1 << 40], DType::F32).unwrap_err().to_string().contains("zeros [1099511627776]"));
    }

    #[test]
    fn safetensors_are_loaded_after_their_preflight() {
        let dir = std::env::temp_dir().join(format!("wick-tensors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let engine = Engine::cpu();
        let t = engine.ones(&[3, 2], DType::F32).unwrap();
        candle_core::safetensors::save(&HashMap::from([("w", t)]), &path).unwrap();
        assert_eq!(engine.load_safetensors(&path).unwrap()["w"].dims(), &[3, 2]);
        let mut limited = Engine::cpu();
        limited.set_memory_limit(Some(wick_memory::MemoryLimit::Bytes(8))).unwrap();
        assert!(limited.load_safetensors(&path).unwrap_err().is_out_of_memory());
        std::fs::remove_dir_all(&dir).ok();
    }
}

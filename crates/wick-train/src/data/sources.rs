//! Datasets over real files: a safetensors file of tensors with a sample axis, a flat file of
//! token ids cut into windows, and a folder of images in class subfolders (decoded with the
//! `image` crate). Each checks what it opens and names the file at fault.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::{DataError, Dataset};

fn source(path: &Path, message: impl std::fmt::Display) -> DataError {
    DataError::Source { path: path.display().to_string(), message: message.to_string() }
}

/// Named tensors of a safetensors file that share their first axis: sample `i` is row `i` of
/// each (e.g. `images` (N, 3, 32, 32) and `labels` (N)). The file is pre-flighted against the
/// host's memory from its header, then read once.
#[derive(Debug)]
pub struct TensorFile {
    fields: Vec<Tensor>,
    len: usize,
}

impl TensorFile {
    /// The tensors `fields` of `path`, in that order.
    pub fn open(path: &Path, fields: &[&str]) -> Result<Self, DataError> {
        let bytes = wick::tensor_files::safetensors_payload_bytes(path).map_err(|e| source(path, e))?;
        wick::host_memory::preflight_host(bytes, &format!("dataset {}", path.display()))
            .map_err(|e| source(path, e))?;
        let mut tensors = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| source(path, e))?;
        let mut out = Vec::with_capacity(fields.len());
        for name in fields {
            let t = tensors.remove(*name).ok_or_else(|| source(path, format!("no tensor `{name}`")))?;
            if t.rank() == 0 {
                return Err(source(path, format!("`{name}` is a scalar: it has no sample axis")));
            }
            out.push(t);
        }
        let len = out.first().map_or(0, |t| t.dims()[0]);
        if let Some((name, t)) = fields.iter().zip(&out).find(|(_, t)| t.dims()[0] != len) {
            return Err(source(path, format!("`{name}` has {} samples, `{}` has {len}", t.dims()[0], fields[0])));
        }
        Ok(TensorFile { fields: out, len })
    }
}

impl Dataset for TensorFile {
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, index: usize) -> Result<Vec<Tensor>, DataError> {
        if index >= self.len {
            return Err(DataError::sample(index, format!("beyond the {} samples", self.len)));
        }
        self.fields.iter().map(|t| t.get(index).map_err(|e| DataError::sample(index, e))).collect()
    }
}

/// Token ids stored flat (little-endian u16 or u32), cut into non-overlapping windows of
/// `seq + 1` tokens (inputs and next-token targets share all but one): sample `i` is one u32
/// tensor (seq + 1).
#[derive(Debug)]
pub struct TokenFile {
    tokens: Vec<u32>,
    seq: usize,
}

impl TokenFile {
    /// Reads `path` as tokens of `width` bytes (2 or 4) and windows of `seq` + 1.
    pub fn open(path: &Path, width: usize, seq: usize) -> Result<Self, DataError> {
        if !(width == 2 || width == 4) || seq == 0 {
            return Err(source(
                path,
                format!("tokens of {width} bytes in windows of {seq}: need 2 or 4 bytes and seq ≥ 1"),
            ));
        }
        let len = std::fs::metadata(path).map_err(|e| source(path, e))?.len();
        let len = usize::try_from(len).map_err(|_| source(path, "larger than this machine can address"))?;
        if len % width != 0 {
            return Err(source(path, format!("{len} bytes is not a whole number of {width}-byte tokens")));
        }
        wick::host_memory::preflight_host(len / width * 4, &format!("tokens {}", path.display()))
            .map_err(|e| source(path, e))?;
        let bytes = std::fs::read(path).map_err(|e| source(path, e))?;
        let tokens = match width {
            2 => bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
            _ => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        };
        Ok(TokenFile { tokens, seq })
    }
}

impl TokenFile {
    /// Every token of the file, in order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl Dataset for TokenFile {
    fn len(&self) -> usize {
        self.tokens.len().saturating_sub(1) / self.seq
    }
    fn get(&self, index: usize) -> Result<Vec<Tensor>, DataError> {
        let start = index.checked_mul(self.seq).filter(|s| s + self.seq < self.tokens.len());
        let start = start.ok_or_else(|| DataError::sample(index, format!("beyond the {} windows", self.len())))?;
        let window = self.tokens[start..start + self.seq + 1].to_vec();
        Ok(vec![Tensor::from_vec(window, self.seq + 1, &Device::Cpu).map_err(|e| DataError::sample(index, e))?])
    }
}

/// Images in class subfolders (`root/cat/1.png`, `root/dog/7.jpg`; classes in name order,
/// files in name order), as torchvision's `ImageFolder`: sample `i` is the image as f32
/// (3, height, width) in [0, 1], resized, and its class index (u32 scalar). PNG and JPEG.
#[derive(Debug)]
pub struct ImageFolder {
    files: Vec<(PathBuf, u32)>,
    classes: Vec<String>,
    size: (u32, u32),
}

impl ImageFolder {
    /// The images under `root`, resized to `height` × `width`.
    pub fn open(root: &Path, height: u32, width: u32) -> Result<Self, DataError> {
        if height == 0 || width == 0 {
            return Err(source(root, "the image size must be positive"));
        }
        let sorted = |dir: &Path| -> Result<Vec<PathBuf>, DataError> {
            let mut entries: Vec<PathBuf> =
                std::fs::read_dir(dir).map_err(|e| source(dir, e))?.filter_map(|e| e.ok().map(|e| e.path())).collect();
            entries.sort();
            Ok(entries)
        };
        let mut classes = Vec::new();
        let mut files = Vec::new();
        for dir in sorted(root)?.into_iter().filter(|p| p.is_dir()) {
            let label = u32::try_from(classes.len()).map_err(|_| source(root, "too many classes"))?;
            classes.push(dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()));
            for file in sorted(&dir)? {
                let ext = file.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
                if matches!(ext.as_deref(), Some("png" | "jpg" | "jpeg")) {
                    files.push((file, label));
                }
            }
        }
        if files.is_empty() {
            return Err(source(root, "no PNG or JPEG images in class subfolders"));
        }
        Ok(ImageFolder { files, classes, size: (height, width) })
    }

    /// The class names, by index.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }
    fn get(&self, index: usize) -> Result<Vec<Tensor>, DataError> {
        let (path, label) = self.files.get(index).ok_or_else(|| DataError::sample(index, "beyond the images"))?;
        let named = |e: &dyn std::fmt::Display| DataError::sample(index, format!("{}: {e}", path.display()));
        let image = image::ImageReader::open(path)
            .map_err(|e| named(&e))?
            .with_guessed_format()
            .map_err(|e| named(&e))?
            .decode()
            .map_err(|e| named(&e))?;
        let (h, w) = self.size;
        let rgb = image::imageops::resize(&image.to_rgb8(), w, h, image::imageops::FilterType::Triangle);
        // HWC bytes → CHW floats in [0, 1].
        let hw = (h * w) as usize;
        let raw = rgb.into_raw();
        let mut chw = vec![0f32; 3 * hw];
        for (p, px) in raw.chunks_exact(3).enumerate() {
            for c in 0..3 {
                chw[c * hw + p] = f32::from(px[c]) / 255.0;
            }
        }
        let x = Tensor::from_vec(chw, (3, h as usize, w as usize), &Device::Cpu).map_err(|e| named(&e))?;
        let y = Tensor::new(*label, &Device::Cpu).map_err(|e| named(&e))?;
        debug_assert_eq!(x.dtype(), DType::F32);
        Ok(vec![x, y])
    }
}

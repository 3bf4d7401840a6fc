//! A safe reader for PyTorch's legacy (pre-1.6, non-zip) `.pth` files, such as torchvision's
//! `mobilenet_v2-b0353104.pth`, which candle's pickle loader cannot read. It interprets only the
//! pickle opcodes a state dict uses and calls nothing: the only constructors it accepts are
//! `collections.OrderedDict` and `torch._utils._rebuild_tensor_v2` over `torch.*Storage`, so a
//! file that asks for anything else is rejected rather than executed.
//!
//! Layout: pickle(magic number) pickle(protocol 1001) pickle(sys info) pickle(state dict with
//! persistent storage references) pickle(list of storage keys), then for each key an i64 element
//! count and the raw little-endian elements.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::ZooError;

const MAGIC: &[u8] = &[0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19]; // 0x1950a86a20f9469cfc6c LE
const MAX_STACK: usize = 1 << 20;

#[derive(Debug, Clone)]
enum Value {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    Long(Vec<u8>),
    Str(String),
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Global(String, String),
    Storage {
        dtype: DType,
        key: String,
        numel: usize,
    },
    Tensor {
        storage_key: String,
        storage_numel: usize,
        dtype: DType,
        offset: usize,
        shape: Vec<usize>,
        stride: Vec<usize>,
    },
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.data.len()).ok_or("unexpected end of file")?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "short read")?))
    }
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.data[self.pos..];
        let n = rest.iter().position(|&b| b == b'\n').ok_or("unterminated line")?;
        let s = String::from_utf8(rest[..n].to_vec()).map_err(|_| "line is not UTF-8")?;
        self.pos += n + 1;
        Ok(s)
    }
}

fn storage_dtype(name: &str) -> Result<DType, String> {
    Ok(match name {
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "LongStorage" => DType::I64,
        "ByteStorage" => DType::U8,
        other => return Err(format!("unsupported storage type torch.{other}")),
    })
}

fn as_usizes(v: &Value) -> Result<Vec<usize>, String> {
    match v {
        Value::Tuple(items) => items
            .iter()
            .map(|i| match i {
                Value::Int(n) if *n >= 0 => Ok(*n as usize),
                other => Err(format!("expected a non-negative integer, found {other:?}")),
            })
            .collect(),
        other => Err(format!("expected a tuple of integers, found {other:?}")),
    }
}

fn pop_mark(stack: &mut Vec<Value>) -> Result<Vec<Value>, String> {
    let at = stack.iter().rposition(|v| matches!(v, Value::Mark)).ok_or("no MARK on the stack")?;
    let items = stack.split_off(at + 1);
    stack.pop();
    Ok(items)
}

/// Runs one pickle from the reader's position, refusing every callable but the allow-listed ones.
fn unpickle(r: &mut Reader<'_>) -> Result<Value, String> {
    let mut stack: Vec<Value> = Vec::new();
    let mut memo: HashMap<u32, Value> = HashMap::new();
    let pop = |stack: &mut Vec<Value>| stack.pop().ok_or_else(|| "stack underflow".to_string());
    loop {
        if stack.len() > MAX_STACK {
            return Err("pickle stack too deep".into());
        }
        let op = r.u8()?;
        match op {
            0x80 => {
                r.u8()?;
            } // PROTO
            b'.' => return pop(&mut stack),
            b'(' => stack.push(Value::Mark),
            b'}' => stack.push(Value::Dict(Vec::new())),
            b']' => stack.push(Value::List(Vec::new())),
            b')' => stack.push(Value::Tuple(Vec::new())),
            b'N' => stack.push(Value::None),
            0x88 => stack.push(Value::Bool(true)),
            0x89 => stack.push(Value::Bool(false)),
            b'K' => stack.push(Value::Int(r.u8()? as i64)),
            b'M' => stack.push(Value::Int(u16::from_le_bytes([r.u8()?, r.u8()?]) as i64)),
            b'J' => stack.push(Value::Int(r.u32()? as i32 as i64)),
            0x8a => {
                let n = r.u8()? as usize;
                stack.push(Value::Long(r.take(n)?.to_vec()));
            }
            b'X' => {
                let n = r.u32()? as usize;
                let s = String::from_utf8(r.take(n)?.to_vec()).map_err(|_| "string is not UTF-8")?;
                stack.push(Value::Str(s));
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                stack.push(Value::Global(module, name));
            }
            b'q' => {
                let i = r.u8()? as u32;
                memo.insert(i, stack.last().cloned().ok_or("BINPUT on an empty stack")?);
            }
            b'r' => {
                let i = r.u32()?;
                memo.insert(i, stack.last().cloned().ok_or("LONG_BINPUT on an empty stack")?);
            }
            b'h' => {
                let i = r.u8()? as u32;
                stack.push(memo.get(&i).cloned().ok_or(format!("memo {i} is empty"))?);
            }
            b'j' => {
                let i = r.u32()?;
                stack.push(memo.get(&i).cloned().ok_or(format!("memo {i} is empty"))?);
            }
            b't' => {
                let items = pop_mark(&mut stack)?;
                stack.push(Value::Tuple(items));
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if stack.len() < n {
                    return Err("stack underflow".into());
                }
                let items = stack.split_off(stack.len() - n);
                stack.push(Value::Tuple(items));
            }
            b's' => {
                let v = pop(&mut stack)?;
                let k = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Value::Dict(d)) => d.push((k, v)),
                    _ => return Err("SETITEM on a non-dict".into()),
                }
            }
            b'u' => {
                let items = pop_mark(&mut stack)?;
                if items.len() % 2 != 0 {
                    return Err("SETITEMS with an odd number of items".into());
                }
                let Some(Value::Dict(d)) = stack.last_mut() else { return Err("SETITEMS on a non-dict".into()) };
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
            }
            b'a' => {
                let v = pop(&mut stack)?;
                match stack.last_mut() {
                    Some(Value::List(l)) => l.push(v),
                    _ => return Err("APPEND on a non-list".into()),
                }
            }
            b'e' => {
                let items = pop_mark(&mut stack)?;
                match stack.last_mut() {
                    Some(Value::List(l)) => l.extend(items),
                    _ => return Err("APPENDS on a non-list".into()),
                }
            }
            b'b' => {
                // BUILD: only the OrderedDict `_metadata` attribute of a state dict is expected.
                pop(&mut stack)?;
                if !matches!(stack.last(), Some(Value::Dict(_))) {
                    return Err("BUILD on something other than a dict".into());
                }
            }
            b'Q' => {
                let pid = pop(&mut stack)?;
                let Value::Tuple(items) = pid else { return Err("persistent id is not a tuple".into()) };
                match items.as_slice() {
                    [Value::Str(kind), Value::Global(module, class), Value::Str(key), _location, Value::Int(numel), _view]
                        if kind == "storage" && module == "torch" =>
                    {
                        stack.push(Value::Storage {
                            dtype: storage_dtype(class)?,
                            key: key.clone(),
                            numel: *numel as usize,
                        });
                    }
                    other => return Err(format!("unsupported persistent id {other:?}")),
                }
            }
            b'R' => {
                let args = pop(&mut stack)?;
                let callable = pop(&mut stack)?;
                let Value::Global(module, name) = callable else { return Err("REDUCE of a non-global".into()) };
                let Value::Tuple(args) = args else { return Err("REDUCE arguments are not a tuple".into()) };
                match (module.as_str(), name.as_str()) {
                    ("collections", "OrderedDict") if args.is_empty() => stack.push(Value::Dict(Vec::new())),
                    ("torch._utils", "_rebuild_tensor_v2") if args.len() >= 4 => {
                        let Value::Storage { dtype, key, numel } = &args[0] else {
                            return Err("tensor without a storage".into());
                        };
                        let Value::Int(offset) = args[1] else { return Err("tensor offset is not an integer".into()) };
                        stack.push(Value::Tensor {
                            storage_key: key.clone(),
                            storage_numel: *numel,
                            dtype: *dtype,
                            offset: offset.max(0) as usize,
                            shape: as_usizes(&args[2])?,
                            stride: as_usizes(&args[3])?,
                        });
                    }
                    (m, n) => return Err(format!("refusing to call {m}.{n}: only tensors and OrderedDict are read")),
                }
            }
            other => return Err(format!("unsupported pickle opcode {other:#04x} at byte {}", r.pos - 1)),
        }
    }
}

/// Reads every tensor of a legacy `.pth` state dict, in file order, onto `device`. Integer
/// tensors (`num_batches_tracked`) come back as I64.
pub fn read_legacy_pth(path: &Path, device: &Device) -> Result<Vec<(String, Tensor)>, ZooError> {
    let fail = |message: String| ZooError::File { path: path.to_path_buf(), message };
    let data = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
    if data.starts_with(b"PK") {
        return Err(fail("this is a zip-format checkpoint (PyTorch >= 1.6); candle's own loader reads those".into()));
    }
    if data.first() != Some(&0x80) {
        return Err(fail("not a legacy PyTorch file (it does not start with a pickle)".into()));
    }
    let mut r = Reader { data: &data, pos: 0 };
    match unpickle(&mut r).map_err(|e| fail(format!("magic number: {e}")))? {
        Value::Long(bytes) if bytes == MAGIC => {}
        other => return Err(fail(format!("not a legacy PyTorch file (magic {other:?})"))),
    }
    match unpickle(&mut r).map_err(&fail)? {
        Value::Int(1001) => {}
        other => return Err(fail(format!("unsupported protocol version {other:?}"))),
    }
    let sys_info = unpickle(&mut r).map_err(|e| fail(format!("sys info: {e}")))?;
    let little_endian = match &sys_info {
        Value::Dict(items) => items.iter().find_map(|(k, v)| match (k, v) {
            (Value::Str(k), Value::Bool(b)) if k == "little_endian" => Some(*b),
            _ => None,
        }),
        _ => None,
    };
    if little_endian != Some(true) {
        return Err(fail("the file was written big-endian or without byte-order information".into()));
    }
    let state = unpickle(&mut r).map_err(|e| fail(format!("state dict: {e}")))?;
    let Value::List(keys) = unpickle(&mut r).map_err(|e| fail(format!("storage keys: {e}")))? else {
        return Err(fail("storage keys are not a list".into()));
    };
    let Value::Dict(entries) = state else { return Err(fail("the checkpoint is not a state dict".into())) };
    // Element sizes by storage key, from the tensors that use them.
    let mut storage_dtype: HashMap<String, (DType, usize)> = HashMap::new();
    for (_, v) in &entries {
        if let Value::Tensor { storage_key, dtype, storage_numel, .. } = v {
            storage_dtype.insert(storage_key.clone(), (*dtype, *storage_numel));
        }
    }
    let mut storages: HashMap<String, Tensor> = HashMap::new();
    for key in keys {
        let Value::Str(key) = key else { return Err(fail("a storage key is not a string".into())) };
        let numel = i64::from_le_bytes(r.take(8).map_err(&fail)?.try_into().map_err(|_| fail("short read".into()))?);
        let numel = usize::try_from(numel).map_err(|_| fail(format!("storage {key} has a negative size")))?;
        let (dtype, declared) =
            *storage_dtype.get(&key).ok_or_else(|| fail(format!("storage {key} is used by no tensor")))?;
        if declared != numel {
            return Err(fail(format!("storage {key}: {numel} elements on disk, {declared} declared")));
        }
        let bytes = r
            .take(numel.checked_mul(dtype.size_in_bytes()).ok_or_else(|| fail("storage too large".into()))?)
            .map_err(&fail)?;
        let t = match dtype {
            DType::F32 => Tensor::from_vec(
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>(),
                numel,
                device,
            )?,
            DType::F64 => Tensor::from_vec(
                bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect::<Vec<_>>(),
                numel,
                device,
            )?,
            DType::I64 => Tensor::from_vec(
                bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect::<Vec<_>>(),
                numel,
                device,
            )?,
            DType::U8 => Tensor::from_vec(bytes.to_vec(), numel, device)?,
            other => return Err(fail(format!("storage {key}: dtype {other:?} is not supported yet"))),
        };
        storages.insert(key, t);
    }
    let mut out = Vec::with_capacity(entries.len());
    for (name, v) in entries {
        let Value::Str(name) = name else { return Err(fail("a state-dict key is not a string".into())) };
        let Value::Tensor { storage_key, offset, shape, stride, .. } = v else {
            return Err(fail(format!("entry `{name}` is not a tensor")));
        };
        let storage = storages
            .get(&storage_key)
            .ok_or_else(|| fail(format!("tensor `{name}`: storage {storage_key} is missing")))?;
        let numel: usize = shape.iter().product();
        let contiguous: Vec<usize> = (0..shape.len()).map(|i| shape[i + 1..].iter().product()).collect();
        if numel > 1 && stride != contiguous {
            return Err(fail(format!("tensor `{name}` is not contiguous (stride {stride:?})")));
        }
        if offset + numel > storage.elem_count() {
            return Err(fail(format!("tensor `{name}` reaches past its storage")));
        }
        out.push((name, storage.narrow(0, offset, numel)?.reshape(shape)?));
    }
    Ok(out)
}

/// Converts a legacy `.pth` state dict to a safetensors file with the same names and values.
/// Returns the number of tensors written.
pub fn convert_to_safetensors(pth: &Path, out: &Path) -> Result<usize, ZooError> {
    let tensors = read_legacy_pth(pth, &Device::Cpu)?;
    let count = tensors.len();
    let map: HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, out)
        .map_err(|e| ZooError::File { path: out.to_path_buf(), message: e.to_string() })?;
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(bytes: &[u8]) -> Result<Value, String> {
        unpickle(&mut Reader { data: bytes, pos: 0 })
    }

    #[test]
    fn refuses_to_call_anything_else() {
        // pickle.dumps(os.system, protocol=2) style: GLOBAL 'os system' + args + REDUCE.
        let evil = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
        let err = run(evil).unwrap_err();
        assert!(err.contains("refusing to call os.system"), "{err}");
    }

    #[test]
    fn truncated_and_unknown_input_are_errors() {
        assert!(run(b"\x80\x02X\xff\x00\x00\x00ab").unwrap_err().contains("end of file"));
        assert!(run(b"\x80\x02\xfe").unwrap_err().contains("unsupported pickle opcode"));
        assert!(run(b"\x80\x02t.").unwrap_err().contains("MARK"));
        let dir = std::env::temp_dir().join(format!("wick-pth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.pth");
        std::fs::write(&p, b"PK\x03\x04rest").unwrap();
        assert!(read_legacy_pth(&p, &Device::Cpu).unwrap_err().to_string().contains("zip-format"));
        std::fs::write(&p, b"\x80\x02K\x05.").unwrap();
        assert!(read_legacy_pth(&p, &Device::Cpu).unwrap_err().to_string().contains("not a legacy PyTorch file"));
        std::fs::remove_dir_all(&dir).ok();
    }
}

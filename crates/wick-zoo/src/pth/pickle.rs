//! The restricted unpickler behind the legacy `.pth` reader: it interprets only the opcodes a
//! state dict uses, calls nothing (two allow-listed constructors are recognised, not executed),
//! and is bounded in every dimension an input controls:
//!
//! - **Sharing, not copying.** Values are reference-counted, so a memo entry fetched many times
//!   (`BINGET`) costs one pointer each time; a "billion laughs" pickle, which doubles a tuple 40
//!   times through the memo, stays 80 nodes. Mutating a container that the memo also holds copies
//!   it first (the memo keeps what was stored, as a snapshot), and every such copy is charged.
//! - **A work budget proportional to the input**: every opcode and every element copied costs
//!   one unit, and a pickle may spend at most [`WORK_PER_BYTE`] units per byte of the file.
//! - **A depth limit** ([`MAX_DEPTH`]) on nested containers, enforced where containers are made,
//!   so no recursion over a value (dropping, summarising, reading it) can exhaust the stack.
//! - **Errors summarise** a value (its kind and size) instead of printing all of it.

use std::collections::HashMap;
use std::rc::Rc;

use candle_core::DType;

/// Containers nest at most this deep (a state dict needs about 5).
pub(super) const MAX_DEPTH: u16 = 64;
/// Values on the pickle stack at most.
const MAX_STACK: usize = 1 << 20;
/// Work units a pickle may spend per byte of the whole file (plus a small constant).
pub(super) const WORK_PER_BYTE: usize = 64;

/// A shared value.
pub(super) type Obj = Rc<Value>;

/// What a state-dict pickle can build.
#[derive(Clone)]
pub(super) enum Value {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    Long(Rc<[u8]>),
    Str(Rc<str>),
    /// Items and nesting depth (1 + the deepest item's).
    Tuple(Vec<Obj>, u16),
    List(Vec<Obj>, u16),
    Dict(Vec<(Obj, Obj)>, u16),
    Global(Rc<str>, Rc<str>),
    Storage {
        dtype: DType,
        key: Rc<str>,
        numel: usize,
    },
    Tensor(Rc<TensorRef>),
}

/// A tensor as `_rebuild_tensor_v2` describes it: a view of a storage.
pub(super) struct TensorRef {
    pub storage_key: Rc<str>,
    pub storage_numel: usize,
    pub dtype: DType,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
}

impl Value {
    fn depth(&self) -> u16 {
        match self {
            Value::Tuple(_, d) | Value::List(_, d) | Value::Dict(_, d) => *d,
            _ => 0,
        }
    }

    /// A one-line description that never grows with the value: kind, and size for containers.
    pub(super) fn summary(&self) -> String {
        match self {
            Value::Mark => "MARK".into(),
            Value::None => "None".into(),
            Value::Bool(b) => format!("bool {b}"),
            Value::Int(i) => format!("int {i}"),
            Value::Long(b) => format!("long of {} bytes", b.len()),
            Value::Str(s) if s.len() <= 40 => format!("string {s:?}"),
            Value::Str(s) => format!("string of {} bytes", s.len()),
            Value::Tuple(items, _) => format!("tuple of {}", items.len()),
            Value::List(items, _) => format!("list of {}", items.len()),
            Value::Dict(items, _) => format!("dict of {}", items.len()),
            Value::Global(m, n) => format!("global {m}.{n}"),
            Value::Storage { key, .. } => format!("storage {key}"),
            Value::Tensor(t) => format!("tensor of shape {:?}", t.shape),
        }
    }
}

/// Debug output is the summary: a value can be a DAG of 2⁴⁰ paths, never printed in full.
impl std::fmt::Debug for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.summary())
    }
}

/// The depth of a container holding `items`, or an error past [`MAX_DEPTH`].
fn depth_of<'a>(items: impl IntoIterator<Item = &'a Obj>) -> Result<u16, String> {
    let deepest = items.into_iter().map(|v| v.depth()).max().unwrap_or(0);
    if deepest >= MAX_DEPTH {
        return Err(format!("containers nested more than {MAX_DEPTH} deep"));
    }
    Ok(deepest + 1)
}

/// The pickle's bytes and a cursor.
pub(super) struct Reader<'a> {
    pub data: &'a [u8],
    pub pos: usize,
}

impl<'a> Reader<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.data.len()).ok_or("unexpected end of file")?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn line(&mut self) -> Result<Rc<str>, String> {
        let rest = &self.data[self.pos..];
        let n = rest.iter().position(|&b| b == b'\n').ok_or("unterminated line")?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| "line is not UTF-8")?;
        self.pos += n + 1;
        Ok(Rc::from(s))
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

/// A tuple of non-negative integers (a shape or a stride).
fn as_usizes(v: &Value, what: &str) -> Result<Vec<usize>, String> {
    match v {
        Value::Tuple(items, _) => items
            .iter()
            .map(|i| match **i {
                Value::Int(n) => usize::try_from(n).map_err(|_| format!("{what}: negative entry {n}")),
                ref other => Err(format!("{what}: expected an integer, found {}", other.summary())),
            })
            .collect(),
        other => Err(format!("{what}: expected a tuple of integers, found {}", other.summary())),
    }
}

/// The stack, the memo and the work spent.
struct Machine {
    stack: Vec<Obj>,
    memo: HashMap<u32, Obj>,
    work: usize,
    budget: usize,
}

impl Machine {
    fn charge(&mut self, units: usize) -> Result<(), String> {
        self.work = self.work.saturating_add(units);
        if self.work > self.budget {
            return Err(format!(
                "the pickle does more than {} units of work for a file of this size; refusing it",
                self.budget
            ));
        }
        Ok(())
    }
    fn push(&mut self, v: Value) -> Result<(), String> {
        if self.stack.len() >= MAX_STACK {
            return Err("pickle stack too deep".into());
        }
        self.stack.push(Rc::new(v));
        Ok(())
    }
    fn pop(&mut self) -> Result<Obj, String> {
        self.stack.pop().ok_or_else(|| "stack underflow".to_string())
    }
    fn pop_mark(&mut self) -> Result<Vec<Obj>, String> {
        let at = self.stack.iter().rposition(|v| matches!(**v, Value::Mark)).ok_or("no MARK on the stack")?;
        let items = self.stack.split_off(at + 1);
        self.stack.pop();
        Ok(items)
    }
    fn memo_get(&mut self, i: u32) -> Result<(), String> {
        let v = self.memo.get(&i).cloned().ok_or(format!("memo {i} is empty"))?;
        if self.stack.len() >= MAX_STACK {
            return Err("pickle stack too deep".into());
        }
        self.stack.push(v);
        Ok(())
    }
    fn memo_put(&mut self, i: u32) -> Result<(), String> {
        let top = self.stack.last().cloned().ok_or("BINPUT on an empty stack")?;
        self.memo.insert(i, top);
        Ok(())
    }
    /// The container on top of the stack, for mutation; a shared one is copied first (charged).
    fn top_mut(&mut self) -> Result<&mut Value, String> {
        let len = match self.stack.last() {
            Some(top) if Rc::strong_count(top) > 1 => match &**top {
                Value::List(v, _) | Value::Tuple(v, _) => v.len(),
                Value::Dict(v, _) => v.len().saturating_mul(2),
                _ => 0,
            },
            Some(_) => 0,
            None => return Err("stack underflow".into()),
        };
        self.charge(len)?;
        let top = self.stack.last_mut().ok_or("stack underflow")?;
        Ok(Rc::make_mut(top))
    }
}

/// Runs one pickle from the reader's position. `budget` is the work it may spend.
pub(super) fn unpickle(r: &mut Reader<'_>, budget: usize) -> Result<Obj, String> {
    let mut m = Machine { stack: Vec::new(), memo: HashMap::new(), work: 0, budget };
    loop {
        m.charge(1)?;
        let op = r.u8()?;
        match op {
            0x80 => {
                r.u8()?;
            } // PROTO
            b'.' => return m.pop(),
            b'(' => m.push(Value::Mark)?,
            b'}' => m.push(Value::Dict(Vec::new(), 1))?,
            b']' => m.push(Value::List(Vec::new(), 1))?,
            b')' => m.push(Value::Tuple(Vec::new(), 1))?,
            b'N' => m.push(Value::None)?,
            0x88 => m.push(Value::Bool(true))?,
            0x89 => m.push(Value::Bool(false))?,
            b'K' => m.push(Value::Int(r.u8()?.into()))?,
            b'M' => m.push(Value::Int(r.u16()?.into()))?,
            b'J' => m.push(Value::Int(r.u32()? as i32 as i64))?,
            0x8a => {
                let n = r.u8()? as usize;
                m.push(Value::Long(Rc::from(r.take(n)?)))?;
            }
            b'X' => {
                let n = r.u32()? as usize;
                let s = std::str::from_utf8(r.take(n)?).map_err(|_| "string is not UTF-8")?;
                m.push(Value::Str(Rc::from(s)))?;
            }
            b'c' => {
                let module = r.line()?;
                let name = r.line()?;
                m.push(Value::Global(module, name))?;
            }
            b'q' => m.memo_put(r.u8()?.into())?,
            b'r' => m.memo_put(r.u32()?)?,
            b'h' => m.memo_get(r.u8()?.into())?,
            b'j' => m.memo_get(r.u32()?)?,
            b't' => {
                let items = m.pop_mark()?;
                let depth = depth_of(&items)?;
                m.push(Value::Tuple(items, depth))?;
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                if m.stack.len() < n {
                    return Err("stack underflow".into());
                }
                let items = m.stack.split_off(m.stack.len() - n);
                let depth = depth_of(&items)?;
                m.push(Value::Tuple(items, depth))?;
            }
            b's' => {
                let v = m.pop()?;
                let k = m.pop()?;
                let depth = depth_of([&k, &v])?;
                match m.top_mut()? {
                    Value::Dict(d, dd) => {
                        d.push((k, v));
                        *dd = (*dd).max(depth);
                    }
                    _ => return Err("SETITEM on a non-dict".into()),
                }
            }
            b'u' => {
                let items = m.pop_mark()?;
                if items.len() % 2 != 0 {
                    return Err("SETITEMS with an odd number of items".into());
                }
                let depth = depth_of(&items)?;
                let Value::Dict(d, dd) = m.top_mut()? else { return Err("SETITEMS on a non-dict".into()) };
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
                *dd = (*dd).max(depth);
            }
            b'a' | b'e' => {
                let items = if op == b'a' { vec![m.pop()?] } else { m.pop_mark()? };
                let depth = depth_of(&items)?;
                let Value::List(l, ld) = m.top_mut()? else { return Err("APPEND on a non-list".into()) };
                l.extend(items);
                *ld = (*ld).max(depth);
            }
            b'b' => {
                // BUILD: only the OrderedDict `_metadata` attribute of a state dict is expected.
                m.pop()?;
                if !matches!(m.stack.last().map(|v| &**v), Some(Value::Dict(..))) {
                    return Err("BUILD on something other than a dict".into());
                }
            }
            b'Q' => {
                let pid = m.pop()?;
                let storage = persistent_storage(&pid)?;
                m.push(storage)?;
            }
            b'R' => {
                let args = m.pop()?;
                let callable = m.pop()?;
                let value = reduce(&callable, &args)?;
                m.push(value)?;
            }
            other => return Err(format!("unsupported pickle opcode {other:#04x} at byte {}", r.pos - 1)),
        }
    }
}

/// `('storage', torch.<Type>Storage, key, location, numel, view)`.
fn persistent_storage(pid: &Value) -> Result<Value, String> {
    let Value::Tuple(items, _) = pid else { return Err(format!("persistent id is a {}", pid.summary())) };
    let parts: Vec<&Value> = items.iter().map(|v| &**v).collect();
    match parts.as_slice() {
        [Value::Str(kind), Value::Global(module, class), Value::Str(key), _location, Value::Int(numel), _view]
            if &**kind == "storage" && &**module == "torch" =>
        {
            let numel = usize::try_from(*numel).map_err(|_| format!("storage {key} has negative size {numel}"))?;
            Ok(Value::Storage { dtype: storage_dtype(class)?, key: key.clone(), numel })
        }
        _ => Err(format!("unsupported persistent id ({})", pid.summary())),
    }
}

/// The two constructors a state dict uses; anything else is refused, never called.
fn reduce(callable: &Value, args: &Value) -> Result<Value, String> {
    let Value::Global(module, name) = callable else {
        return Err(format!("REDUCE of a {}", callable.summary()));
    };
    let Value::Tuple(args, _) = args else { return Err("REDUCE arguments are not a tuple".into()) };
    match (&**module, &**name) {
        ("collections", "OrderedDict") if args.is_empty() => Ok(Value::Dict(Vec::new(), 1)),
        ("torch._utils", "_rebuild_tensor_v2") if args.len() >= 4 => {
            let Value::Storage { dtype, key, numel } = &*args[0] else {
                return Err(format!("tensor over a {}, not a storage", args[0].summary()));
            };
            let Value::Int(offset) = *args[1] else { return Err("tensor offset is not an integer".into()) };
            let offset = usize::try_from(offset).map_err(|_| format!("tensor over {key}: negative offset {offset}"))?;
            Ok(Value::Tensor(Rc::new(TensorRef {
                storage_key: key.clone(),
                storage_numel: *numel,
                dtype: *dtype,
                offset,
                shape: as_usizes(&args[2], "tensor shape")?,
                stride: as_usizes(&args[3], "tensor stride")?,
            })))
        }
        (m, n) => Err(format!("refusing to call {m}.{n}: only tensors and OrderedDict are read")),
    }
}

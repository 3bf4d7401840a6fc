//! Where a step's time goes, per op: with `WICK_PROFILE_OPS=1` in the environment every kernel
//! op's forward and backward are timed (wall clock, on the calling thread) and [`report`] prints
//! the totals; with `WICK_PROFILE_OPS=shapes` each op's rows are split by its operands' shapes (as
//! PyTorch's profiler groups by input shape). Off by default; when off, the cost is one check of
//! a cached flag per op.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

type Table = BTreeMap<(String, &'static str), (u64, Duration)>;

static TABLE: Mutex<Table> = Mutex::new(BTreeMap::new());

/// What `WICK_PROFILE_OPS` asked for when this was first asked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    Ops,
    Shapes,
}

fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var_os("WICK_PROFILE_OPS") {
        Some(v) if v == "1" => Mode::Ops,
        Some(v) if v == "shapes" => Mode::Shapes,
        _ => Mode::Off,
    })
}

/// True when `WICK_PROFILE_OPS` was `1` or `shapes` when this was first asked.
pub fn enabled() -> bool {
    mode() != Mode::Off
}

/// Runs `f`, adding its time to `(op, phase)` when profiling is on; `shapes` (called only when
/// the rows are split by shape) names the operands' shapes.
pub(crate) fn time<R>(op: &str, phase: &'static str, shapes: impl FnOnce() -> String, f: impl FnOnce() -> R) -> R {
    let key = match mode() {
        Mode::Off => return f(),
        Mode::Ops => op.to_string(),
        Mode::Shapes => format!("{op} {}", shapes()),
    };
    let start = Instant::now();
    let out = f();
    let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let entry = table.entry((key, phase)).or_insert((0, Duration::ZERO));
    entry.0 += 1;
    entry.1 += start.elapsed();
    out
}

/// `dims` of each operand, as `[8, 64, 56, 56] · [256, 64, 1, 1]`.
fn shapes(dims: &[&[usize]]) -> String {
    dims.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(" · ")
}

/// The totals so far, longest first: op (with its operands' shapes under
/// `WICK_PROFILE_OPS=shapes`), phase, calls and milliseconds.
pub fn totals() -> Vec<(String, &'static str, u64, f64)> {
    let table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let mut rows: Vec<_> =
        table.iter().map(|((op, phase), (n, t))| (op.clone(), *phase, *n, t.as_secs_f64() * 1e3)).collect();
    rows.sort_by(|a, b| b.3.total_cmp(&a.3));
    rows
}

/// Clears the totals.
pub fn reset() {
    TABLE.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// The totals as a text table.
pub fn report() -> String {
    let rows = totals();
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(20);
    let mut out = format!("{:<width$} phase      calls        ms\n", "op");
    for (op, phase, n, ms) in rows {
        out.push_str(&format!("{op:<width$} {phase:<8} {n:>7} {ms:>9.1}\n"));
    }
    out
}

/// An op whose forward and backward are timed.
pub(crate) struct Profiled<C>(pub C);

/// Asks the CPU allocation check (`wick_alloc_check`, which candle's own CPU buffers go through)
/// for the gradients an op's backward is about to make: one per tracked CPU argument, shaped
/// like it. The kernels' buffers are plain vectors that candle never sees, so without this a
/// backward under a memory cgroup's limit took pages the kernel then ended the process for,
/// where the step should have failed with an error (a 168 M-parameter decoder's linear
/// backward, issue 48's cap demonstration).
fn ask_for_gradients(args: &[&Tensor]) -> Result<()> {
    let mut bytes = Some(0usize);
    for a in args.iter().filter(|a| a.track_op() && a.device().is_cpu()) {
        let own = a.elem_count().checked_mul(a.dtype().size_in_bytes());
        bytes = bytes.zip(own).and_then(|(sum, own)| sum.checked_add(own));
    }
    match bytes {
        Some(0) => Ok(()),
        bytes => wick_alloc_check::check(bytes).map_err(candle_core::Error::Msg),
    }
}

impl<C: CustomOp1> CustomOp1 for Profiled<C> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        time(self.0.name(), "forward", || shapes(&[l.dims()]), || self.0.cpu_fwd(s, l))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        time(self.0.name(), "forward", || shapes(&[l.dims()]), || self.0.cuda_fwd(s, l))
    }
    fn bwd(&self, arg: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        ask_for_gradients(&[arg])?;
        time(self.0.name(), "backward", || shapes(&[arg.dims()]), || self.0.bwd(arg, res, g))
    }
}

impl<C: CustomOp2> CustomOp2 for Profiled<C> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        time(self.0.name(), "forward", || shapes(&[l1.dims(), l2.dims()]), || self.0.cpu_fwd(s1, l1, s2, l2))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        time(self.0.name(), "forward", || shapes(&[l1.dims(), l2.dims()]), || self.0.cuda_fwd(s1, l1, s2, l2))
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        ask_for_gradients(&[a, b])?;
        time(self.0.name(), "backward", || shapes(&[a.dims(), b.dims()]), || self.0.bwd(a, b, res, g))
    }
}

impl<C: CustomOp3> CustomOp3 for Profiled<C> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        time(
            self.0.name(),
            "forward",
            || shapes(&[l1.dims(), l2.dims(), l3.dims()]),
            || self.0.cpu_fwd(s1, l1, s2, l2, s3, l3),
        )
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        time(
            self.0.name(),
            "forward",
            || shapes(&[l1.dims(), l2.dims(), l3.dims()]),
            || self.0.cuda_fwd(s1, l1, s2, l2, s3, l3),
        )
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        ask_for_gradients(&[a, b, c])?;
        time(self.0.name(), "backward", || shapes(&[a.dims(), b.dims(), c.dims()]), || self.0.bwd(a, b, c, res, g))
    }
}

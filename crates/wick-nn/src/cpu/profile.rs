//! Where a step's time goes, per op: with `WICK_PROFILE_OPS=1` in the environment every kernel
//! op's forward and backward are timed (wall clock, on the calling thread) and [`report`] prints
//! the totals. Off by default; when off, the cost is one check of a cached flag per op.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

type Table = BTreeMap<(&'static str, &'static str), (u64, Duration)>;

static TABLE: Mutex<Table> = Mutex::new(BTreeMap::new());

/// True when `WICK_PROFILE_OPS=1` was set when this was first asked.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("WICK_PROFILE_OPS").is_some_and(|v| v == "1"))
}

/// Runs `f`, adding its time to `(op, phase)` when profiling is on.
pub(crate) fn time<R>(op: &'static str, phase: &'static str, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let entry = table.entry((op, phase)).or_insert((0, Duration::ZERO));
    entry.0 += 1;
    entry.1 += start.elapsed();
    out
}

/// The totals so far, longest first: op, phase, calls and milliseconds.
pub fn totals() -> Vec<(&'static str, &'static str, u64, f64)> {
    let table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let mut rows: Vec<_> = table.iter().map(|((op, phase), (n, t))| (*op, *phase, *n, t.as_secs_f64() * 1e3)).collect();
    rows.sort_by(|a, b| b.3.total_cmp(&a.3));
    rows
}

/// Clears the totals.
pub fn reset() {
    TABLE.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

/// The totals as a text table.
pub fn report() -> String {
    let mut out = String::from("op                   phase      calls        ms\n");
    for (op, phase, n, ms) in totals() {
        out.push_str(&format!("{op:<20} {phase:<8} {n:>7} {ms:>9.1}\n"));
    }
    out
}

/// An op whose forward and backward are timed.
pub(crate) struct Profiled<C>(pub C);

impl<C: CustomOp1> CustomOp1 for Profiled<C> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        time(self.0.name(), "forward", || self.0.cpu_fwd(s, l))
    }
    fn bwd(&self, arg: &Tensor, res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        time(self.0.name(), "backward", || self.0.bwd(arg, res, g))
    }
}

impl<C: CustomOp2> CustomOp2 for Profiled<C> {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        time(self.0.name(), "forward", || self.0.cpu_fwd(s1, l1, s2, l2))
    }
    fn bwd(&self, a: &Tensor, b: &Tensor, res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        time(self.0.name(), "backward", || self.0.bwd(a, b, res, g))
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
        time(self.0.name(), "forward", || self.0.cpu_fwd(s1, l1, s2, l2, s3, l3))
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        time(self.0.name(), "backward", || self.0.bwd(a, b, c, res, g))
    }
}

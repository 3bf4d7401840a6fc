//! An on/off switch for one of the products' paths, read on every product: on unless the
//! environment turns it off for the whole process, or a call turns it off (or on again) for
//! side-by-side measurements in one process (`benches/paths_ab.rs`). Leaf of the gemm modules.

use std::sync::atomic::{AtomicU8, Ordering};

/// A path's switch: 0 until first read (then the environment decides), 1 on, 2 off.
pub(super) struct Switch {
    state: AtomicU8,
    /// The variable that turns the path off for a process when it is `0`.
    var: &'static str,
}

impl Switch {
    /// A switch that `var=0` in the environment turns off.
    pub(super) const fn new(var: &'static str) -> Self {
        Switch { state: AtomicU8::new(0), var }
    }

    /// True while the path is on.
    pub(super) fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let on = std::env::var_os(self.var).is_none_or(|v| v != "0");
                // Only where nothing was set meanwhile: a `set` call wins over the environment.
                let _ = self.state.compare_exchange(0, if on { 1 } else { 2 }, Ordering::Relaxed, Ordering::Relaxed);
                self.state.load(Ordering::Relaxed) == 1
            }
        }
    }

    /// Turns the path on or off from now on, whatever the environment says.
    pub(super) fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }
}

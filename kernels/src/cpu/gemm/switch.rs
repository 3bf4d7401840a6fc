//! An on/off switch for one of the products' paths, read on every product: as its default says
//! (on, or a test of the CPU) unless the environment sets it for the whole process (`0` off,
//! anything else on), or a call sets it for side-by-side measurements in one process
//! (`benches/paths_ab.rs`). Leaf of the gemm modules.

use std::sync::atomic::{AtomicU8, Ordering};

/// A path's switch: 0 until first read (then the environment decides), 1 on, 2 off.
pub(super) struct Switch {
    state: AtomicU8,
    /// The variable that sets the path for a process: `0` off, anything else on.
    var: &'static str,
    /// Whether the path is on where neither a call nor the environment says.
    default: fn() -> bool,
}

impl Switch {
    /// A switch, on by default, that `var=0` in the environment turns off.
    pub(super) const fn new(var: &'static str) -> Self {
        Switch { state: AtomicU8::new(0), var, default: || true }
    }

    /// A switch whose default `default` decides (once per process, on first read).
    pub(super) const fn with_default(var: &'static str, default: fn() -> bool) -> Self {
        Switch { state: AtomicU8::new(0), var, default }
    }

    /// True while the path is on.
    pub(super) fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let on = match std::env::var_os(self.var) {
                    Some(v) => v != "0",
                    None => (self.default)(),
                };
                // Only where nothing was set meanwhile: a `set` call wins over the environment.
                let _ = self.state.compare_exchange(0, if on { 1 } else { 2 }, Ordering::Relaxed, Ordering::Relaxed);
                self.state.load(Ordering::Relaxed) == 1
            }
        }
    }

    /// Turns the path on or off from now on, whatever the environment and the default say.
    pub(super) fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }
}

//! Which memory pool is current on a device when several wick pools are installed on it.
//!
//! A notebook cell that makes an engine is often run twice: the second engine installs its pool
//! while the first still exists, and the first is dropped later (when its variable is replaced).
//! Restoring "the pool that was current before me" on drop is wrong in both orders: dropping the
//! older engine would switch the device away from the newer engine's pool (its cap and figures
//! silently off), and dropping the newer one after that would re-install a pool that was already
//! destroyed. The rules here, applied through [`PoolDriver`] so they are tested without a GPU:
//!
//! - a pool dropped while another pool is current changes nothing (the newer pool stays current);
//! - a pool dropped while current hands over to the newest pool still alive on that device, or to
//!   the device's default pool — never to a pool that has gone;
//! - the registry of live pools belongs to the process's copy of this crate. Across notebook cells
//!   (each has its own copy of every `static`) a pool installed by another cell is not known here:
//!   the hand-over then falls back to the default pool, which is safe (never a destroyed pool, and
//!   a newer current pool is still never displaced), and the older engine reports its pool as not
//!   current ([`PoolStack::is_current`]).

use std::sync::Mutex;

/// The driver calls the rules need (cuDeviceGetMemPool, cuDeviceGetDefaultMemPool,
/// cuDeviceSetMemPool).
pub trait PoolDriver {
    /// A pool handle.
    type Pool: Copy + Eq;
    /// The device's current pool.
    fn current(&self, device: i32) -> Self::Pool;
    /// The device's default pool (always valid).
    fn default_pool(&self, device: i32) -> Self::Pool;
    /// Makes `pool` the device's current pool.
    fn set_current(&self, device: i32, pool: Self::Pool);
}

/// The live wick pools per device, oldest first.
#[derive(Debug)]
pub struct PoolStack<P> {
    live: Mutex<Vec<(i32, P)>>,
}

impl<P: Copy + Eq> Default for PoolStack<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Copy + Eq> PoolStack<P> {
    /// An empty registry (usable in a `static`).
    pub const fn new() -> Self {
        PoolStack { live: Mutex::new(Vec::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(i32, P)>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `pool` current on `device` and records it as the newest live pool there.
    pub fn install<D: PoolDriver<Pool = P>>(&self, driver: &D, device: i32, pool: P) {
        let mut live = self.lock();
        driver.set_current(device, pool);
        live.push((device, pool));
    }

    /// Forgets `pool` and, if it is the device's current pool, makes the newest live pool of the
    /// device current (else the default pool). Returns the pool made current, if any changed.
    pub fn remove<D: PoolDriver<Pool = P>>(&self, driver: &D, device: i32, pool: P) -> Option<P> {
        let mut live = self.lock();
        live.retain(|&(d, p)| !(d == device && p == pool));
        if driver.current(device) != pool {
            return None;
        }
        let next =
            live.iter().rev().find(|(d, _)| *d == device).map_or_else(|| driver.default_pool(device), |&(_, p)| p);
        driver.set_current(device, next);
        Some(next)
    }

    /// True when `pool` is the device's current pool (candle's allocations come from it).
    pub fn is_current<D: PoolDriver<Pool = P>>(&self, driver: &D, device: i32, pool: P) -> bool {
        driver.current(device) == pool
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// A driver with per-device current pools; pool 0 of each device is its default; destroyed
    /// pools are tracked so a test can check none is ever made current.
    #[derive(Default)]
    struct FakeDriver {
        current: RefCell<HashMap<i32, u32>>,
        destroyed: RefCell<Vec<u32>>,
    }

    impl PoolDriver for FakeDriver {
        type Pool = u32;
        fn current(&self, device: i32) -> u32 {
            *self.current.borrow().get(&device).unwrap_or(&0)
        }
        fn default_pool(&self, _device: i32) -> u32 {
            0
        }
        fn set_current(&self, device: i32, pool: u32) {
            assert!(!self.destroyed.borrow().contains(&pool), "pool {pool} was destroyed");
            self.current.borrow_mut().insert(device, pool);
        }
    }

    impl FakeDriver {
        fn drop_pool(&self, stack: &PoolStack<u32>, device: i32, pool: u32) {
            stack.remove(self, device, pool);
            self.destroyed.borrow_mut().push(pool);
        }
    }

    #[test]
    fn dropping_the_older_engine_keeps_the_newer_pool_current() {
        // The re-run notebook cell: A, then B, then A dropped, then B dropped.
        let (d, s) = (FakeDriver::default(), PoolStack::default());
        s.install(&d, 0, 1);
        s.install(&d, 0, 2);
        d.drop_pool(&s, 0, 1);
        assert_eq!(d.current(0), 2, "B's cap and figures stay on");
        d.drop_pool(&s, 0, 2);
        assert_eq!(d.current(0), 0, "back to the default pool, not the destroyed A");
    }

    #[test]
    fn dropping_the_newer_engine_hands_back_to_the_older_live_one() {
        let (d, s) = (FakeDriver::default(), PoolStack::default());
        s.install(&d, 0, 1);
        s.install(&d, 0, 2);
        s.install(&d, 1, 3); // another device is independent
        d.drop_pool(&s, 0, 2);
        assert_eq!(d.current(0), 1);
        assert!(s.is_current(&d, 0, 1));
        assert_eq!(d.current(1), 3);
        d.drop_pool(&s, 0, 1);
        assert_eq!(d.current(0), 0);
        d.drop_pool(&s, 1, 3);
        assert_eq!(d.current(1), 0);
    }

    #[test]
    fn a_pool_unknown_to_this_registry_is_never_displaced_or_restored() {
        // Another notebook cell (another copy of the registry) installed pool 9 after ours.
        let (d, s) = (FakeDriver::default(), PoolStack::default());
        s.install(&d, 0, 1);
        d.set_current(0, 9);
        d.drop_pool(&s, 0, 1);
        assert_eq!(d.current(0), 9, "the other cell's pool stays current");
        assert!(!s.is_current(&d, 0, 1));
    }
}

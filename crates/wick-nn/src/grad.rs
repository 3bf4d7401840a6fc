//! Gradient recording on and off (PyTorch's `torch.no_grad()` / `torch.is_grad_enabled()`):
//! inside [`no_grad`], wick's ops record no graph nodes, so an inference pass keeps nothing for a
//! backward pass that will not come.

use std::cell::Cell;

thread_local! {
    static NO_GRAD: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with gradient recording off on this thread (PyTorch's `torch.no_grad()`): the
/// kernels' ops record no graph nodes, so an inference pass keeps no activations for a backward
/// pass that will not come, even though the parameters are trainable `Var`s. Nests; the previous
/// setting is restored when `f` returns or unwinds.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            NO_GRAD.with(|n| n.set(self.0));
        }
    }
    let _restore = Restore(NO_GRAD.with(|n| n.replace(true)));
    f()
}

/// False inside [`no_grad`].
pub fn grad_enabled() -> bool {
    !NO_GRAD.with(|n| n.get())
}

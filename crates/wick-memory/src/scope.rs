//! Scopes: everything allocated through a scope is returned when the scope ends, whatever path
//! the code takes out of it (`?` included). Keeping a block past the scope is explicit (`keep`).

use std::cell::RefCell;

use crate::error::{MemoryError, Result};
use crate::resource::{AllocRequest, Allocation, MemoryResource, RawBlock};

/// What a scope gave back when it ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ScopeReport {
    /// Blocks returned.
    pub blocks: usize,
    /// Bytes returned, in block sizes (what `allocated_bytes` drops by).
    pub bytes: usize,
    /// Bytes the callers had asked for.
    pub requested_bytes: usize,
    /// Blocks moved out with `keep`.
    pub kept: usize,
}

/// A region whose allocations end with it.
pub struct Scope<'r, R: MemoryResource + ?Sized> {
    resource: &'r R,
    blocks: RefCell<Vec<Option<RawBlock>>>,
    kept: std::cell::Cell<usize>,
}

/// A block owned by a scope; valid while the scope lives.
#[derive(Debug, PartialEq, Eq)]
pub struct ScopedBlock<'s> {
    index: usize,
    /// The block's process-unique key: `keep` checks that the scope's entry is this block.
    key: (u64, u32, u32),
    addr: u64,
    size: usize,
    _scope: std::marker::PhantomData<&'s ()>,
}

impl ScopedBlock<'_> {
    /// Device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Bytes asked for.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl<'r, R: MemoryResource + ?Sized> Scope<'r, R> {
    /// A scope over `resource`.
    pub fn new(resource: &'r R) -> Self {
        Scope { resource, blocks: RefCell::new(Vec::new()), kept: std::cell::Cell::new(0) }
    }

    /// Allocates `size` bytes owned by the scope.
    pub fn allocate(&self, size: usize) -> Result<ScopedBlock<'_>> {
        self.allocate_with(AllocRequest::new(size))
    }

    /// Allocates as `request` says, owned by the scope.
    pub fn allocate_with(&self, request: AllocRequest) -> Result<ScopedBlock<'_>> {
        let block = self.resource.allocate_raw(request)?;
        let (addr, size, key) = (block.addr(), block.size(), block.key());
        let mut blocks = self.blocks.borrow_mut();
        blocks.push(Some(block));
        Ok(ScopedBlock { index: blocks.len() - 1, key, addr, size, _scope: std::marker::PhantomData })
    }

    /// Moves a block out of the scope on purpose: it then lives as an ordinary allocation. A
    /// block of another scope is refused (`ForeignBlock`) and stays where it is.
    pub fn keep(&self, block: ScopedBlock<'_>) -> Result<Allocation<'r, R>> {
        let raw = self
            .blocks
            .borrow_mut()
            .get_mut(block.index)
            .filter(|entry| entry.as_ref().is_some_and(|raw| raw.key() == block.key))
            .and_then(Option::take)
            .ok_or(MemoryError::ForeignBlock { addr: block.addr })?;
        self.kept.set(self.kept.get() + 1);
        Ok(Allocation::from_raw(self.resource, raw))
    }

    /// Blocks the scope still owns.
    pub fn live_blocks(&self) -> usize {
        self.blocks.borrow().iter().filter(|b| b.is_some()).count()
    }

    /// Ends the scope and reports what it returned.
    pub fn end(self) -> ScopeReport {
        self.release()
    }

    fn release(&self) -> ScopeReport {
        let mut report = ScopeReport { kept: self.kept.get(), ..ScopeReport::default() };
        // Return in reverse order of allocation, as a stack of activations would be.
        for block in self.blocks.borrow_mut().drain(..).rev().flatten() {
            let (bytes, requested) = (block.block_size(), block.size());
            if self.resource.deallocate_raw(block).is_ok() {
                report.blocks += 1;
                report.bytes += bytes;
                report.requested_bytes += requested;
            }
        }
        report
    }
}

impl<R: MemoryResource + ?Sized> Drop for Scope<'_, R> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Runs `body` in a scope and returns its result together with what the scope freed; the scope
/// ends on every path, errors included.
pub fn scoped<'r, R, T, F>(resource: &'r R, body: F) -> (Result<T>, ScopeReport)
where
    R: MemoryResource + ?Sized,
    F: FnOnce(&Scope<'r, R>) -> Result<T>,
{
    let scope = Scope::new(resource);
    let result = body(&scope);
    (result, scope.end())
}

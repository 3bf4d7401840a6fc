//! wick's cross-crate tests: flows that go through the allocator, the engine and the zoo together
//! (`tests/tests/`), and the README's code blocks, compiled and run as doc tests so the README
//! cannot drift from the API.

/// The README, whose `rust` blocks are doc tests of this crate.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct Readme;

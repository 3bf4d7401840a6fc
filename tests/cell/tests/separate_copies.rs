//! The situation evcxr creates, without evcxr: one process, two separately loaded copies of a
//! library that links wick and candle-core statically (a notebook's cells). The engine is made in
//! the first copy; a plain candle tensor far beyond the machine is made in the second — on its
//! own thread too — and is candle's `Err` there, although nothing was installed in that copy.

use std::path::{Path, PathBuf};

use libloading::{Library, Symbol};

/// The cdylib cargo built for this test (`crate-type = ["cdylib", "rlib"]`), beside the rlib.
fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let deps = exe.parent().expect("test binaries live in target/<profile>/deps");
    let name = format!("{}wick_cell{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX);
    [deps.join(&name), deps.join("..").join(&name)]
        .into_iter()
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found beside {}", deps.display()))
}

/// A copy of the library under a name of its own: the loader opens one file once, so each cell
/// is a separate file, as evcxr's are.
fn load_copy(from: &Path, dir: &Path, cell: &str) -> Library {
    let to = dir.join(format!("{cell}{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(from, &to).expect("copy the library");
    // SAFETY: the library is wick-cell, whose initialisers are Rust statics' (none run code at
    // load); it stays loaded until the end of the test.
    unsafe { Library::new(&to) }.expect("dlopen the copy")
}

fn call<T: Copy>(lib: &Library, name: &[u8]) -> T {
    // SAFETY: every name asked for is an `extern "C"` function of wick-cell of type `T`.
    let f: Symbol<T> = unsafe { lib.get(name) }.expect("the cell's symbol");
    *f
}

#[test]
fn a_tensor_made_in_a_later_cell_is_refused_without_anything_installed_in_that_cell() {
    let dir = std::env::temp_dir().join(format!("wick-cells-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib = cdylib();
    let cell1 = load_copy(&lib, &dir, "cell1");
    let cell10 = load_copy(&lib, &dir, "cell10");

    // Two copies: two sets of statics, as in a notebook.
    let mark1 = call::<extern "C" fn() -> usize>(&cell1, b"cell_mark")();
    let mark10 = call::<extern "C" fn() -> usize>(&cell10, b"cell_mark")();
    assert_ne!(mark1, mark10, "each copy has its own statics");

    // Cell 1 makes the engine, and registers something in its copy of wick-alloc-check that
    // cell 10's copy does not see: a heap release that counts its calls, called by cell 1's
    // check before it refuses 1 PiB and never by cell 10's, which refuses by itself.
    assert_eq!(call::<extern "C" fn() -> i32>(&cell1, b"cell_make_engine")(), wick_cell::ALLOCATED);
    call::<extern "C" fn()>(&cell1, b"cell_register_release")();
    let check1 = call::<extern "C" fn(u64) -> i32>(&cell1, b"cell_check");
    let check10 = call::<extern "C" fn(u64) -> i32>(&cell10, b"cell_check");
    let calls1 = call::<extern "C" fn() -> usize>(&cell1, b"cell_release_calls");
    let calls10 = call::<extern "C" fn() -> usize>(&cell10, b"cell_release_calls");
    assert_eq!(check1(1 << 50), wick_cell::REFUSED_OUT_OF_MEMORY);
    assert_eq!((calls1(), calls10()), (1, 0), "cell 1's copy saw its registration");
    assert_eq!(check10(1 << 50), wick_cell::REFUSED_OUT_OF_MEMORY, "cell 10's copy decides by itself");
    assert_eq!((calls1(), calls10()), (1, 0), "cell 10's copy did not see cell 1's registration");

    // Cell 10 makes a plain candle tensor of 4 TiB: candle's Err, on its thread and on another.
    let zeros10 = call::<extern "C" fn(u64, i32) -> i32>(&cell10, b"cell_zeros");
    assert_eq!(zeros10(1 << 42, 0), wick_cell::REFUSED_OUT_OF_MEMORY);
    assert_eq!(zeros10(1 << 42, 1), wick_cell::REFUSED_OUT_OF_MEMORY);
    // Ordinary sizes are made, in both copies.
    assert_eq!(zeros10(64 << 20, 0), wick_cell::ALLOCATED);
    let zeros1 = call::<extern "C" fn(u64, i32) -> i32>(&cell1, b"cell_zeros");
    assert_eq!(zeros1(64 << 20, 1), wick_cell::ALLOCATED);

    // A copy loaded before any engine exists in it refuses too.
    let cell0 = load_copy(&lib, &dir, "cell0");
    assert_eq!(
        call::<extern "C" fn(u64, i32) -> i32>(&cell0, b"cell_zeros")(1 << 42, 0),
        wick_cell::REFUSED_OUT_OF_MEMORY
    );
    std::fs::remove_dir_all(&dir).ok();
}

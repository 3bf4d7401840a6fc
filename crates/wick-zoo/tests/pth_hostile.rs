//! The legacy `.pth` reader against hostile and malformed files: each input here killed the
//! process (allocation abort, stack overflow) or passed silently before the reader was hardened;
//! each must now be an error that names the file, quickly.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use candle_core::Device;
use common::pth::{file, header, valid, Entry};
use wick_zoo::pth::read_legacy_pth_bytes;

const NAME: &str = "hostile.pth";

fn read(bytes: &[u8]) -> Result<Vec<(String, Vec<f32>)>, String> {
    let tensors = read_legacy_pth_bytes(bytes, Path::new(NAME), &Device::Cpu).map_err(|e| e.to_string())?;
    Ok(tensors.into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect())
}

/// The error for `bytes`, which must name the file, contain `needle` and come within a second.
fn refused(bytes: &[u8], needle: &str) {
    let start = Instant::now();
    let err = read(bytes).expect_err("a hostile file was accepted");
    assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
    assert!(err.starts_with(NAME), "error does not name the file: {err}");
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    assert!(err.len() < 400, "the error is not a summary ({} bytes)", err.len());
}

#[test]
fn a_valid_file_reads_back_its_values() {
    let tensors = read(&valid()).unwrap();
    let expected: Vec<(String, Vec<f32>)> =
        vec![("a.weight".into(), vec![1.0, 2.0, 3.0, 4.0]), ("a.bias".into(), vec![5.0, 6.0]), ("b".into(), vec![7.5])];
    assert_eq!(tensors, expected);
}

/// A legacy file whose state-dict pickle is `start` then `unit` `times` times.
fn state_pickle(start: &[u8], unit: &[u8], times: usize) -> Vec<u8> {
    let mut bytes = header();
    bytes.extend_from_slice(b"\x80\x02");
    bytes.extend_from_slice(start);
    bytes.extend(unit.repeat(times));
    bytes.push(b'.');
    bytes
}

#[test]
fn billion_laughs_through_the_memo_is_refused_without_expanding() {
    // 40 doublings of a tuple through BINPUT/BINGET: 2⁴⁰ leaves if memo values were copied.
    refused(&state_pickle(b"Nq\x00", b"h\x00h\x00\x86q\x00", 40), "not a state dict");
}

#[test]
fn a_million_nested_tuples_are_refused_without_recursing() {
    refused(&state_pickle(b"N", b"\x85", 1_000_000), "nested more than 64 deep");
}

#[test]
fn memo_copies_are_charged_against_a_budget() {
    // A list memoised after every append is copied on the next append: quadratic work from a
    // linear file. The budget stops it.
    refused(&state_pickle(b"]", b"q\x00Na", 200_000), "units of work");
}

fn entry<'a>(name: &'a str, key: &'a str, offset: i32, shape: &'a [i32], stride: &'a [i32]) -> Entry<'a> {
    Entry { name, key, class: "FloatStorage", numel: 4, offset, shape, stride }
}

#[test]
fn a_negative_storage_offset_is_an_error_not_zero() {
    let bytes = file(&[entry("w", "0", -1, &[2], &[1])], &[("0", &[1.0, 2.0, 3.0, 4.0])]);
    refused(&bytes, "negative offset -1");
}

#[test]
fn a_shape_whose_product_overflows_is_an_error() {
    let big = i32::MAX;
    let bytes = file(&[entry("w", "0", 0, &[big, big, big], &[1, 1, 1])], &[("0", &[1.0, 2.0, 3.0, 4.0])]);
    refused(&bytes, "too large");
}

#[test]
fn a_view_past_its_storage_is_an_error() {
    let bytes = file(&[entry("w", "0", 3, &[2], &[1])], &[("0", &[1.0, 2.0, 3.0, 4.0])]);
    refused(&bytes, "reaches past its storage");
}

#[test]
fn one_storage_read_as_two_dtypes_is_an_error() {
    let mut other = entry("v", "0", 0, &[2], &[1]);
    other.class = "DoubleStorage";
    let bytes = file(&[entry("w", "0", 0, &[2], &[1]), other], &[("0", &[1.0, 2.0, 3.0, 4.0])]);
    refused(&bytes, "storage 0 is used as");
}

#[test]
fn a_name_given_twice_is_an_error() {
    let bytes =
        file(&[entry("w", "0", 0, &[2], &[1]), entry("w", "0", 2, &[2], &[1])], &[("0", &[1.0, 2.0, 3.0, 4.0])]);
    refused(&bytes, "`w` appears twice");
}

#[test]
fn a_storage_written_twice_is_an_error() {
    let bytes = file(&[entry("w", "0", 0, &[2], &[1])], &[("0", &[1.0, 2.0, 3.0, 4.0]), ("0", &[1.0, 2.0, 3.0, 4.0])]);
    refused(&bytes, "stored twice");
}

#[test]
fn truncated_files_are_errors_at_every_length() {
    let bytes = valid();
    for len in 0..bytes.len() {
        let err = read(&bytes[..len]).expect_err("a truncated file was accepted");
        assert!(err.starts_with(NAME), "{err}");
    }
}

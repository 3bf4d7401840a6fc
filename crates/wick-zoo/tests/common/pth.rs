//! Writes legacy (pre-1.6) `.pth` files byte by byte, for tests of the reader: the same layout
//! `torch.save(..., _use_new_zipfile_serialization=False)` produces with pickle protocol 2.
#![allow(dead_code)] // each test binary uses a different subset

/// A tensor entry: `name` viewing storage `key` (`class` such as `FloatStorage`, `numel`
/// elements) at `offset` with `shape` and `stride`.
pub struct Entry<'a> {
    pub name: &'a str,
    pub key: &'a str,
    pub class: &'a str,
    pub numel: i32,
    pub offset: i32,
    pub shape: &'a [i32],
    pub stride: &'a [i32],
}

/// The magic number, protocol and system-information pickles every legacy file starts with.
pub fn header() -> Vec<u8> {
    let mut out = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.".to_vec();
    out.extend_from_slice(b"\x80\x02M\xe9\x03.");
    out.extend_from_slice(b"\x80\x02}q\x00(");
    out.extend(string("little_endian"));
    out.extend_from_slice(b"\x88u.");
    out
}

/// `BINUNICODE` of `s`.
pub fn string(s: &str) -> Vec<u8> {
    let mut out = vec![b'X'];
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    out
}

fn int(v: i32) -> Vec<u8> {
    let mut out = vec![b'J'];
    out.extend_from_slice(&v.to_le_bytes());
    out
}

fn tuple(items: &[i32]) -> Vec<u8> {
    let mut out = vec![b'('];
    items.iter().for_each(|&i| out.extend(int(i)));
    out.push(b't');
    out
}

/// The state-dict pickle: an OrderedDict of the entries.
pub fn state_dict(entries: &[Entry<'_>]) -> Vec<u8> {
    let mut out = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(".to_vec();
    for e in entries {
        out.extend(string(e.name));
        out.extend_from_slice(b"ctorch._utils\n_rebuild_tensor_v2\n((");
        out.extend(string("storage"));
        out.extend_from_slice(format!("ctorch\n{}\n", e.class).as_bytes());
        out.extend(string(e.key));
        out.extend(string("cpu"));
        out.extend(int(e.numel));
        out.extend_from_slice(b"NtQ");
        out.extend(int(e.offset));
        out.extend(tuple(e.shape));
        out.extend(tuple(e.stride));
        out.extend_from_slice(b"\x89}tR");
    }
    out.extend_from_slice(b"u.");
    out
}

/// The storage-key list pickle and the storages' data (element count, then little-endian f32s).
pub fn storages(storages: &[(&str, &[f32])]) -> Vec<u8> {
    let mut out = b"\x80\x02](".to_vec();
    storages.iter().for_each(|(k, _)| out.extend(string(k)));
    out.extend_from_slice(b"e.");
    for (_, data) in storages {
        out.extend_from_slice(&(data.len() as i64).to_le_bytes());
        data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    }
    out
}

/// A whole file: header, state dict over float storages, storages.
pub fn file(entries: &[Entry<'_>], data: &[(&str, &[f32])]) -> Vec<u8> {
    let mut out = header();
    out.extend(state_dict(entries));
    out.extend(storages(data));
    out
}

/// Two tensors over one storage and one over another: a valid file.
pub fn valid() -> Vec<u8> {
    file(
        &[
            Entry {
                name: "a.weight",
                key: "0",
                class: "FloatStorage",
                numel: 6,
                offset: 0,
                shape: &[2, 2],
                stride: &[2, 1],
            },
            Entry { name: "a.bias", key: "0", class: "FloatStorage", numel: 6, offset: 4, shape: &[2], stride: &[1] },
            Entry { name: "b", key: "1", class: "FloatStorage", numel: 1, offset: 0, shape: &[], stride: &[] },
        ],
        &[("0", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), ("1", &[7.5])],
    )
}

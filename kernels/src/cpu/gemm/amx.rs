//! bf16 × bf16 → f32 products on Intel's AMX tile unit (`tdpbf16ps`; Sapphire Rapids and later
//! Xeons), the kernel [`super::bf16`] runs where the CPU and the OS offer it.
//!
//! Why: on these CPUs `vdpbf16ps` issues on one port, so the AVX-512 bf16 kernel does no more
//! multiply-adds per cycle than the f32 FMAs it replaces, and AMP steps were slower than f32
//! ones. One `tdpbf16ps` multiplies a 16 × 32 tile of `a` by a 32 × 16 tile of `b` into 16 × 16
//! f32 sums (8 192 multiply-adds), over ten times the f32 FMAs' rate on one core, so the
//! products become bound by packing and memory rather than arithmetic (figures: BENCHMARKS.md,
//! "On a Xeon with AMX"). oneDNN's bf16 kernels behind PyTorch's
//! CPU autocast use the same unit.
//!
//! Layout: the blocking of [`super::bf16`] (`KC`-deep slices, `NC`-column blocks, parts
//! per thread), with 32 × 32 micro-tiles (2 × 2 tiles of sums in `tmm0..3`, two tiles of `a` in
//! `tmm4..5`, two of `b` in `tmm6..7`). `b` is packed as there (k-pairs × 32 lanes: the rows of
//! a `b` tile); `a` row by row (a row's k-pairs consecutive: the rows of an `a` tile). Both are
//! zero-padded to whole 16-pair steps, so every tile is full-sized and one tile configuration
//! serves the whole product.
//!
//! Numerics: as `vdpbf16ps` — exact products, f32 sums rounded to nearest even, subnormal
//! inputs and results treated as zero; the order of the additions within a 32-deep step is the
//! unit's. Tests compare with an f64 product.
//!
//! The OS keeps a process's tile state off until it asks for it (Linux ≥ 5.16:
//! `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once and is false
//! when it is refused, when the CPU lacks the unit, or when `WICK_CPU_AMX=0` turns it off (then
//! the AVX-512 kernel runs).

use half::bf16;

use super::blocking::{Dest, KMajor, Part, KC, NC};
use super::pack::{pack, pair};

/// Rows of a micro-tile (two 16-row tiles).
pub(super) const MR: usize = 32;
/// Columns of a micro-tile (two 16-column tiles).
pub(super) const NR: usize = 32;
/// k-pairs per tile step (a tile row is 64 bytes: 16 pairs of `a`, 16 lanes of `b`).
const STEP: usize = 16;
/// Rows of a block (its packed `a`, 32 KiB per panel at full depth, stays in the L2 cache).
const MC: usize = 128;

/// True when [`Part::product_amx`] can run: x86-64 Linux, a CPU with AMX-TILE, AMX-BF16,
/// AVX-512F, AVX-512BW and AVX512-BF16 (packing and the stores use them), the OS's permission for the tile
/// state, and `WICK_CPU_AMX` not `0`. Decided once per process.
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid_count, __get_cpuid_max};
    if std::env::var_os("WICK_CPU_AMX").is_some_and(|v| v == "0") {
        return false;
    }
    if !(std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512bf16"))
    {
        return false;
    }
    // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86-64 CPU; leaf 7 is read only when the CPU reports it.
    let edx = unsafe {
        if __get_cpuid_max(0).0 < 7 {
            return false;
        }
        __cpuid_count(7, 0).edx
    };
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    /// `arch_prctl` code that asks for an extended state component (Linux's asm/prctl.h).
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    /// The tile data's state component (XTILEDATA, bit 18 of XCR0).
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a system call with integer arguments; it only changes which state the kernel
    // saves for this process. A kernel without AMX support refuses it (non-zero).
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The tile configuration (palette 1: eight tiles of 16 rows × 64 bytes) loaded on this thread
/// while the value lives; dropping it releases the tile state. Not `Send`: the configuration
/// belongs to the thread that loaded it.
struct Tiles(std::marker::PhantomData<*const ()>);

/// `ldtilecfg`'s 64-byte operand.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile.
    colsb: [u16; 16],
    /// Rows of each tile.
    rows: [u8; 16],
}

impl Tiles {
    /// Loads the configuration.
    ///
    /// # Safety
    /// [`available`] returned true.
    #[cfg(target_arch = "x86_64")]
    unsafe fn configure() -> Self {
        let mut config = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for t in 0..8 {
            config.colsb[t] = 64;
            config.rows[t] = 16;
        }
        // SAFETY: the CPU has AMX and the OS enabled its state (the caller's contract); the
        // operand is 64 readable bytes.
        unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly, preserves_flags)) };
        Tiles(std::marker::PhantomData)
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the configuration was loaded (`configure`), so the CPU has AMX.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// The 32 × 32 product of a packed `a` panel (32 rows of `steps`·16 k-pairs) and a packed `b`
/// panel (`steps`·16 k-pairs of 32 lanes), stored row-major into `c`.
///
/// # Safety
/// `_tiles` was configured on this thread (so the CPU has AMX).
#[cfg(target_arch = "x86_64")]
unsafe fn micro_kernel(_tiles: &Tiles, steps: usize, a: &[u32], b: &[u32], c: &mut [f32; MR * NR]) {
    assert!(steps > 0 && a.len() >= MR * steps * STEP && b.len() >= NR * steps * STEP, "gemm_amx: short panels");
    let a_row = steps * STEP * 4;
    // SAFETY: every tile load reads 16 rows of 64 bytes: `a`'s at rows 0..16 and 16..32 of the
    // panel (stride one packed row), `b`'s at lanes 0..16 and 16..32 of 16 pairs (stride 128
    // bytes), stepping 64 and 2048 bytes `steps` times — inside the panels (checked above). The
    // stores write the four 16 × 16 quarters of `c` (stride 128 bytes).
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b} + {sb}*1]",
            "tileloadd tmm7, [{b} + {sb}*1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b}, 2048",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c0} + {sb}*1], tmm0",
            "tilestored [{c0} + {sb}*1 + 64], tmm1",
            "tilestored [{c1} + {sb}*1], tmm2",
            "tilestored [{c1} + {sb}*1 + 64], tmm3",
            a0 = inout(reg) a.as_ptr() => _,
            a1 = inout(reg) a.as_ptr().add(16 * steps * STEP) => _,
            b = inout(reg) b.as_ptr() => _,
            n = inout(reg) steps => _,
            sa = in(reg) a_row,
            sb = in(reg) 4 * NR,
            c0 = in(reg) c.as_mut_ptr(),
            c1 = in(reg) c.as_mut_ptr().add(16 * NR),
            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
            out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
            options(nostack),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
impl Tiles {
    unsafe fn configure() -> Self {
        unreachable!("gemm_amx: available() is false off x86-64")
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn micro_kernel(_: &Tiles, _: usize, _: &[u32], _: &[u32], _: &mut [f32; MR * NR]) {
    unreachable!("gemm_amx: available() is false off x86-64")
}

/// `dst = beta·sums (+ dst when add)`, 16 elements at a time with AVX-512.
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn store<D: Dest>(dst: &mut [D], sums: &[f32], beta: f32, add: bool) {
    let len = dst.len().min(sums.len());
    let whole = len / 16 * 16;
    let scale = std::arch::x86_64::_mm512_set1_ps(beta);
    for i in (0..whole).step_by(16) {
        // SAFETY: 16 elements from i are inside both slices; the features are this function's.
        unsafe {
            let s = std::arch::x86_64::_mm512_loadu_ps(sums.as_ptr().add(i));
            D::put16(dst.as_mut_ptr().add(i), s, scale, add);
        }
    }
    D::put(&mut dst[whole..len], &sums[whole..len], beta, add);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn store<D: Dest>(dst: &mut [D], sums: &[f32], beta: f32, add: bool) {
    D::put(dst, sums, beta, add);
}

impl<D: Dest> Part<'_, D> {
    /// This part of `beta·a·b (+ dst)` on the tile unit, block by block. Call only when
    /// [`available`].
    pub(super) fn product_amx(&self, a: &KMajor<'_>, b: &KMajor<'_>, k: usize, beta: f32, accumulate: bool) {
        assert!(available(), "gemm_amx: the tile unit is not available");
        // SAFETY: available() (checked above).
        let tiles = unsafe { Tiles::configure() };
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        let mut sums = [0f32; MR * NR];
        let m = self.rows.len();
        for c0 in self.cols.clone().step_by(NC) {
            let cols = NC.min(self.cols.end - c0);
            for (slice, k0) in (0..k).step_by(2 * KC).enumerate() {
                let depth = (2 * KC).min(k - k0);
                let padded = depth.div_ceil(2).next_multiple_of(STEP);
                pack_rows(a, (self.rows.start, m), (k0, depth), padded, &mut pa);
                pack(b, (c0, cols), (k0, depth), NR, padded, &mut pb);
                let add = accumulate || slice > 0;
                for r0 in (0..m.div_ceil(MR)).step_by(MC / MR) {
                    for jp in 0..cols.div_ceil(NR) {
                        let bp = &pb[jp * NR * padded..][..NR * padded];
                        let width = NR.min(cols - jp * NR);
                        for ip in r0..(r0 + MC / MR).min(m.div_ceil(MR)) {
                            let ap = &pa[ip * MR * padded..][..MR * padded];
                            // SAFETY: `tiles` was configured on this thread.
                            unsafe { micro_kernel(&tiles, padded / STEP, ap, bp, &mut sums) };
                            for i in 0..MR.min(m - ip * MR) {
                                let row = self.rows.start + ip * MR + i;
                                // SAFETY: parts are disjoint rectangles of the destination, and
                                // within one part each (row, column panel) is written once at a
                                // time.
                                let dst = unsafe { self.out.range(row * self.n + c0 + jp * NR, width) };
                                // SAFETY: available() implies AVX-512F and AVX512-BF16.
                                unsafe { store(dst, &sums[i * NR..][..width], beta, add) };
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Packs rows `r0..r0+count` of `v`, depths `k0..k0+depth`, as panels of [`MR`] rows, each row
/// `padded` k-pairs (depth 2p in the low half of pair p, 2p+1 in the high): the rows of the
/// tile unit's `a` operand. Pairs past the depth and rows past `count` are zero.
fn pack_rows(v: &KMajor<'_>, rows: (usize, usize), depths: (usize, usize), padded: usize, out: &mut Vec<u32>) {
    let len = rows.1.div_ceil(MR) * MR * padded;
    if out.len() < len {
        out.resize(len, 0);
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw")]
        fn wide(v: &KMajor<'_>, rows: (usize, usize), depths: (usize, usize), padded: usize, out: &mut [u32]) {
            pack_rows_into(v, rows, depths, padded, out)
        }
        // SAFETY: callers run only when available(), which requires AVX-512F and AVX-512BW.
        unsafe { wide(v, rows, depths, padded, &mut out[..len]) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    pack_rows_into(v, rows, depths, padded, &mut out[..len])
}

/// Rows (and pairs) per block of [`pack_rows_into`]'s transposition.
const BLOCK: usize = 16;

#[inline(always)]
fn pack_rows_into(
    v: &KMajor<'_>,
    (r0, count): (usize, usize),
    (k0, depth): (usize, usize),
    padded: usize,
    out: &mut [u32],
) {
    let (pairs, whole) = (depth.div_ceil(2), depth / 2);
    if v.step == 1 {
        // A row's depths are neighbours: its pairs are its elements two by two.
        for (i, dst) in out.chunks_exact_mut(padded).enumerate() {
            if i >= count {
                dst.fill(0);
                continue;
            }
            let row = &v.data[(r0 + i) * v.outer + k0..][..depth];
            for (d, t) in dst[..whole].iter_mut().zip(row.chunks_exact(2)) {
                *d = pair(t[0], t[1]);
            }
            if depth % 2 == 1 {
                dst[whole] = pair(row[depth - 1], bf16::ZERO);
            }
            dst[pairs..].fill(0);
        }
        return;
    }
    // Rows at any other stride (`outer == 1`: a transposed operand, the rows neighbours along
    // each depth): a block of pairs × rows gathered along the rows, then written along the pairs.
    let at = |r: usize, q: usize| v.data[r * v.outer + q * v.step];
    let mut block = [[0u32; BLOCK]; BLOCK];
    for i0 in (0..count).step_by(BLOCK) {
        let live = BLOCK.min(count - i0);
        for p0 in (0..pairs).step_by(BLOCK) {
            let np = BLOCK.min(pairs - p0);
            for (p, lanes) in block.iter_mut().enumerate().take(np) {
                let q = k0 + 2 * (p0 + p);
                let odd = p0 + p < whole;
                for (i, lane) in lanes.iter_mut().enumerate().take(live) {
                    let r = r0 + i0 + i;
                    *lane = pair(at(r, q), if odd { at(r, q + 1) } else { bf16::ZERO });
                }
            }
            for i in 0..live {
                let dst = &mut out[(i0 + i) * padded + p0..][..np];
                for (p, d) in dst.iter_mut().enumerate() {
                    *d = block[p][i];
                }
            }
        }
        for i in 0..live {
            out[(i0 + i) * padded + pairs..(i0 + i + 1) * padded].fill(0);
        }
    }
    out[count * padded..].fill(0);
}

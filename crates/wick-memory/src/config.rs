//! Allocator policy with PyTorch's documented defaults (`c10/cuda/CUDACachingAllocator.cpp`,
//! `CUDAAllocatorConfig`), and a parser for the same `key:value,...` strings
//! (`PYTORCH_CUDA_ALLOC_CONF`), read by wick from `WICK_ALLOC_CONF`.

use crate::error::{MemoryError, Result};

const MIB: usize = 1 << 20;

/// The environment variables an allocator's policy is read from, in order of precedence.
pub const ALLOC_CONF_VARS: [&str; 2] = ["WICK_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"];

/// The allocator setting in this process's environment: the first of [`ALLOC_CONF_VARS`] that is set
/// (name and text), or `None`.
pub fn alloc_conf_env() -> Option<(&'static str, String)> {
    ALLOC_CONF_VARS.iter().find_map(|name| std::env::var(name).ok().map(|text| (*name, text)))
}

/// How many power-of-two intervals `roundup_power2_divisions` can configure (PyTorch: 64 in
/// recent versions, indexed by `log2(size)` above 1 MiB; 16 covers up to 32 GiB requests and
/// the last interval applies beyond).
pub const POWER2_INTERVALS: usize = 16;

/// The most divisions `roundup_power2_divisions` accepts per interval: at the smallest interval
/// (1–2 MiB) 2048 divisions are already 512 B steps, the block granularity, so more cannot
/// change any rounding; PyTorch's documented settings use 1–16.
pub const MAX_POWER2_DIVISIONS: usize = 2048;

/// A hard cap on reserved memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MemoryLimit {
    /// At most this many bytes.
    Bytes(usize),
    /// At most this fraction (0, 1] of the device's capacity (PyTorch's `set_per_process_memory_fraction`).
    Fraction(f64),
}

impl MemoryLimit {
    /// The cap in bytes for a device of `capacity` bytes.
    pub fn resolve(self, capacity: usize) -> Result<usize> {
        match self {
            MemoryLimit::Bytes(b) => Ok(b),
            MemoryLimit::Fraction(f) if f > 0.0 && f <= 1.0 => Ok((capacity as f64 * f) as usize),
            MemoryLimit::Fraction(f) => {
                Err(MemoryError::InvalidConfig(format!("memory fraction {f} is not in (0, 1]")))
            }
        }
    }
}

/// The caching policy. `Default` is PyTorch's.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocatorConfig {
    /// Every request is rounded up to a multiple of this (512 B).
    pub min_block_size: usize,
    /// Requests up to this size use the small pool (1 MiB).
    pub small_size: usize,
    /// Segment size for small-pool requests (2 MiB).
    pub small_buffer: usize,
    /// Segment size for requests between `small_size` and `min_large_alloc` (20 MiB).
    pub large_buffer: usize,
    /// Requests at least this big get a segment of their own (10 MiB).
    pub min_large_alloc: usize,
    /// Own-segment sizes are rounded up to a multiple of this (2 MiB).
    pub round_large: usize,
    /// Blocks this size or larger are never split; `usize::MAX` disables the rule.
    pub max_split_size: usize,
    /// An unsplittable block serves a request only if it is at most this much bigger (20 MiB).
    pub max_non_split_rounding: usize,
    /// Per power-of-two interval (index `log2(size) - 20`, clamped), how many divisions to round
    /// requests to; 0 or 1 means plain 512 B rounding.
    pub roundup_power2_divisions: [usize; POWER2_INTERVALS],
    /// Fraction of the cap above which cached large blocks are reclaimed oldest-first.
    pub garbage_collection_threshold: Option<f64>,
    /// Hard cap on reserved memory, checked before any new segment.
    pub limit: Option<MemoryLimit>,
    /// One address-space reservation per stream and pool, mapped on demand in 2 MiB (small) or
    /// 20 MiB (large) pages, instead of separate segments (PyTorch's `expandable_segments`).
    pub expandable_segments: bool,
}

/// wick's defaults: PyTorch's policy ([`AllocatorConfig::pytorch`]) with expandable segments on.
///
/// Rationale: PyTorch keeps `expandable_segments` off by default only because memory mapped that
/// way cannot be shared through CUDA IPC; wick offers no IPC, and on every trace and recorded
/// run measured (BENCHMARKS.md, "Expandable segments as the default") they reserve less for the
/// same allocations — far less where request sizes vary (an inference server's trace: 24.2 →
/// 8.8 GiB reserved). A backend that cannot reserve address space gets PyTorch's classic
/// segments from [`crate::CachingAllocator::new`]; `expandable_segments:False` asks for them.
impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig { expandable_segments: true, ..AllocatorConfig::pytorch() }
    }
}

impl AllocatorConfig {
    /// PyTorch's documented defaults (`CUDACachingAllocator`): the reference the policy's tests
    /// check against, with classic segments (expandable segments off).
    pub fn pytorch() -> Self {
        AllocatorConfig {
            min_block_size: 512,
            small_size: MIB,
            small_buffer: 2 * MIB,
            large_buffer: 20 * MIB,
            min_large_alloc: 10 * MIB,
            round_large: 2 * MIB,
            max_split_size: usize::MAX,
            max_non_split_rounding: 20 * MIB,
            roundup_power2_divisions: [0; POWER2_INTERVALS],
            garbage_collection_threshold: None,
            limit: None,
            expandable_segments: false,
        }
    }

    /// Parses PyTorch-style settings over wick's defaults ([`AllocatorConfig::default`]), e.g.
    /// `max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6`.
    /// wick also accepts `memory_fraction:0.8` and `memory_limit_mb:4096`. Unknown keys are errors.
    pub fn parse(text: &str) -> Result<Self> {
        Self::parse_over(AllocatorConfig::default(), text)
    }

    /// Parses PyTorch-style settings (as [`AllocatorConfig::parse`]) over `base` instead of
    /// wick's defaults: keys not named keep `base`'s values.
    pub fn parse_over(base: AllocatorConfig, text: &str) -> Result<Self> {
        let mut config = base;
        for item in split_top_level(text) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| MemoryError::InvalidConfig(format!("`{item}` is not `key:value`")))?;
            let value = value.trim();
            match key.trim() {
                "max_split_size_mb" => {
                    let mb = parse_number::<usize>(key, value)?;
                    // PyTorch requires more than the large-buffer size (20 MiB).
                    if mb <= config.large_buffer / MIB {
                        return Err(MemoryError::InvalidConfig(format!(
                            "max_split_size_mb must be greater than {} (got {mb})",
                            config.large_buffer / MIB
                        )));
                    }
                    config.max_split_size = mb.checked_mul(MIB).ok_or_else(|| too_big(key))?;
                }
                "max_non_split_rounding_mb" => {
                    let mb = parse_number::<usize>(key, value)?;
                    config.max_non_split_rounding = mb.checked_mul(MIB).ok_or_else(|| too_big(key))?;
                }
                "roundup_power2_divisions" => {
                    config.roundup_power2_divisions = parse_divisions(value)?;
                }
                "garbage_collection_threshold" => {
                    let t = parse_number::<f64>(key, value)?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(MemoryError::InvalidConfig(format!(
                            "garbage_collection_threshold must be in (0, 1) (got {t})"
                        )));
                    }
                    config.garbage_collection_threshold = Some(t);
                }
                "expandable_segments" => {
                    config.expandable_segments = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        other => {
                            return Err(MemoryError::InvalidConfig(format!(
                                "expandable_segments: `{other}` is not True or False"
                            )))
                        }
                    };
                }
                "memory_fraction" => {
                    let f = parse_number::<f64>(key, value)?;
                    MemoryLimit::Fraction(f).resolve(1)?;
                    config.limit = Some(MemoryLimit::Fraction(f));
                }
                "memory_limit_mb" => {
                    let mb = parse_number::<usize>(key, value)?;
                    config.limit = Some(MemoryLimit::Bytes(mb.checked_mul(MIB).ok_or_else(|| too_big(key))?));
                }
                other => {
                    return Err(MemoryError::InvalidConfig(format!(
                        "unknown key `{other}` (known: max_split_size_mb, max_non_split_rounding_mb, \
                         roundup_power2_divisions, garbage_collection_threshold, expandable_segments, memory_fraction, \
                         memory_limit_mb)"
                    )))
                }
            }
        }
        Ok(config)
    }

    /// Reads `WICK_ALLOC_CONF`, else `PYTORCH_CUDA_ALLOC_CONF` (so settings made for PyTorch
    /// carry over), over wick's defaults; wick's defaults when neither is set.
    pub fn from_env() -> Result<Self> {
        match alloc_conf_env() {
            Some((_, text)) => Self::parse(&text),
            None => Ok(Self::default()),
        }
    }

    /// Checks internal consistency.
    pub fn validate(&self) -> Result<()> {
        if !self.min_block_size.is_power_of_two() || self.min_block_size < 512 {
            return Err(MemoryError::InvalidConfig("min_block_size must be a power of two ≥ 512".into()));
        }
        if self.small_size > self.small_buffer || self.min_large_alloc > self.large_buffer {
            return Err(MemoryError::InvalidConfig("segment sizes must cover their request classes".into()));
        }
        if self.round_large == 0 || !self.round_large.is_multiple_of(self.min_block_size) {
            return Err(MemoryError::InvalidConfig("round_large must be a multiple of min_block_size".into()));
        }
        if let Some(limit) = self.limit {
            limit.resolve(1)?;
        }
        Ok(())
    }

    /// PyTorch's `round_size`: the block size a request of `size` bytes gets, or `None` on overflow.
    pub fn round_size(&self, size: usize) -> Option<usize> {
        if size < self.min_block_size {
            return Some(self.min_block_size);
        }
        let divisions = self.divisions_for(size);
        if divisions > 1 && self.min_block_size.checked_mul(divisions).is_some_and(|floor| size > floor) {
            return round_power2_division(size, divisions);
        }
        size.checked_next_multiple_of(self.min_block_size)
    }

    /// PyTorch's `get_allocation_size`: the segment reserved for a rounded request.
    pub fn segment_size(&self, rounded: usize) -> Option<usize> {
        if rounded <= self.small_size {
            Some(self.small_buffer)
        } else if rounded < self.min_large_alloc {
            Some(self.large_buffer)
        } else {
            rounded.checked_next_multiple_of(self.round_large)
        }
    }

    /// True when a (rounded) request belongs to the small pool.
    pub fn is_small(&self, rounded: usize) -> bool {
        rounded <= self.small_size
    }

    fn divisions_for(&self, size: usize) -> usize {
        let log = usize::BITS as usize - 1 - size.leading_zeros() as usize;
        let index = log.saturating_sub(20).min(POWER2_INTERVALS - 1);
        self.roundup_power2_divisions[index]
    }
}

/// Rounds `size` (> 0) up to the next of `divisions` (> 0) equal steps between two powers of
/// two; `None` when that is not representable.
fn round_power2_division(size: usize, divisions: usize) -> Option<usize> {
    if size == 0 || divisions == 0 || size.is_power_of_two() {
        return Some(size);
    }
    let floor = 1usize << (usize::BITS - 1 - size.leading_zeros());
    let divisions = 1usize << (usize::BITS - 1 - divisions.leading_zeros());
    let step = floor / divisions;
    if step == 0 {
        return floor.checked_mul(2);
    }
    let rounded_floor = size & !(step - 1);
    if rounded_floor == size {
        Some(size)
    } else {
        rounded_floor.checked_add(step)
    }
}

fn too_big(key: &str) -> MemoryError {
    MemoryError::InvalidConfig(format!("{key} is too large"))
}

fn parse_number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T> {
    value.parse::<T>().map_err(|_| MemoryError::InvalidConfig(format!("{key}: `{value}` is not a valid number")))
}

/// Splits on commas that are not inside brackets.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn parse_divisions(value: &str) -> Result<[usize; POWER2_INTERVALS]> {
    let check = |d: usize| -> Result<usize> {
        if d > MAX_POWER2_DIVISIONS {
            Err(MemoryError::InvalidConfig(format!(
                "roundup_power2_divisions: {d} is more than {MAX_POWER2_DIVISIONS} (finer steps than 512 B change nothing)"
            )))
        } else if d == 0 || d.is_power_of_two() {
            Ok(d)
        } else {
            Err(MemoryError::InvalidConfig(format!("roundup_power2_divisions: {d} is not a power of two")))
        }
    };
    if let Some(inner) = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
        let mut table = [0usize; POWER2_INTERVALS];
        let mut last_index = 0usize;
        for entry in inner.split(',') {
            let (size, div) = entry.split_once(':').ok_or_else(|| {
                MemoryError::InvalidConfig(format!("roundup_power2_divisions: `{entry}` is not `size_mb:divisions`"))
            })?;
            let div = check(parse_number::<usize>("roundup_power2_divisions", div.trim())?)?;
            if size.trim() == ">" {
                for slot in table.iter_mut().skip(last_index + 1) {
                    *slot = div;
                }
                continue;
            }
            let mb = parse_number::<usize>("roundup_power2_divisions", size.trim())?;
            if !mb.is_power_of_two() {
                return Err(MemoryError::InvalidConfig(format!(
                    "roundup_power2_divisions: interval {mb} MB is not a power of two"
                )));
            }
            let index = (mb.trailing_zeros() as usize).min(POWER2_INTERVALS - 1);
            table[index] = div;
            last_index = index;
        }
        Ok(table)
    } else {
        let div = check(parse_number::<usize>("roundup_power2_divisions", value)?)?;
        Ok([div; POWER2_INTERVALS])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pytorch_rounding() {
        let c = AllocatorConfig::pytorch();
        assert_eq!(c.round_size(1), Some(512));
        assert_eq!(c.round_size(512), Some(512));
        assert_eq!(c.round_size(513), Some(1024));
        assert_eq!(c.round_size(usize::MAX), None);
        assert_eq!(c.segment_size(512), Some(2 * MIB));
        assert_eq!(c.segment_size(MIB), Some(2 * MIB));
        assert_eq!(c.segment_size(MIB + 512), Some(20 * MIB));
        assert_eq!(c.segment_size(10 * MIB), Some(10 * MIB));
        assert_eq!(c.segment_size(11 * MIB), Some(12 * MIB));
    }

    #[test]
    fn power2_divisions_match_pytorch_doc_example() {
        // PyTorch docs: with 4 divisions, a 1200 B request... rounds within [1024, 2048) to 1280.
        assert_eq!(round_power2_division(1200, 4), Some(1280));
        assert_eq!(round_power2_division(1024, 4), Some(1024));
        assert_eq!(round_power2_division(1537, 4), Some(1792));
        // At the top of the range the rounding is not representable: None, not a wrap or panic.
        assert_eq!(round_power2_division(usize::MAX - 5, 4), None);
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        // 1200 B is not > 512*4, so it keeps plain 512 B rounding, as in PyTorch.
        assert_eq!(c.round_size(1200), Some(1536));
        assert_eq!(c.round_size(5 * MIB + 1), Some(6 * MIB));
    }

    #[test]
    fn settings_parse_over_the_base_given() {
        assert!(AllocatorConfig::default().expandable_segments && !AllocatorConfig::pytorch().expandable_segments);
        let over_wick = AllocatorConfig::parse("max_split_size_mb:64").unwrap();
        assert!(over_wick.expandable_segments);
        let over_torch = AllocatorConfig::parse_over(AllocatorConfig::pytorch(), "max_split_size_mb:64").unwrap();
        assert!(!over_torch.expandable_segments);
        assert_eq!(over_torch.max_split_size, 64 * MIB);
        let on = AllocatorConfig::parse_over(AllocatorConfig::pytorch(), "expandable_segments:True").unwrap();
        assert!(on.expandable_segments);
    }

    #[test]
    fn parses_settings_and_rejects_bad_ones() {
        let c = AllocatorConfig::parse(
            "max_split_size_mb:128, roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,memory_fraction:0.5",
        )
        .unwrap();
        assert_eq!(c.max_split_size, 128 * MIB);
        assert_eq!(c.roundup_power2_divisions[8], 1);
        assert_eq!(c.roundup_power2_divisions[9], 2);
        assert_eq!(c.roundup_power2_divisions[10], 8);
        assert_eq!(c.roundup_power2_divisions[15], 8);
        assert_eq!(c.garbage_collection_threshold, Some(0.6));
        assert_eq!(c.limit, Some(MemoryLimit::Fraction(0.5)));
        for bad in [
            "max_split_size_mb:10",
            "max_split_size_mb:abc",
            "bogus:1",
            "noval",
            "garbage_collection_threshold:1.5",
            "roundup_power2_divisions:3",
            "roundup_power2_divisions:[300:2]",
            "memory_fraction:0",
            "max_split_size_mb:99999999999999999999",
            "expandable_segments:maybe",
            // 2⁵⁵ divisions: accepted before, then every request ≥ 512 B overflowed.
            "roundup_power2_divisions:36028797018963968",
            "roundup_power2_divisions:[1:4096]",
        ] {
            assert!(AllocatorConfig::parse(bad).is_err(), "{bad} should be rejected");
        }
        assert!(AllocatorConfig::default().validate().is_ok());
        assert!(AllocatorConfig::parse("expandable_segments:True").unwrap().expandable_segments);
    }

    #[test]
    fn rounding_never_overflows_at_any_size_or_setting() {
        for divisions in [0, 1, 2, 4, 16, MAX_POWER2_DIVISIONS] {
            let c = AllocatorConfig::parse(&format!("roundup_power2_divisions:{divisions}")).unwrap();
            for size in [1, 511, 512, 513, 1 << 20, (1 << 20) + 1, usize::MAX / 2 + 1, usize::MAX - 511, usize::MAX] {
                if let Some(r) = c.round_size(size) {
                    assert!(r >= size && r.is_multiple_of(512), "{divisions} divisions: {size} -> {r}");
                }
            }
        }
    }
}

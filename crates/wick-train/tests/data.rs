//! The data loader: every sample once per epoch in a seeded order, the same batches whatever the
//! number of workers, resumable mid-epoch, the queue bounded in bytes, errors and panics named
//! by sample, no thread left after an epoch (early stop and errors included), heap flat over
//! many epochs; and the file datasets (safetensors, tokens, image folders). This binary counts
//! its heap exactly, so its tests take turns.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use wick_train::data::{DataError, Dataset, ImageFolder, Loader, LoaderConfig, Position, TensorFile, TokenFile};

wick::heap!(counting);

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Sample i: a (16,) f32 vector of i and its index as a u32 label; fails or panics on request.
struct Numbers {
    n: usize,
    fail_at: Option<usize>,
    panic_at: Option<usize>,
}

impl Dataset for Numbers {
    fn len(&self) -> usize {
        self.n
    }
    fn get(&self, i: usize) -> Result<Vec<Tensor>, DataError> {
        if self.fail_at == Some(i) {
            return Err(DataError::sample(i, "unreadable record"));
        }
        if self.panic_at == Some(i) {
            panic!("corrupt record {i}");
        }
        let x = Tensor::new(vec![i as f32; 16], &Device::Cpu).map_err(|e| DataError::sample(i, e))?;
        let y = Tensor::new(i as u32, &Device::Cpu).map_err(|e| DataError::sample(i, e))?;
        Ok(vec![x, y])
    }
}

fn numbers(n: usize) -> Numbers {
    Numbers { n, fail_at: None, panic_at: None }
}

fn labels(loader: &Loader<Numbers>, from: Position) -> Vec<Vec<u32>> {
    loader.epoch(from).map(|b| b.unwrap().tensors[1].to_vec1::<u32>().unwrap()).collect()
}

/// The loader's worker threads alive in this process (by name: the test harness starts and ends
/// threads of its own meanwhile, and candle starts its pool lazily).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| {
        d.filter_map(|t| t.ok())
            .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("wick-data")))
            .count()
    })
}

/// `threads()` once it equals `want`, or its last value after 10 s. A thread takes its name
/// itself once scheduled (until then it shows its parent's), and a joined thread's /proc entry
/// goes a moment after the join returns; on a loaded 2-core machine either can lag.
fn threads_settled(want: usize) -> usize {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = threads();
        if now == want || std::time::Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn each_epoch_is_a_seeded_permutation_the_same_for_any_number_of_workers() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let config = LoaderConfig { batch_size: 7, seed: 42, ..LoaderConfig::default() };
    let inline = labels(&Loader::new(numbers(50), LoaderConfig { workers: 0, ..config }), Position::start(3));
    for workers in [1, 2, 3, 5] {
        let loader = Loader::new(numbers(50), LoaderConfig { workers, ..config });
        assert_eq!(labels(&loader, Position::start(3)), inline, "{workers} workers");
    }
    let mut all: Vec<u32> = inline.concat();
    assert_eq!(inline.len(), 8, "7 × 7 + a short batch of 1");
    all.sort_unstable();
    assert_eq!(all, (0..50).collect::<Vec<u32>>(), "every sample exactly once");
    // Other epochs and other seeds shuffle differently; no shuffle keeps the dataset's order.
    let loader = Loader::new(numbers(50), config);
    assert_ne!(labels(&loader, Position::start(4)), inline);
    assert_ne!(labels(&Loader::new(numbers(50), LoaderConfig { seed: 43, ..config }), Position::start(3)), inline);
    let plain = Loader::new(numbers(10), LoaderConfig { batch_size: 4, shuffle: false, drop_last: true, ..config });
    assert_eq!(labels(&plain, Position::start(0)), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    assert_eq!(plain.batches_per_epoch(), 2);
}

#[test]
fn a_resumed_epoch_gives_the_rest_of_the_same_batches() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let loader =
        Loader::new(numbers(40), LoaderConfig { batch_size: 6, seed: 7, workers: 3, ..LoaderConfig::default() });
    let full = labels(&loader, Position::start(2));
    let mut epoch = loader.epoch(Position::start(2));
    let first = epoch.next().unwrap().unwrap();
    let second = epoch.next().unwrap().unwrap();
    assert_eq!(second.position, Position { epoch: 2, batch: 1 });
    drop(epoch); // stopped early: the workers are joined
    let rest = labels(&loader, Position { epoch: 2, batch: 2 });
    assert_eq!(first.tensors[1].to_vec1::<u32>().unwrap(), full[0]);
    assert_eq!(rest, full[2..].to_vec());
    // The batch's fields are stacked: (6, 16) f32 and (6,) u32.
    assert_eq!((first.tensors[0].dims(), first.tensors[1].dtype()), (&[6usize, 16][..], DType::U32));
}

#[test]
fn the_queue_holds_no_more_than_its_byte_budget() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // A batch is 8 × (16 × 4 + 4) = 544 bytes.
    for (budget, most) in [(1200, 1088), (100, 544), (1 << 20, 544 * 13)] {
        let loader = Loader::new(
            numbers(100),
            LoaderConfig { batch_size: 8, workers: 4, prefetch_bytes: budget, ..LoaderConfig::default() },
        );
        let mut epoch = loader.epoch(Position::start(0));
        let mut count = 0;
        for batch in epoch.by_ref() {
            batch.unwrap();
            count += 1;
            // A slow consumer: the workers fill whatever the budget allows.
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        assert_eq!(count, 13);
        let peak = epoch.peak_queued_bytes();
        assert!(peak <= most && peak >= 544.min(most), "budget {budget}: peak {peak} bytes queued");
    }
}

#[test]
fn errors_and_panics_name_the_sample_and_leave_no_thread_behind() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let before = threads();
    assert_eq!(before, 0);
    for (fail_at, panic_at) in [(Some(13), None), (None, Some(29))] {
        for workers in [0, 3] {
            let dataset = Numbers { n: 64, fail_at, panic_at };
            let loader = Loader::new(
                dataset,
                LoaderConfig { batch_size: 4, shuffle: false, workers, ..LoaderConfig::default() },
            );
            let results: Vec<Result<_, DataError>> = loader.epoch(Position::start(0)).collect();
            let err = results.last().unwrap().as_ref().unwrap_err().to_string();
            let expected = fail_at.map_or("sample 29: the worker panicked: corrupt record 29".to_string(), |i| {
                format!("sample {i}: unreadable record")
            });
            assert_eq!(err, expected, "{workers} workers");
            // The batches before the bad one arrived, and nothing after it.
            assert_eq!(results.len(), fail_at.or(panic_at).unwrap() / 4 + 1);
        }
    }
    // Workers of every epoch above (and of an epoch dropped half-way) are gone.
    let loader = Loader::new(numbers(64), LoaderConfig { batch_size: 4, workers: 4, ..LoaderConfig::default() });
    let mut epoch = loader.epoch(Position::start(0));
    epoch.next().unwrap().unwrap();
    // None of them can finish: each holds later batches the consumer has not taken.
    assert_eq!(threads_settled(4), 4, "the epoch's workers");
    drop(epoch);
    assert_eq!(threads_settled(before), before, "threads left behind");
}

#[test]
fn the_heap_is_flat_over_many_epochs() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let loader = Loader::new(numbers(256), LoaderConfig { batch_size: 16, workers: 3, ..LoaderConfig::default() });
    let mut after = Vec::new();
    for e in 0..20 {
        let mut sum = 0u64;
        for batch in loader.epoch(Position::start(e)) {
            sum += batch.unwrap().tensors[1].to_vec1::<u32>().unwrap().iter().map(|v| u64::from(*v)).sum::<u64>();
        }
        assert_eq!(sum, 255 * 256 / 2);
        after.push(wick::host_memory::counted_heap().unwrap());
    }
    // After the first epochs (thread-local caches, lazily made statics) the heap is flat.
    let (lo, hi) = (after[5..].iter().min().unwrap(), after[5..].iter().max().unwrap());
    assert!(hi - lo < 64 << 10, "heap after each epoch moved by {} bytes: {after:?}", hi - lo);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("wick-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn file_datasets_read_what_was_written_and_refuse_what_does_not_fit() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = temp_dir("files");
    // Safetensors: images and labels sharing the sample axis.
    let images = Tensor::arange(0f32, 5.0 * 12.0, &Device::Cpu).unwrap().reshape((5, 3, 2, 2)).unwrap();
    let labels = Tensor::new(&[4u32, 3, 2, 1, 0], &Device::Cpu).unwrap();
    let path = dir.join("set.safetensors");
    candle_core::safetensors::save(
        &HashMap::from([("images".to_string(), images.clone()), ("labels".to_string(), labels)]),
        &path,
    )
    .unwrap();
    let set = TensorFile::open(&path, &["images", "labels"]).unwrap();
    assert_eq!(set.len(), 5);
    let s = set.get(2).unwrap();
    assert_eq!(s[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(), (24..36).map(|v| v as f32).collect::<Vec<_>>());
    assert_eq!(s[1].to_scalar::<u32>().unwrap(), 2);
    assert!(TensorFile::open(&path, &["images", "missing"]).unwrap_err().to_string().contains("no tensor `missing`"));
    let short = Tensor::zeros(4, DType::U32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&HashMap::from([("a".to_string(), images), ("b".to_string(), short)]), &path)
        .unwrap();
    assert!(TensorFile::open(&path, &["a", "b"]).unwrap_err().to_string().contains("has 4 samples"));

    // Tokens: u16, windows of 4 + 1.
    let path = dir.join("tokens.bin");
    let bytes: Vec<u8> = (0u16..23).flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&path, &bytes).unwrap();
    let tokens = TokenFile::open(&path, 2, 4).unwrap();
    assert_eq!(tokens.len(), 5);
    assert_eq!(tokens.get(1).unwrap()[0].to_vec1::<u32>().unwrap(), vec![4, 5, 6, 7, 8]);
    assert!(tokens.get(5).is_err());
    std::fs::write(&path, &bytes[..5]).unwrap();
    assert!(TokenFile::open(&path, 2, 4).unwrap_err().to_string().contains("whole number"));

    // An image folder: two classes of PNGs; a broken file is an error naming it.
    for (class, value) in [("cats", 40u8), ("dogs", 200u8)] {
        std::fs::create_dir_all(dir.join("img").join(class)).unwrap();
        for k in 0..2 {
            let img = image::RgbImage::from_fn(8, 6, |x, _| image::Rgb([value, x as u8 * 10, 255]));
            img.save(dir.join("img").join(class).join(format!("{k}.png"))).unwrap();
        }
    }
    let folder = ImageFolder::open(&dir.join("img"), 4, 4).unwrap();
    assert_eq!((folder.len(), folder.classes()), (4, &["cats".to_string(), "dogs".to_string()][..]));
    let s = folder.get(3).unwrap();
    assert_eq!((s[0].dims(), s[1].to_scalar::<u32>().unwrap()), (&[3usize, 4, 4][..], 1));
    let red = s[0].get(0).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(red.iter().all(|v| (v - 200.0 / 255.0).abs() < 1e-6), "{red:?}");
    std::fs::write(dir.join("img").join("dogs").join("1.png"), b"not a png").unwrap();
    let err = folder.get(3).unwrap_err().to_string();
    assert!(err.starts_with("sample 3:") && err.contains("1.png"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sharded by rank: the ranks' batches together are the epoch (every sample once when the
/// batches divide by the world size; the padding repeats the epoch's first batches otherwise, or
/// is dropped with `drop_last`), rank r's j-th batch is the one-process epoch's batch
/// `r + j·world`, and a rank resumed mid-epoch reads the same batches as one that never stopped.
#[test]
fn sharded_epochs_split_the_epoch_between_ranks_and_resume_mid_epoch() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let config =
        LoaderConfig { batch_size: 3, shuffle: true, seed: 7, drop_last: false, workers: 0, ..Default::default() };
    let whole = labels(&Loader::new(numbers(24), config), Position::start(2));
    assert_eq!(whole.len(), 8);
    for world in [1, 2, 4] {
        let mut union = Vec::new();
        for rank in 0..world {
            let loader = Loader::new(numbers(24), config).sharded(rank, world).unwrap();
            assert_eq!(loader.batches_per_epoch(), 8 / world);
            let mine = labels(&loader, Position::start(2));
            for (j, batch) in mine.iter().enumerate() {
                assert_eq!(batch, &whole[rank + j * world], "world {world} rank {rank} batch {j}");
            }
            // Resumed at its third batch: the rest of the same epoch.
            if mine.len() > 2 {
                assert_eq!(labels(&loader, Position { epoch: 2, batch: 2 }), mine[2..].to_vec());
            }
            union.extend(mine.into_iter().flatten());
        }
        union.sort();
        assert_eq!(union, (0..24).collect::<Vec<u32>>(), "world {world}: every sample once");
    }
    // 8 batches over 3 ranks: 3 turns, the last completed by the epoch's first batch.
    let (mut union, mut counts) = (Vec::new(), HashMap::new());
    for rank in 0..3 {
        let loader = Loader::new(numbers(24), config).sharded(rank, 3).unwrap();
        assert_eq!(loader.batches_per_epoch(), 3);
        union.extend(labels(&loader, Position::start(2)).into_iter().flatten());
    }
    for s in &union {
        *counts.entry(*s).or_insert(0) += 1;
    }
    assert_eq!(union.len(), 27);
    assert!((0..24u32).all(|s| counts.contains_key(&s)), "every sample at least once");
    let twice: Vec<u32> = counts.iter().filter(|(_, &c)| c == 2).map(|(&s, _)| s).collect();
    let mut first = whole[0].clone();
    first.sort();
    let mut twice_sorted = twice.clone();
    twice_sorted.sort();
    assert_eq!(twice_sorted, first, "the padding is the epoch's first batch");
    let dropped = LoaderConfig { drop_last: true, ..config };
    assert_eq!(Loader::new(numbers(24), dropped).sharded(2, 3).unwrap().batches_per_epoch(), 2);
    assert!(matches!(Loader::new(numbers(4), config).sharded(2, 2), Err(DataError::Shard { rank: 2, world: 2 })));
}

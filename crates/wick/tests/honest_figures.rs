//! A refusal's figures say whose memory they are. With another process holding 1.5 GiB, in a
//! program without a wick global allocator: the host pre-flight names the used memory as the
//! machine's (or the cgroup's), with this process's own resident set beside it; the engine's
//! pre-flight names its figure as this process's resident set; candle's own refusal names the
//! machine's figures as the machine's. None of them calls the other process's memory wick's.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use wick_memory::UsageOwner;

/// A process that touches `bytes` of memory and holds them until killed.
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn hold(bytes: usize) -> Option<Holder> {
    let script = format!("import sys, time\nb = b'\\x01' * {bytes}\nprint('READY', flush=True)\ntime.sleep(120)\n");
    let mut child = match Command::new("python3").args(["-c", &script]).stdout(Stdio::piped()).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("\n!!!!!!!! SKIPPED: cannot start python3 to hold memory ({e})\n");
            return None;
        }
    };
    let mut line = String::new();
    BufReader::new(child.stdout.take()?).read_line(&mut line).ok()?;
    assert_eq!(line.trim(), "READY");
    Some(Holder(child))
}

const HELD: usize = 1536 << 20;

#[test]
fn another_process_memory_is_named_as_the_machines_never_as_wicks() {
    let Some(_holder) = hold(HELD) else { return };
    assert!(wick::host_memory::exact_heap().is_none(), "this test runs without a wick global allocator");

    // The host pre-flight: the used figure includes the other process's 1.5 GiB and is named as
    // the machine's (or the cgroup's); this process's own resident set is said beside it.
    let err = wick::host_memory::preflight_host(1 << 50, "a huge buffer").unwrap_err();
    let oom = err.as_out_of_memory().expect("an out-of-memory error");
    let text = err.to_string();
    assert!(matches!(oom.owner, UsageOwner::Machine | UsageOwner::Cgroup), "{text}");
    assert!(oom.allocated >= HELD, "the used figure leaves out the other process: {text}");
    let resident = oom.process_resident.expect("this process's resident set is said");
    assert!(resident < HELD / 2, "{text}");
    assert!(text.contains("this process holds") && !text.contains("by wick"), "{text}");
    assert!(text.contains("all processes on the machine") || text.contains("memory cgroup"), "{text}");

    // The engine's pre-flight: without a counted heap its figure is this process's resident set.
    let engine = wick::Engine::cpu();
    let err = engine.preflight(1 << 50, "a huge tensor").unwrap_err();
    let oom = err.as_out_of_memory().expect("an out-of-memory error");
    let text = err.to_string();
    assert_eq!(oom.owner, UsageOwner::ProcessResident, "{text}");
    assert!(oom.allocated < HELD / 2 && text.contains("this process holds") && !text.contains("by wick"), "{text}");

    // candle's own refusal (the patched candle-core's check).
    let text = candle_core::Tensor::zeros(1usize << 40, candle_core::DType::U8, &candle_core::Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(text.contains("this process holds") && !text.contains("by wick"), "{text}");
    assert!(text.contains("other processes and the kernel") || text.contains("memory cgroup"), "{text}");
}

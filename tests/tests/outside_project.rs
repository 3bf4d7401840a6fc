//! A project outside this workspace that depends on wick as the README says ("Use wick in your
//! project": its `[dependencies]` and `[patch]` lines, taken from the README itself so they
//! cannot drift), built by cargo as a user's would be, then run: it gets wick's patched
//! candle-core (`wick info`'s probe says so), and an over-memory CPU tensor is an `Err` there
//! too, with the earlier tensor intact.

use std::path::{Path, PathBuf};
use std::process::Command;

const MAIN: &str = r#"
use candle_core::{DType, Device, Tensor};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let engine = wick::Engine::cpu();
    let earlier = Tensor::arange(0f32, 10.0, engine.device())?;
    let huge = Tensor::zeros(1usize << 38, DType::F32, &Device::Cpu);
    let refused = matches!(&huge, Err(e) if wick::is_out_of_memory(e));
    println!(
        "{{\"patched\": {}, \"refused\": {}, \"earlier\": {}}}",
        wick::host_memory::candle_checks_cpu_allocations(),
        refused,
        earlier.sum_all()?.to_scalar::<f32>()?
    );
    Ok(())
}

wick::main!(run);
"#;

/// The README's manifest lines for `wick` and the `[patch]`, with `../wick/` made this checkout.
fn manifest(root: &Path) -> String {
    let readme = std::fs::read_to_string(root.join("README.md")).expect("the README");
    let section = readme.split("## Use wick in your project").nth(1).expect("the section");
    let block = section.split("```toml").nth(1).and_then(|b| b.split("```").next()).expect("its toml block");
    let kept: Vec<&str> = block
        .lines()
        .filter(|l| {
            let l = l.trim_start();
            l.starts_with("[dependencies]")
                || l.starts_with("wick =")
                || l.starts_with("[patch.crates-io]")
                || l.starts_with("candle-core =")
                || l.starts_with("rayon-core =")
        })
        .collect();
    assert_eq!(kept.len(), 5, "the README's block changed shape: {kept:?}");
    let lines = kept.join("\n").replace("../wick/", &format!("{}/", root.display()));
    let lines = lines.replacen("[dependencies]", "[dependencies]\ncandle-core = \"0.11.1\"", 1);
    // `[workspace]`: the folder lies under this workspace's target/, but the project is its own.
    format!("[package]\nname = \"outside\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[workspace]\n\n{lines}\n")
}

/// A second, unshared build of wick's dependencies (its own target folder, as a user's project
/// has): a long test (`scripts/long-tests.sh`, CI on every change).
#[test]
#[ignore = "long: builds a project outside the workspace, run by scripts/long-tests.sh"]
fn a_project_outside_the_workspace_gets_the_patched_candle_core_from_the_readme_lines() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("outside-project");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let toml = manifest(&root);
    assert!(
        toml.contains("[patch.crates-io]") && toml.contains("vendor/candle-core") && toml.contains("vendor/rayon-core"),
        "{toml}"
    );
    std::fs::write(dir.join("Cargo.toml"), &toml).unwrap();
    std::fs::write(dir.join("src/main.rs"), MAIN).unwrap();
    // The workspace's lock file pins the same versions, so the build needs no network.
    if !dir.join("Cargo.lock").exists() {
        std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(["run", "--offline", "--quiet"])
        .current_dir(&dir)
        // The project's own target folder: nothing of this workspace's build is reused.
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env_remove("RUSTFLAGS")
        .output()
        .expect("cargo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the outside project failed:\n{toml}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(v["patched"], true, "{stdout}");
    assert_eq!(v["refused"], true, "{stdout}");
    assert_eq!(v["earlier"], 45.0, "{stdout}");
    // The project's build is a second copy of wick's dependencies (about 1 GiB): not left on CI's disk.
    std::fs::remove_dir_all(dir.join("target")).unwrap();
}

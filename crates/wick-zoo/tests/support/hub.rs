//! Starts `hub_server.py` (beside this file) on 127.0.0.1 for the download tests of wick-zoo and
//! wick-cli; stopped when dropped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A running hub server and its endpoint (`http://127.0.0.1:PORT`).
pub struct Hub {
    child: Child,
    /// The address to fetch from.
    pub endpoint: String,
}

impl Drop for Hub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Serves `dir` as the repository `repo`, with the server's fault flags `faults`; `None`, with a
/// loud line, when python3 cannot start it.
pub fn serve(dir: &Path, repo: &str, faults: &[&str]) -> Option<Hub> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../wick-zoo/tests/support/hub_server.py");
    let mut child = match Command::new("python3")
        .arg(script)
        .args(["--repo", repo, "--dir"])
        .arg(dir)
        .args(faults)
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("\n!!!!!!!! SKIPPED: cannot start python3 for the hub server ({e})\n");
            return None;
        }
    };
    let mut line = String::new();
    BufReader::new(child.stdout.take()?).read_line(&mut line).ok()?;
    let port = line.trim().strip_prefix("PORT ")?.to_string();
    Some(Hub { child, endpoint: format!("http://127.0.0.1:{port}") })
}

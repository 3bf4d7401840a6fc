//! Headless Chromium for the HTML reports' tests: the page's DOM after its scripts ran.
//! Without a browser the check is skipped loudly — unless `WICK_REQUIRE_BROWSER=1` (CI), where
//! a missing browser fails the test.

use std::path::Path;
use std::process::Command;

/// The browser to run: `$CHROMIUM`, else `chromium` or `chromium-browser` on the path.
fn browser() -> Option<String> {
    let candidates = std::env::var("CHROMIUM").into_iter().chain(["chromium".into(), "chromium-browser".into()]);
    candidates.into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// The DOM of `page` (opened with `#fragment`) after its scripts ran; `None` without a browser.
pub fn dump_dom(page: &Path, fragment: &str) -> Option<String> {
    let Some(browser) = browser() else {
        assert!(std::env::var("WICK_REQUIRE_BROWSER").as_deref() != Ok("1"), "no chromium, and WICK_REQUIRE_BROWSER=1");
        return None;
    };
    let profile = page.with_extension("chromium-profile");
    let url = format!("file://{}#{fragment}", page.display());
    let out = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(["--dump-dom", &url])
        .output()
        .unwrap_or_else(|e| panic!("chromium: {e}"));
    let _ = std::fs::remove_dir_all(&profile);
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The value of the first `name="…"` attribute in `dom` (HTML entities for `"`, `&`, `<`, `>`
/// and newlines decoded).
#[allow(dead_code)]
pub fn attribute(dom: &str, name: &str) -> Option<String> {
    let start = dom.find(&format!("{name}=\""))? + name.len() + 2;
    let end = start + dom[start..].find('"')?;
    Some(
        dom[start..end]
            .replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&#10;", "\n")
            .replace("&amp;", "&"),
    )
}

/// Says loudly that a browser check was skipped.
pub fn skipped(what: &str) {
    eprintln!("SKIPPED: {what} — no chromium on this machine (install it, or set CHROMIUM=/path)");
}

#!/usr/bin/env bash
# Executes the notebooks named (all of examples/notebooks by default) headlessly with the evcxr
# Rust kernel and fails on any error output, except the out-of-memory error a cell tagged
# `raises-exception` must print. Installs evcxr_jupyter (cargo) and Jupyter (a venv under
# ~/.cache) if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${WICK_NB_VENV:-$HOME/.cache/wick-nbvenv}
if ! command -v evcxr_jupyter >/dev/null; then
  # The largest step of a cold CI run. At opt-level 1: 4 min 18 s on 2 cores (BENCHMARKS.md
  # "Build and test times"; an earlier note here said about 30 minutes at cargo's default 3). A
  # kernel's own work is cargo building the cells, which this setting does not touch.
  echo "installing evcxr_jupyter (opt-level 1)"
  CARGO_PROFILE_RELEASE_OPT_LEVEL=1 cargo install evcxr_jupyter --locked
fi
if [ ! -x "$venv/bin/jupyter" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q jupyter nbconvert nbclient ipykernel
fi
export JUPYTER_PATH="$venv/share/jupyter" JUPYTER_DATA_DIR="$venv/share/jupyter"
evcxr_jupyter --install >/dev/null
# Per evcxr: statics are per cell and a panic must not pass silently; cache builds between runs.
# evcxr's build cache (`:cache`) lives under XDG_CACHE_HOME/evcxr and keys a crate by its
# version, not by the content of the patched crates under it: one cache per patch, or a
# crate cached against an older patch is "can't find crate" at the next run.
patch_key=$(cat vendor/candle-core.patch vendor/rayon-core.patch | sha256sum | cut -c1-12)
export EVCXR_CONFIG_DIR="$root/target/evcxr-config" XDG_CACHE_HOME="${XDG_CACHE_HOME:-$HOME/.cache}/wick-evcxr-$patch_key"
mkdir -p "$XDG_CACHE_HOME"
mkdir -p "$EVCXR_CONFIG_DIR" target/notebooks
printf ':preserve_vars_on_panic 0\n:cache 4000\n' > "$EVCXR_CONFIG_DIR/init.evcxr"
# evcxr writes its own Cargo.toml, where no `[patch]` applies; cargo also reads `[patch]` from
# configuration files above the folder it builds in. The kernels build in a folder whose parent's
# .cargo/config.toml puts wick's patched candle-core and rayon-core in place, as the workspace's Cargo.toml does
# (the README's line for any project; see vendor/README.md). Outside the repository (under it,
# cargo would take evcxr's project for a member of this workspace), in a fresh folder under /tmp
# (a kernel built in a folder under ~/.cache failed to load its code here: "dlopen failed").
build=$(mktemp -d "${TMPDIR:-/tmp}/wick-notebook-build.XXXXXX")
trap 'rm -rf "$build"' EXIT
export EVCXR_TMPDIR="$build/evcxr"
mkdir -p "$EVCXR_TMPDIR" "$build/.cargo"
printf '[patch.crates-io]\ncandle-core = { path = "%s/vendor/candle-core" }\nrayon-core = { path = "%s/vendor/rayon-core" }\n' \
    "$root" "$root" > "$build/.cargo/config.toml"
# The long-jobs notebook starts `wick train` as separate processes.
cargo build -q -p wick-cli
export WICK_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/wick"
# evcxr tells a notebook's own cell crates (never cached) from downloaded ones (cached) by the
# `incremental=` flag cargo passes to rustc. With CARGO_INCREMENTAL=0 (CI's setting) every cell
# after the first was served from the cache as an earlier cell's build ("dlsym failed").
unset CARGO_INCREMENTAL
status=0
# Arguments: the notebooks to run (all of examples/notebooks by default).
if [ $# -eq 0 ]; then set -- examples/notebooks/*.ipynb; fi
for nb in "$@"; do
  name=$(basename "$nb")
  echo "== $name"
  # The kernel runs in the notebook's own folder, so its relative :dep paths hold; the executed
  # copy is written under target/. scripts/run-notebook.py is nbconvert's execution plus the
  # output lines evcxr sends after a cell's end (its header says why).
  if ! "$venv/bin/python" scripts/run-notebook.py --timeout 1200 "$nb" "$root/target/notebooks/$name"; then
    echo "!! $name failed to execute"; status=1; continue
  fi
  # Errors printed by a `?` or a panic do not fail nbconvert: look for them in the outputs. A
  # cell tagged `raises-exception` (Jupyter's tag for a cell meant to fail) must instead have
  # printed an out-of-memory error, and nothing else may be wrong in it.
  if python3 - "target/notebooks/$name" <<'PY'
import json, sys
nb = json.load(open(sys.argv[1]))
bad = []
for i, cell in enumerate(nb["cells"]):
    expected = "raises-exception" in cell.get("metadata", {}).get("tags", [])
    refused = False
    for out in cell.get("outputs", []):
        text = "".join(out.get("text", "")) + json.dumps(out.get("data", {})) + "".join(out.get("traceback", []))
        if "panicked at" in text:
            bad.append((i, text[:300]))
        elif out.get("output_type") == "error" or out.get("name") == "stderr":
            if expected and "out of memory" in text:
                refused = True
            else:
                bad.append((i, text[:300]))
    if expected and not refused:
        bad.append((i, "tagged raises-exception, but printed no out-of-memory error"))
for i, t in bad:
    print(f"cell {i}: {t}")
sys.exit(1 if bad else 0)
PY
  then echo "ok: $name (executed copy in target/notebooks/)"; else echo "!! $name printed errors"; status=1; fi
done
exit $status

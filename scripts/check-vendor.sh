#!/usr/bin/env bash
# vendor/candle-core must be the published candle-core 0.11.1 plus vendor/candle-core.patch,
# file for file (vendor/README.md says why it is vendored).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
crate=candle-core-0.11.1
sha=d11c8be87cfbaef9ebb62fb3f850d1fc8e00cc1d11d393fdbe55a4d5c2cdb325
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# cargo's download cache when it holds the crate, crates.io otherwise; the hash decides.
cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate.crate" 2>/dev/null | head -n 1 || true)
if [ -n "$cached" ]; then
    cp "$cached" "$work/$crate.crate"
else
    curl -sSfL -o "$work/$crate.crate" "https://static.crates.io/crates/candle-core/$crate.crate"
fi
echo "$sha  $work/$crate.crate" | sha256sum --check --quiet -
tar -xzf "$work/$crate.crate" -C "$work"
patch --quiet --directory="$work/$crate" -p1 < "$root/vendor/candle-core.patch"
if ! diff -r "$work/$crate" "$root/vendor/candle-core"; then
    echo "vendor/candle-core differs from $crate + vendor/candle-core.patch" >&2
    exit 1
fi
echo "vendor/candle-core is $crate + vendor/candle-core.patch, exactly"

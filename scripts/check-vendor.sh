#!/usr/bin/env bash
# Each vendored crate must be the published crate plus its patch, file for file:
# vendor/candle-core = candle-core 0.11.1 + vendor/candle-core.patch, vendor/rayon-core =
# rayon-core 1.13.0 + vendor/rayon-core.patch (vendor/README.md says why each is vendored).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

check() {
    local name=$1 version=$2 sha=$3
    local crate=$name-$version
    # cargo's download cache when it holds the crate, crates.io otherwise; the hash decides.
    local cached
    cached=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate.crate" 2>/dev/null | head -n 1 || true)
    if [ -n "$cached" ]; then
        cp "$cached" "$work/$crate.crate"
    else
        curl -sSfL -o "$work/$crate.crate" "https://static.crates.io/crates/$name/$crate.crate"
    fi
    echo "$sha  $work/$crate.crate" | sha256sum --check --quiet -
    tar -xzf "$work/$crate.crate" -C "$work"
    patch --quiet --directory="$work/$crate" -p1 < "$root/vendor/$name.patch"
    if ! diff -r "$work/$crate" "$root/vendor/$name"; then
        echo "vendor/$name differs from $crate + vendor/$name.patch" >&2
        exit 1
    fi
    echo "vendor/$name is $crate + vendor/$name.patch, exactly"
}

check candle-core 0.11.1 d11c8be87cfbaef9ebb62fb3f850d1fc8e00cc1d11d393fdbe55a4d5c2cdb325
check rayon-core 1.13.0 22e18b0f0062d30d4230b2e85ff77fdfe4326feb054b9783a3460d8435c8ab91

#!/usr/bin/env bash
# Runs all of smclo's tests: release build, unit and cross-process tests
# (some fork and kill, hence two test threads), then a short libFuzzer run of
# the CLC parser (needs the nightly toolchain and cargo-fuzz).
set -euo pipefail
cd "$(dirname "$0")"

fuzz_seconds=30
step=start
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "test.sh: FAILED in step \"$step\" (exit $rc)"; fi' EXIT

step=build
cargo build --release --workspace

step=test
cargo test --release --workspace -- --test-threads=2

step=loom
# The doorbell protocol, model-checked: every interleaving of one writer and
# one reader (crates/smclo/tests/loom_doorbell.rs). Its own target dir, since
# --cfg loom rebuilds everything.
CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" \
    cargo test --release -p smclo --test loom_doorbell

step=fuzz
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed; installing it (cargo install cargo-fuzz)"
    cargo install --locked cargo-fuzz || {
        echo "test.sh: cannot install cargo-fuzz, which the fuzz step needs" >&2
        exit 1
    }
fi
# The committed seeds (one valid message of each type) let libFuzzer start
# from deep inside the parser; new inputs go to the ignored fuzz/corpus.
mkdir -p fuzz/corpus/clc_parse
cargo +nightly fuzz run clc_parse fuzz/corpus/clc_parse fuzz/seeds/clc_parse \
    -- -max_total_time=$fuzz_seconds

echo "test.sh: PASSED: release build, workspace tests, loom model of the doorbell protocol, fuzz clc_parse ${fuzz_seconds}s"

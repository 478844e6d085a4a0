#!/usr/bin/env bash
# Runs all of smclo's tests: rustfmt, clippy and rustdoc's link check, release build (with the
# preload's musl build), unit and cross-process tests
# (some fork and kill, hence two test threads), the benchmark suite's tests
# and one short run of every suite workload over every transport (checked,
# not timed), then a short libFuzzer run of each of smclo-wire's parsers
# (needs the nightly toolchain and cargo-fuzz). The real programs the tests run come
# from scripts/install-packages.sh (.ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")"

# libFuzzer time per target; three targets, 30 s in all.
fuzz_seconds=10
fuzz_targets=(clc_parse cursor_validate dmb_header_parse)
step=start
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "test.sh: FAILED in step \"$step\" (exit $rc)"; fi' EXIT

step=lint
# Formatting and lints first: rustfmt's style, and clippy with warnings as
# errors (the workspace's [lints] also deny unsafe blocks without a SAFETY
# comment).
cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The developers' documentation: every intra-doc link resolves. (The C
# API's library and the command are also named smclo, so each is
# documented on its own.)
for docs in "--workspace --exclude smclo-capi --exclude smclo-cli" "-p smclo-capi" "-p smclo-cli"; do
    # shellcheck disable=SC2086 # the package options are words
    RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --document-private-items $docs
done

step=build
cargo build --release --workspace
# The preload library's build for musl programs, next to the glibc one
# (adds Rust's musl target with rustup if missing; links with musl-gcc).
scripts/build-musl-preload

step=test
cargo test --release --workspace -- --test-threads=2

step=loom
# The doorbell protocol, model-checked: every interleaving of one writer and
# one reader (crates/smclo/tests/loom_doorbell.rs), and of event-loop
# pollers skipping doorbells (crates/smclo/tests/loom_poller.rs); and the shared tables'
# claim / publish / release / reclaim protocol: claimers racing a reclaimer
# of a dead owner's entry (crates/smclo/tests/loom_table.rs); and a
# client's early-byte count racing its server's seal
# (crates/smclo/tests/loom_early.rs); and the spinner slots' take and
# give-back, with holders late or dead (crates/smclo/tests/loom_spin.rs); and
# a DMB's attach record, a server's reservation racing its client's late
# claim and its own reuse (crates/smclo/tests/loom_attach.rs); and the
# announcement map, clients' bits in shared words beside a server's look
# after the SYN (crates/smclo/tests/loom_announced.rs). Their own
# target dir, since --cfg loom rebuilds everything.
CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" \
    cargo test --release -p smclo --test loom_doorbell --test loom_poller --test loom_table \
    --test loom_early --test loom_spin --test loom_attach --test loom_announced

step=bench-suite
# The suite's parsers, tables and chart; then every workload over every
# transport once, briefly: each must succeed, and each smclo run must be
# proven by the device counters (scripts/benchsuite/tests/smoke_check.py).
scripts/bench-suite --unit-tests
rm -rf target/bench-suite-smoke
scripts/bench-suite --smoke --out target/bench-suite-smoke >/dev/null
scripts/bench-suite --check-smoke target/bench-suite-smoke
# The workloads whose programs run differently as deployed (unpinned, their
# usual threads and workers: nginx's workers must reach the device too).
rm -rf target/bench-suite-smoke-deployed
scripts/bench-suite --smoke --layout deployed --only nginx-small,redis,memcached,postgres,postgres-32 \
    --out target/bench-suite-smoke-deployed >/dev/null
scripts/bench-suite --check-smoke target/bench-suite-smoke-deployed

step=fuzz
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed; installing it (cargo install cargo-fuzz)"
    cargo install --locked cargo-fuzz || {
        echo "test.sh: cannot install cargo-fuzz, which the fuzz step needs" >&2
        exit 1
    }
fi
# The committed seeds (fuzz/seeds/README.md: valid inputs of each target)
# let libFuzzer start from deep inside the parser; new inputs go to the
# ignored fuzz/corpus.
for target in "${fuzz_targets[@]}"; do
    step="fuzz $target"
    mkdir -p "fuzz/corpus/$target"
    cargo +nightly fuzz run "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" \
        -- -max_total_time=$fuzz_seconds
done

echo "test.sh: PASSED: rustfmt, clippy and the documentation's links, release build (the preload for glibc and for musl), workspace tests, loom models of the doorbell, shared-table, early-byte, spinner-slot, attach-record and announcement-map protocols, benchmark suite tests and smoke run, fuzz ${fuzz_targets[*]} ${fuzz_seconds}s each"

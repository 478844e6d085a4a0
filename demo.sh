#!/usr/bin/env bash
# Builds everything and shows what smclo does: the built-in workloads over
# TCP loopback, a UNIX socket and smclo, side by side in one run.
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --workspace
# The preload for musl programs too (needs musl-gcc); the demo itself runs
# without it.
scripts/build-musl-preload || echo "demo.sh: the preload's musl build was not made (see above); musl programs run without smclo"
exec target/release/smclo bench "$@"

#!/usr/bin/env bash
# Builds everything and shows what smclo does: the built-in workloads over
# TCP loopback, a UNIX socket and smclo, side by side in one run.
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --workspace
exec target/release/smclo bench "$@"

#!/usr/bin/env bash
# Installs (as root, on Debian) the programs that the tests and the benchmark
# suite run: redis, nginx, memcached (with memcslap), haproxy, node, a Java JDK (javac, for the Java tests),
# Go (golang-go, for the tests of Go programs), postgresql, sockperf, iperf3, wrk, curl, strace, perf, socat, liburing-dev (the io_uring tests), systemd-socket-activate
# (systemd), musl-tools (musl-gcc, for the musl tests), iptables, nftables and
# libcap2-bin (setcap), prometheus_client (the metrics format test's parser), PyYAML (the Kubernetes manifests test), and matplotlib for the suite's chart. Packaged daemons are kept from starting and from holding the
# ports the tests use.
set -euo pipefail

APT_PACKAGES="build-essential pkg-config iproute2 iptables nftables musl-tools libcap2-bin procps util-linux redis-server redis-tools nginx-light memcached libmemcached-tools haproxy nodejs openjdk-17-jdk-headless golang-go postgresql sockperf iperf3 wrk curl socat liburing-dev python3 python3-matplotlib python3-prometheus-client python3-yaml strace linux-perf systemd"
# Packaged daemons that the install would start as system services.
SERVICES="redis-server nginx iperf3 memcached haproxy postgresql"

if [ "$(id -u)" -ne 0 ]; then
    echo "install-packages.sh: run as root (sudo scripts/install-packages.sh)" >&2
    exit 1
fi
missing=()
for p in $APT_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update
    # Keep the packages' services from starting at install time
    # (invoke-rc.d honours policy-rc.d; 101 = action not allowed).
    own_policy=
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    rc=0
    apt-get install -y --no-install-recommends "${missing[@]}" || rc=$?
    if [ -n "$own_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
    [ $rc -eq 0 ] || exit $rc
fi
# Whatever started anyway (or was installed earlier) must not hold ports or
# start at boot: stop and disable the packaged services.
for s in $SERVICES; do
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl disable --now "$s" >/dev/null 2>&1 || true
    elif [ -x "/etc/init.d/$s" ]; then
        "/etc/init.d/$s" stop >/dev/null 2>&1 || true
    fi
done

"""The transports compared, and how each proves what it carried."""

import copy
import json
import os
import shutil
import subprocess

from .procs import BenchError


class Transport:
    """One way for a client and a server on this host to talk.

    `prefix` goes before a real program's command (``smclo run --`` for
    smclo, smc-tools' ``smc_run`` for the kernel's SMC); `code` is the
    transport that smclo's own benchmark programs are told to use (under
    ``smclo run`` they run their unchanged TCP code).
    """

    def __init__(self, name, label, code, prefix=(), device_dir=None, why_unavailable=None, knobs=None,
                 device_settings=(), smclo=None):
        self.name = name
        # The smclo binary whose preload and device this transport uses.
        self.smclo = smclo
        # SMCLO_* settings for this transport's processes.
        self.knobs = dict(knobs or {})
        # `smclo dev set` knobs of its device (copy mode is one).
        self.device_settings = list(device_settings)
        self.label = label
        self.code = code
        self.prefix = list(prefix)
        self.device_dir = device_dir
        self.why_unavailable = why_unavailable

    @property
    def available(self):
        return self.why_unavailable is None

    def on_device(self, device_dir):
        """This transport on another device directory of the same settings."""
        t = copy.copy(self)
        t.device_dir = device_dir
        return t

    def env(self):
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)
        env.pop("SMCLO_DEBUG", None)
        if self.device_dir:
            env["SMCLO_DEVICE_DIR"] = self.device_dir
        env.update(self.knobs)
        return env


class DeviceCounters:
    """Reads an smclo device's counters (``smclo stats --json``), which prove
    that a measurement really went through shared memory."""

    def __init__(self, smclo, device_dir):
        self.smclo = smclo
        self.device_dir = device_dir

    def read(self):
        env = dict(os.environ, SMCLO_DEVICE_DIR=self.device_dir)
        env.pop("LD_PRELOAD", None)
        out = subprocess.run([self.smclo, "stats", "--json"], env=env, check=True,
                             capture_output=True, text=True).stdout
        s = json.loads(out)
        return {
            "conns_opened": s["conns_opened"],
            "xfer_bytes": s["xfer_bytes"],
            "dmbs_cnt": s["dmbs_cnt"],
            "fallbacks": {k: v["client"] + v["server"] for k, v in s["fallbacks"].items()
                          if v["client"] + v["server"]},
        }

    @staticmethod
    def proof_counts(before, after):
        """The counters' differences over one measurement."""
        return {
            "conns_opened": after["conns_opened"] - before["conns_opened"],
            "xfer_bytes": after["xfer_bytes"] - before["xfer_bytes"],
            "fallbacks": {k: v - before["fallbacks"].get(k, 0) for k, v in after["fallbacks"].items()
                          if v != before["fallbacks"].get(k, 0)},
        }

    @staticmethod
    def proof(before, after, min_conns=1):
        """What the device saw during one measurement; raises BenchError
        unless it shows at least `min_conns` new shared-memory connections,
        bytes moved, and no fallback."""
        p = DeviceCounters.proof_counts(before, after)
        if p["conns_opened"] < min_conns or p["xfer_bytes"] <= 0 or p["fallbacks"]:
            raise BenchError("not accelerated: the device shows %d new connections (wanted %d), %d bytes moved, fallbacks %s"
                             % (p["conns_opened"], min_conns, p["xfer_bytes"], p["fallbacks"] or "none"))
        return p


def proof_learnt(before, after, learn_after=16):
    """What the device saw while a client learnt its connections short
    (SMCLO_SHORT's default): its first `learn_after` went through shared
    memory, the others are SHORT at the client and PEERNOSMC at the server;
    raises BenchError on anything else."""
    p = DeviceCounters.proof_counts(before, after)
    others = {k: v for k, v in p["fallbacks"].items() if k not in ("SHORT", "PEERNOSMC")}
    if p["conns_opened"] < learn_after or p["xfer_bytes"] <= 0 or others or "SHORT" not in p["fallbacks"]:
        raise BenchError("not learnt: the device shows %d new connections (wanted %d), %d bytes moved, fallbacks %s"
                         % (p["conns_opened"], learn_after, p["xfer_bytes"], p["fallbacks"] or "none"))
    return p


def kernel_smc_status(smclo):
    """None if the kernel's SMC-D loopback can be used, else why not."""
    r = subprocess.run([smclo, "bench", "__kernel-smc"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stdout.strip() or r.stderr.strip())


def smclo_knobs(dmb_size):
    """The SMCLO_* settings of smclo's runs: the environment's, with the DMB
    and copy-mode send buffer size set to `dmb_size` unless the environment
    sets them ("default" keeps smclo's own default)."""
    knobs = {k: v for k, v in os.environ.items() if k.startswith("SMCLO_") and k != "SMCLO_DEVICE_DIR"}
    if dmb_size != "default":
        knobs.setdefault("SMCLO_RMEM", dmb_size)
        knobs.setdefault("SMCLO_WMEM", dmb_size)
    return knobs


def init_device(smclo, device_dir, settings, group=None):
    """Makes `device_dir` an smclo device with the knobs `settings`; with
    `group` (a gid), a device that group shares (``smclo dev init
    --group``), for a server that runs as another user than its client."""
    env = dict(os.environ, SMCLO_DEVICE_DIR=device_dir)
    env.pop("LD_PRELOAD", None)
    steps = [["dev", "init", "--group", str(group), device_dir]] if group is not None else []
    for step in steps + [["dev", "set", *settings]]:
        r = subprocess.run([smclo, *step], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise BenchError("smclo %s: %s" % (" ".join(step), r.stderr.strip()))


def make_transports(smclo, run_dir, knobs, baseline=None):
    """The five transports; smclo's two get device directories of their own
    (copy mode is a device knob, ``dmb_copy=1``) and the SMCLO_* `knobs`.
    With `baseline` (another build's smclo binary), a sixth: that build's
    no-copy smclo on a device it made, to compare two builds run by run."""
    no_copy = os.path.join("/dev/shm", "smclo-suite-%d" % os.getpid())
    copy_dir = no_copy + "-copy"
    base_dir = no_copy + "-baseline"
    settings = {no_copy: ["dmb_copy=0"], copy_dir: ["dmb_copy=1"]}
    for d, s in settings.items():
        init_device(smclo, d, s)
    if baseline:
        init_device(baseline, base_dir, settings[no_copy])
    why = kernel_smc_status(smclo)
    smc_run = shutil.which("smc_run")
    # smclo ships its own command named smc_run; the kernel's is smc-tools'.
    if smc_run and os.path.realpath(smc_run).startswith(os.path.realpath(os.path.dirname(smclo))):
        smc_run = None
    ts = [
        Transport("tcp", "TCP", "tcp"),
        Transport("unix", "UNIX", "unix"),
        Transport("smclo", "smclo", "tcp", [smclo, "run", "--"], no_copy, knobs=knobs, device_settings=settings[no_copy],
                  smclo=smclo),
        Transport("smclo-copy", "smclo copy", "tcp", [smclo, "run", "--"], copy_dir, knobs=knobs,
                  device_settings=settings[copy_dir], smclo=smclo),
        Transport("kernel-smc", "kernel SMC-D lo", "kernel-smc", [smc_run] if smc_run else [], None, why),
    ]
    if baseline:
        ts.append(Transport(BASELINE, "smclo baseline", "tcp", [baseline, "run", "--"], base_dir, knobs=knobs,
                            device_settings=settings[no_copy], smclo=baseline))
    return ts, [no_copy, copy_dir] + ([base_dir] if baseline else [])


#: the name of the baseline build's transport
BASELINE = "smclo-base"

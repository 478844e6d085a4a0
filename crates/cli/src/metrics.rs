//! The device counters in the Prometheus text exposition format (0.0.4,
//! what node-exporter's textfile collector reads) and in OpenMetrics 1.0
//! (what a Prometheus server asks an exporter for first): `smclo stats
//! --prometheus` / `--openmetrics` and `smclo exporter`.
//!
//! The two formats differ only in how a counter's family is named (0.0.4:
//! the sample's name, `_total` included; OpenMetrics: without it), in the
//! `# UNIT` line and in the closing `# EOF`.

use smclo::device::{Device, Stats};
use smclo_wire::reason::Reason;
use std::fmt::Write;

/// Which exposition format to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// Prometheus text format 0.0.4.
    Prometheus,
    /// OpenMetrics 1.0.0.
    OpenMetrics,
}

impl Format {
    /// The HTTP `Content-Type` of a page in this format.
    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// The format a scraper's `Accept` header asks for: OpenMetrics when
    /// it names it, else the text format every scraper reads.
    pub(crate) fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }
}

/// One device's counters, as read, and where it lives.
pub(crate) struct DeviceStats {
    /// The device directory (label `device`).
    pub dir: String,
    /// Its counters.
    pub stats: Stats,
}

impl DeviceStats {
    /// `dev`'s counters now.
    pub(crate) fn of(dev: &Device) -> DeviceStats {
        DeviceStats {
            dir: dev.dir().display().to_string(),
            stats: dev.stats(),
        }
    }
}

/// Whether a metric counts up (reset only by `smclo stats reset`) or is a
/// current level.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

/// One metric family: its name (without `_total`), kind, unit, help and
/// the value it takes from a device's counters.
struct Family {
    name: &'static str,
    kind: Kind,
    unit: Option<&'static str>,
    help: &'static str,
    value: fn(&Stats) -> u64,
}

/// The families with one sample per device; fallbacks, which have one per
/// side and reason, are written by [`fallbacks`].
const FAMILIES: [Family; 7] = [
    Family {
        name: "smclo_connections_opened",
        kind: Kind::Counter,
        unit: None,
        help: "SMC-D connections opened",
        value: |s| s.conns_opened,
    },
    Family {
        name: "smclo_connections_active",
        kind: Kind::Gauge,
        unit: None,
        help: "SMC-D connections with at least one live end",
        value: |s| s.conns_active,
    },
    Family {
        name: "smclo_sent_bytes",
        kind: Kind::Counter,
        unit: Some("bytes"),
        help: "Bytes sent through shared memory",
        value: |s| s.xfer_bytes,
    },
    Family {
        name: "smclo_dmbs_registered",
        kind: Kind::Counter,
        unit: None,
        help: "DMBs (shared-memory buffers) registered",
        value: |s| s.dmbs_registered,
    },
    Family {
        name: "smclo_dmbs",
        kind: Kind::Gauge,
        unit: None,
        help: "DMBs registered now",
        value: |s| s.dmbs_cnt,
    },
    Family {
        name: "smclo_listeners",
        kind: Kind::Gauge,
        unit: None,
        help: "Listening sockets registered for SMC-D",
        value: |s| s.listeners,
    },
    Family {
        name: "smclo_declined_listeners",
        kind: Kind::Gauge,
        unit: None,
        help: "Listening sockets a process that uses io_uring declines: their clients connect over TCP",
        value: |s| s.declines,
    },
];

/// The name of the fallback counter family.
const FALLBACKS: &str = "smclo_fallbacks";

/// Every family's name as a sample carries it (the README lists them).
#[cfg(test)]
fn sample_names() -> Vec<String> {
    let mut v: Vec<String> = FAMILIES
        .iter()
        .map(|f| sample_name(f.name, f.kind))
        .collect();
    v.push(sample_name(FALLBACKS, Kind::Counter));
    v.push("smclo_device_info".into());
    v
}

fn sample_name(family: &str, kind: Kind) -> String {
    match kind {
        Kind::Counter => format!("{family}_total"),
        Kind::Gauge => family.to_string(),
    }
}

/// The page for `devices` in `fmt`.
pub(crate) fn render(devices: &[DeviceStats], fmt: Format) -> String {
    let mut o = String::new();
    header(
        &mut o,
        fmt,
        "smclo_device",
        Kind::Gauge,
        None,
        "A device (its directory and GID); the value is 1",
    );
    for d in devices {
        let _ = writeln!(o, "smclo_device_info{{{}}} 1", labels(d, &[]));
    }
    for f in &FAMILIES {
        header(&mut o, fmt, f.name, f.kind, f.unit, f.help);
        for d in devices {
            let name = sample_name(f.name, f.kind);
            let _ = writeln!(o, "{name}{{{}}} {}", labels(d, &[]), (f.value)(&d.stats));
        }
    }
    fallbacks(&mut o, fmt, devices);
    if fmt == Format::OpenMetrics {
        o.push_str("# EOF\n");
    }
    o
}

/// The fallback counters: one sample per device, side and reason, every
/// reason present so that series never appear from nowhere.
fn fallbacks(o: &mut String, fmt: Format, devices: &[DeviceStats]) {
    let help = "Connections that stayed TCP, by side and SMC decline reason";
    header(o, fmt, FALLBACKS, Kind::Counter, None, help);
    for d in devices {
        for r in Reason::ALL {
            let (client, server) = d.stats.fallback(r);
            for (side, n) in [("client", client), ("server", server)] {
                let code = format!("0x{:08x}", r.code());
                let extra = [("side", side), ("reason", r.name()), ("code", &code)];
                let _ = writeln!(o, "{FALLBACKS}_total{{{}}} {n}", labels(d, &extra));
            }
        }
    }
}

/// `# HELP`, `# TYPE` (and in OpenMetrics `# UNIT`) of a family.
fn header(o: &mut String, fmt: Format, family: &str, kind: Kind, unit: Option<&str>, help: &str) {
    let kind_name = match kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
    };
    // The info family is a gauge named `_info` in both formats.
    let name = match (fmt, kind) {
        _ if family == "smclo_device" => "smclo_device_info".to_string(),
        (Format::Prometheus, _) => sample_name(family, kind),
        (Format::OpenMetrics, _) => family.to_string(),
    };
    let _ = writeln!(o, "# HELP {name} {}", escape_help(help));
    let _ = writeln!(o, "# TYPE {name} {kind_name}");
    if let (Format::OpenMetrics, Some(u)) = (fmt, unit) {
        let _ = writeln!(o, "# UNIT {name} {u}");
    }
}

/// `device="...",gid="..."` and `extra`, escaped.
fn labels(d: &DeviceStats, extra: &[(&str, &str)]) -> String {
    let gid = format!("{:016x}", d.stats.gid);
    let mut all = vec![("device", d.dir.as_str()), ("gid", gid.as_str())];
    all.extend_from_slice(extra);
    all.iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
        .collect::<Vec<_>>()
        .join(",")
}

/// A label value: backslash, double quote and line feed escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A help text: backslash and line feed escaped.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(dir: &str) -> DeviceStats {
        let mut s = Stats {
            gid: 0xabc,
            conns_opened: 7,
            conns_active: 2,
            dmbs_registered: 9,
            dmbs_cnt: 4,
            xfer_bytes: 12345,
            listeners: 1,
            declines: 0,
            fallback_client: [0; 32],
            fallback_server: [0; 32],
        };
        s.fallback_server[Reason::PeerNoSmc.index()] = 3;
        DeviceStats {
            dir: dir.into(),
            stats: s,
        }
    }

    #[test]
    fn counters_are_named_per_format() {
        let d = [sample("/run/smclo")];
        let p = render(&d, Format::Prometheus);
        assert!(p.contains("# TYPE smclo_connections_opened_total counter\n"));
        assert!(p.contains(
            "smclo_connections_opened_total{device=\"/run/smclo\",gid=\"0000000000000abc\"} 7\n"
        ));
        assert!(!p.contains("# EOF") && !p.contains("# UNIT"));
        let m = render(&d, Format::OpenMetrics);
        assert!(m.contains("# TYPE smclo_connections_opened counter\n"));
        assert!(m.contains("# UNIT smclo_sent_bytes bytes\n"));
        assert!(m.ends_with("# EOF\n"));
        assert!(m.contains(
            "smclo_fallbacks_total{device=\"/run/smclo\",gid=\"0000000000000abc\",side=\"server\",reason=\"PEERNOSMC\",code=\"0x03010000\"} 3\n"
        ));
    }

    #[test]
    fn label_values_are_escaped() {
        let d = [sample("/tmp/a \"b\"\\c\nd")];
        let p = render(&d, Format::Prometheus);
        assert!(p.contains("device=\"/tmp/a \\\"b\\\"\\\\c\\nd\""), "{p}");
    }

    #[test]
    fn the_readme_lists_every_metric() {
        let readme = include_str!("../../../README.md");
        for name in sample_names() {
            assert!(
                readme.contains(&format!("`{name}`")),
                "README does not list {name}"
            );
        }
    }

    #[test]
    fn negotiation_prefers_openmetrics_when_asked() {
        let om = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
        assert_eq!(Format::negotiate(Some(om)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Prometheus);
        assert_eq!(Format::negotiate(None), Format::Prometheus);
    }
}

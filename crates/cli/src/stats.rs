//! `smclo stats`: the device's counters, as a table, as JSON, or in the
//! Prometheus or OpenMetrics text format ([`crate::metrics`]).

use crate::metrics::{self, DeviceStats, Format};
use smclo::device::Stats;
use smclo_wire::reason::Reason;
use std::fmt::Write;

const USAGE: &str = "\
usage: smclo stats [-a|--all] [--json|--prometheus|--openmetrics]
       smclo stats reset

  -a, --all      list every fallback reason, also those never counted
  --json         one JSON object with stable keys
  --prometheus   the Prometheus text format (node-exporter's textfile collector)
  --openmetrics  OpenMetrics 1.0
";

/// How `smclo stats` prints the counters.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Table,
    Json,
    Metrics(Format),
}

/// Entry point of `smclo stats`.
pub fn main(args: &[String]) -> i32 {
    let (mut all, mut out) = (false, Output::Table);
    match args.first().map(String::as_str) {
        Some("reset") if args.len() == 1 => {
            return match crate::open_device() {
                Ok(d) => {
                    d.reset_stats();
                    println!("counters reset");
                    0
                }
                Err(code) => code,
            }
        }
        Some("-h" | "--help" | "help") => {
            print!("{USAGE}");
            return 0;
        }
        _ => {}
    }
    for a in args {
        match a.as_str() {
            "-a" | "--all" => all = true,
            "--json" | "-j" => out = Output::Json,
            "--prometheus" => out = Output::Metrics(Format::Prometheus),
            "--openmetrics" => out = Output::Metrics(Format::OpenMetrics),
            _ => {
                eprintln!("smclo stats: unexpected argument {a:?}\n");
                eprint!("{USAGE}");
                return 2;
            }
        }
    }
    let dev = match crate::open_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    let text = match out {
        Output::Table => to_table(&dev.stats(), all),
        Output::Json => to_json(&dev.stats()),
        Output::Metrics(fmt) => metrics::render(&[DeviceStats::of(&dev)], fmt),
    };
    print!("{text}");
    0
}

fn counts(s: &Stats, r: Reason) -> (u64, u64) {
    let i = r.index();
    (
        s.fallback_client.get(i).copied().unwrap_or(0),
        s.fallback_server.get(i).copied().unwrap_or(0),
    )
}

/// The human-readable table.
fn to_table(s: &Stats, all: bool) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "loopback-ism GID {:016x}", s.gid);
    let _ = writeln!(o, "Connections   opened       {:>12}", s.conns_opened);
    let _ = writeln!(o, "              active       {:>12}", s.conns_active);
    let _ = writeln!(o, "DMBs          registered   {:>12}", s.dmbs_registered);
    let _ = writeln!(o, "              in use       {:>12}", s.dmbs_cnt);
    let _ = writeln!(o, "Listeners                  {:>12}", s.listeners);
    let _ = writeln!(o, "              declined     {:>12}", s.declines);
    let _ = writeln!(o, "Xfer bytes                 {:>12}", s.xfer_bytes);
    let total: u64 = Reason::ALL
        .iter()
        .map(|&r| counts(s, r).0 + counts(s, r).1)
        .sum();
    let _ = writeln!(o, "Fallbacks to TCP           {total:>12}");
    let rows: Vec<Reason> = Reason::ALL
        .iter()
        .copied()
        .filter(|&r| all || counts(s, r) != (0, 0))
        .collect();
    if !rows.is_empty() {
        let _ = writeln!(
            o,
            "  {:<14} {:<10} {:>8} {:>8}  Description",
            "Reason", "Code", "Client", "Server"
        );
        for r in rows {
            let (c, sv) = counts(s, r);
            let _ = writeln!(
                o,
                "  {:<14} 0x{:08x} {:>8} {:>8}  {}",
                r.name(),
                r.code(),
                c,
                sv,
                r.description()
            );
        }
    }
    o
}

pub(crate) fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for ch in s.chars() {
        match ch {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// One JSON object; every reason is present, so the keys never change.
fn to_json(s: &Stats) -> String {
    let mut o = String::from("{");
    let _ = write!(
        o,
        "\"gid\":\"{:016x}\",\"conns_opened\":{},\"conns_active\":{},\"dmbs_registered\":{},\"dmbs_cnt\":{},\"xfer_bytes\":{},\"listeners\":{},\"declines\":{},\"fallbacks\":{{",
        s.gid, s.conns_opened, s.conns_active, s.dmbs_registered, s.dmbs_cnt, s.xfer_bytes, s.listeners, s.declines
    );
    for (i, &r) in Reason::ALL.iter().enumerate() {
        let (c, sv) = counts(s, r);
        let _ = write!(
            o,
            "{}{}:{{\"code\":\"0x{:08x}\",\"client\":{},\"server\":{},\"description\":{}}}",
            if i == 0 { "" } else { "," },
            json_str(r.name()),
            r.code(),
            c,
            sv,
            json_str(r.description())
        );
    }
    o.push_str("}}\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Stats {
        let mut s = Stats {
            gid: 0xab,
            conns_opened: 3,
            conns_active: 1,
            dmbs_registered: 6,
            dmbs_cnt: 2,
            xfer_bytes: 1234,
            listeners: 1,
            declines: 0,
            fallback_client: [0; 32],
            fallback_server: [0; 32],
        };
        s.fallback_client[Reason::PeerNoSmc.index()] = 5;
        s.fallback_server[Reason::Timeout.index()] = 2;
        s
    }

    #[test]
    fn table_lists_only_nonzero_reasons_unless_all() {
        let t = to_table(&sample(), false);
        assert!(t.contains("PEERNOSMC") && t.contains("0x03010000") && t.contains("TIMEOUT"));
        assert!(!t.contains("NOUEID"));
        assert!(t.contains("Fallbacks to TCP                      7"));
        let t = to_table(&sample(), true);
        assert!(t.contains("NOUEID"));
    }

    #[test]
    fn json_has_stable_keys() {
        let j = to_json(&sample());
        assert!(
            j.starts_with("{\"gid\":\"00000000000000ab\",\"conns_opened\":3,\"conns_active\":1,")
        );
        assert!(j.contains("\"PEERNOSMC\":{\"code\":\"0x03010000\",\"client\":5,\"server\":0,"));
        assert!(j.contains("\"TIMEOUT\":{\"code\":\"0x02010000\",\"client\":0,\"server\":2,"));
        assert_eq!(j.matches("\"code\"").count(), Reason::COUNT);
        assert_eq!(json_str("a\"b\\\n"), "\"a\\\"b\\\\\\u000a\"");
    }
}

//! `smclo ss`: the device's connections and listeners, like smc-tools'
//! `smcss`, as a table or as JSON.

use crate::stats::json_str;
use smclo::device::Role;
use smclo::ss::{self, Listener, Process, SmcEnd, SmcState, TcpEnd};
use std::fmt::Write;

const USAGE: &str = "\
usage: smclo ss [-a|--all] [--json]
       smclo ss -l|--listening [--json]

  (no option)      every SMC-D connection end of the device
  -a, --all        also the connections that fell back to TCP, while open
  -l, --listening  the listeners registered on the device instead, and
                   the listening sockets a process declines (DECLINED:
                   it uses io_uring, its clients connect over TCP)
  --json           one JSON object with stable keys
";

/// What to list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Opts {
    all: bool,
    listening: bool,
    json: bool,
}

/// Entry point of `smclo ss`.
pub fn main(args: &[String]) -> i32 {
    let mut o = Opts {
        all: false,
        listening: false,
        json: false,
    };
    for a in args {
        match a.as_str() {
            "-a" | "--all" => o.all = true,
            "-l" | "--listening" => o.listening = true,
            "--json" | "-j" => o.json = true,
            "-h" | "--help" | "help" => {
                print!("{USAGE}");
                return 0;
            }
            _ => {
                eprintln!("smclo ss: unexpected argument {a:?}\n");
                eprint!("{USAGE}");
                return 2;
            }
        }
    }
    if o.all && o.listening {
        eprintln!("smclo ss: --listening together with --all is not supported\n");
        eprint!("{USAGE}");
        return 2;
    }
    let dev = match crate::open_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    let gid = format!("{:016x}", dev.gid());
    let out = if o.listening {
        let ls = ss::listeners(&dev);
        if o.json {
            format!(
                "{{\"gid\":\"{gid}\",\"listeners\":[{}]}}\n",
                join(ls.iter().map(listener_json))
            )
        } else {
            listeners_table(&ls)
        }
    } else {
        let smc = ss::smc_ends(&dev);
        let tcp = if o.all {
            ss::tcp_ends(&dev)
        } else {
            Vec::new()
        };
        if o.json {
            let fallbacks = if o.all {
                format!(",\"fallbacks\":[{}]", join(tcp.iter().map(tcp_json)))
            } else {
                String::new()
            };
            format!(
                "{{\"gid\":\"{gid}\",\"connections\":[{}]{fallbacks}}}\n",
                join(smc.iter().map(conn_json))
            )
        } else {
            conns_table(&smc, &tcp)
        }
    };
    print!("{out}");
    0
}

fn join(items: impl Iterator<Item = String>) -> String {
    items.collect::<Vec<_>>().join(",")
}

/// The mode column: SMC-D no-copy or copy.
fn mode(e: &SmcEnd) -> &'static str {
    if e.copy {
        "SMCD-copy"
    } else {
        "SMCD"
    }
}

fn role(r: Role) -> &'static str {
    match r {
        Role::Client => "client",
        Role::Server => "server",
    }
}

/// `pid/program`, as `ss -p` shows processes; `?` for a program of
/// another pid namespace.
fn process(p: &Process) -> String {
    format!("{}/{}", p.pid, p.program.as_deref().unwrap_or("?"))
}

/// Address columns are at least as wide as smcss's (23).
const ADDR_WIDTH: usize = 23;

/// The columns of the connection table.
const HEADER: [&str; 10] = [
    "State",
    "Process",
    "Role",
    "Local Address",
    "Peer Address",
    "Mode",
    "Sent",
    "Received",
    "Ring",
    "Fill",
];

fn smc_row(e: &SmcEnd) -> [String; 10] {
    [
        e.state.name().to_string(),
        process(&e.process),
        role(e.role).to_string(),
        e.local.to_string(),
        e.peer.to_string(),
        mode(e).to_string(),
        e.bytes_sent.to_string(),
        e.bytes_received.to_string(),
        e.ring_len.to_string(),
        e.ring_fill
            .map_or_else(|| "-".to_string(), |f| f.to_string()),
    ]
}

/// A fallback's row: TCP and the reason; smclo does not count its bytes.
fn tcp_row(e: &TcpEnd) -> [String; 10] {
    let dash = || "-".to_string();
    [
        SmcState::Active.name().to_string(),
        process(&e.process),
        role(e.role).to_string(),
        e.local.to_string(),
        e.peer.to_string(),
        format!("TCP/{}", e.reason.name()),
        dash(),
        dash(),
        dash(),
        dash(),
    ]
}

fn conns_table(smc: &[SmcEnd], tcp: &[TcpEnd]) -> String {
    let rows: Vec<[String; 10]> = smc
        .iter()
        .map(smc_row)
        .chain(tcp.iter().map(tcp_row))
        .collect();
    let mut width = HEADER.map(str::len);
    width[3] = width[3].max(ADDR_WIDTH);
    width[4] = width[4].max(ADDR_WIDTH);
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut o = String::new();
    let header = HEADER.map(str::to_string);
    for r in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(width).enumerate() {
            // Text columns left, numbers right.
            let _ = if i < 6 {
                write!(line, "{c:<w$} ")
            } else {
                write!(line, "{c:>w$} ")
            };
        }
        let _ = writeln!(o, "{}", line.trim_end());
    }
    o
}

fn listeners_table(ls: &[Listener]) -> String {
    let aw = ls
        .iter()
        .map(|l| l.addr.to_string().len())
        .fold(ADDR_WIDTH, usize::max);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<15} {:<aw$} {:<12} Process",
        "State", "Local Address", "Netns"
    );
    for l in ls {
        let _ = writeln!(
            o,
            "{:<15} {:<aw$} {:<12} {}",
            l.state.name(),
            l.addr.to_string(),
            l.netns,
            process(&l.process)
        );
    }
    o
}

fn process_json(p: &Process) -> String {
    format!(
        "\"pid\":{},\"pidns\":{},\"program\":{}",
        p.pid,
        p.pidns.0,
        p.program.as_deref().map_or("null".to_string(), json_str)
    )
}

fn conn_json(e: &SmcEnd) -> String {
    format!(
        "{{\"state\":\"{}\",{},\"role\":\"{}\",\"local\":\"{}\",\"peer\":\"{}\",\"mode\":\"{}\",\"token\":\"{:016x}\",\"peer_token\":\"{:016x}\",\"bytes_sent\":{},\"bytes_received\":{},\"ring_len\":{},\"ring_fill\":{}}}",
        e.state.name(),
        process_json(&e.process),
        role(e.role),
        e.local,
        e.peer,
        if e.copy { "smcd-copy" } else { "smcd" },
        e.token,
        e.peer_token,
        e.bytes_sent,
        e.bytes_received,
        e.ring_len,
        e.ring_fill.map_or("null".to_string(), |f| f.to_string())
    )
}

fn tcp_json(e: &TcpEnd) -> String {
    format!(
        "{{\"state\":\"{}\",{},\"role\":\"{}\",\"local\":\"{}\",\"peer\":\"{}\",\"mode\":\"tcp\",\"reason\":\"{}\",\"reason_code\":\"0x{:08x}\"}}",
        SmcState::Active.name(),
        process_json(&e.process),
        role(e.role),
        e.local,
        e.peer,
        e.reason.name(),
        e.reason.code()
    )
}

fn listener_json(l: &Listener) -> String {
    format!(
        "{{\"state\":\"{}\",{},\"local\":\"{}\",\"netns\":{}}}",
        l.state.name(),
        process_json(&l.process),
        l.addr,
        l.netns
    )
}

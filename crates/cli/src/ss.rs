//! `smclo ss`: the device's connections and listeners, like smc-tools'
//! `smcss`, as a table or as JSON.

use crate::stats::json_str;
use smclo::device::Role;
use smclo::ss::{self, Listener, Process, SmcEnd};
use std::fmt::Write;

const USAGE: &str = "\
usage: smclo ss [-l|--listening] [--json]

  (no option)      every SMC-D connection end of the device
  -l, --listening  the listeners registered on the device instead
  --json           one JSON object with stable keys
";

/// What to list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Opts {
    listening: bool,
    json: bool,
}

/// Entry point of `smclo ss`.
pub fn main(args: &[String]) -> i32 {
    let mut o = Opts {
        listening: false,
        json: false,
    };
    for a in args {
        match a.as_str() {
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
    let dev = match crate::open_device() {
        Ok(d) => d,
        Err(code) => return code,
    };
    let out = match (o.listening, o.json) {
        (false, false) => conns_table(&ss::smc_ends(&dev)),
        (true, false) => listeners_table(&ss::listeners(&dev)),
        (false, true) => format!(
            "{{\"gid\":\"{:016x}\",\"connections\":[{}]}}\n",
            dev.gid(),
            join(ss::smc_ends(&dev).iter().map(conn_json))
        ),
        (true, true) => format!(
            "{{\"gid\":\"{:016x}\",\"listeners\":[{}]}}\n",
            dev.gid(),
            join(ss::listeners(&dev).iter().map(listener_json))
        ),
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

fn conns_table(ends: &[SmcEnd]) -> String {
    let aw = ends
        .iter()
        .flat_map(|e| [e.local.to_string().len(), e.peer.to_string().len()])
        .fold(ADDR_WIDTH, usize::max);
    let pw = ends
        .iter()
        .map(|e| process(&e.process).len())
        .fold(7, usize::max);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<15} {:<pw$} {:<6} {:<aw$} {:<aw$} {:<9} {:>12} {:>12} {:>8} {:>8}",
        "State",
        "Process",
        "Role",
        "Local Address",
        "Peer Address",
        "Mode",
        "Sent",
        "Received",
        "Ring",
        "Fill"
    );
    for e in ends {
        let fill = e
            .ring_fill
            .map_or_else(|| "-".to_string(), |f| f.to_string());
        let _ = writeln!(
            o,
            "{:<15} {:<pw$} {:<6} {:<aw$} {:<aw$} {:<9} {:>12} {:>12} {:>8} {:>8}",
            e.state.name(),
            process(&e.process),
            role(e.role),
            e.local.to_string(),
            e.peer.to_string(),
            mode(e),
            e.bytes_sent,
            e.bytes_received,
            e.ring_len,
            fill
        );
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
            "LISTEN",
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

fn listener_json(l: &Listener) -> String {
    format!(
        "{{\"state\":\"LISTEN\",{},\"local\":\"{}\",\"netns\":{}}}",
        process_json(&l.process),
        l.addr,
        l.netns
    )
}

//! `smclo exporter`: the device counters over HTTP, for a Prometheus
//! server to scrape (`GET /metrics`), in the format its `Accept` header
//! asks for ([`crate::metrics`]). Loopback only unless told otherwise; one
//! request at a time, each bounded in time, so a slow or idle client
//! delays scrapes by at most [`IO_TIMEOUT`] and costs no thread.

use crate::metrics::{self, DeviceStats, Format};
use smclo::device::Device;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const USAGE: &str = "\
usage: smclo exporter [--listen ADDR:PORT] [--device DIR]...

Serves the counters of each device (default: the one `smclo stats` shows)
at http://ADDR:PORT/metrics, in the Prometheus text format or, when the
scraper asks for it, OpenMetrics.

  --listen ADDR:PORT  where to listen (default 127.0.0.1:9468)
  --device DIR        a device directory to export (repeatable)
";

/// Where the exporter listens unless told otherwise.
const DEFAULT_LISTEN: &str = "127.0.0.1:9468";

/// How long one request may take to arrive and its answer to leave.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest request head read.
const MAX_HEAD: usize = 8192;

/// Why the command line is not usable.
#[derive(Debug, PartialEq, Eq)]
enum UsageError {
    MissingValue(&'static str),
    BadAddress(String),
    Unexpected(String),
}

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UsageError::MissingValue(o) => write!(f, "{o} needs a value"),
            UsageError::BadAddress(a) => write!(f, "not an ADDR:PORT: {a:?}"),
            UsageError::Unexpected(a) => write!(f, "unexpected argument {a:?}"),
        }
    }
}

struct Options {
    listen: SocketAddr,
    devices: Vec<PathBuf>,
}

fn parse(args: &[String]) -> Result<Options, UsageError> {
    let mut o = Options {
        listen: DEFAULT_LISTEN.parse().expect("a valid default"),
        devices: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--listen" | "-l" => {
                let v = it.next().ok_or(UsageError::MissingValue("--listen"))?;
                o.listen = v.parse().map_err(|_| UsageError::BadAddress(v.clone()))?;
            }
            "--device" | "-d" => {
                let v = it.next().ok_or(UsageError::MissingValue("--device"))?;
                o.devices.push(PathBuf::from(v));
            }
            _ => return Err(UsageError::Unexpected(a.clone())),
        }
    }
    Ok(o)
}

/// Entry point of `smclo exporter`.
pub fn main(args: &[String]) -> i32 {
    if matches!(
        args.first().map(String::as_str),
        Some("-h" | "--help" | "help")
    ) {
        print!("{USAGE}");
        return 0;
    }
    let opts = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("smclo exporter: {e}\n");
            eprint!("{USAGE}");
            return 2;
        }
    };
    let devices = match open_all(&opts.devices) {
        Ok(d) => d,
        Err(code) => return code,
    };
    let listener = match TcpListener::bind(opts.listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("smclo exporter: cannot listen on {}: {e}", opts.listen);
            return 1;
        }
    };
    let at = listener.local_addr().map_or(opts.listen, |a| a);
    eprintln!("smclo exporter: serving http://{at}/metrics");
    for conn in listener.incoming() {
        match conn {
            Ok(c) => {
                if let Err(e) = serve(c, &devices) {
                    eprintln!("smclo exporter: a request failed: {e}");
                }
            }
            Err(e) => eprintln!("smclo exporter: accept failed: {e}"),
        }
    }
    0
}

fn open_all(dirs: &[PathBuf]) -> Result<Vec<Arc<Device>>, i32> {
    if dirs.is_empty() {
        return crate::open_device().map(|d| vec![d]);
    }
    dirs.iter()
        .map(|d| {
            Device::open(d).map_err(|e| {
                eprintln!("smclo exporter: {}: {e}", d.display());
                1
            })
        })
        .collect()
}

/// Answers one request on `c`.
fn serve(mut c: TcpStream, devices: &[Arc<Device>]) -> std::io::Result<()> {
    c.set_read_timeout(Some(IO_TIMEOUT))?;
    c.set_write_timeout(Some(IO_TIMEOUT))?;
    let head = read_head(&mut c)?;
    let (status, ctype, body) = respond(&head, devices);
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    c.write_all(reply.as_bytes())?;
    if !head.starts_with("HEAD ") {
        c.write_all(body.as_bytes())?;
    }
    Ok(())
}

/// The request's head (request line and headers), at most [`MAX_HEAD`]
/// bytes.
fn read_head(c: &mut TcpStream) -> std::io::Result<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_HEAD {
        let n = c.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Status line, content type and body for the request `head`.
fn respond(head: &str, devices: &[Arc<Device>]) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    let mut lines = head.lines();
    let mut parts = lines.next().unwrap_or("").split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return ("405 Method Not Allowed", TEXT, "GET /metrics\n".into());
    }
    match path.split('?').next().unwrap_or("") {
        "/metrics" => {
            let accept = lines
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("accept"))
                .map(|(_, v)| v.trim());
            let fmt = Format::negotiate(accept);
            let body = metrics::render(
                &devices
                    .iter()
                    .map(|d| DeviceStats::of(d))
                    .collect::<Vec<_>>(),
                fmt,
            );
            ("200 OK", fmt.content_type(), body)
        }
        "/" => (
            "200 OK",
            TEXT,
            "smclo exporter: the counters are at /metrics\n".into(),
        ),
        _ => (
            "404 Not Found",
            TEXT,
            "not found; the counters are at /metrics\n".into(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn options_are_checked() {
        let o = parse(&args(&[
            "--listen",
            "127.0.0.1:1234",
            "-d",
            "/x",
            "-d",
            "/y",
        ]))
        .unwrap();
        assert_eq!(o.listen, "127.0.0.1:1234".parse().unwrap());
        assert_eq!(o.devices, [PathBuf::from("/x"), PathBuf::from("/y")]);
        assert_eq!(
            parse(&args(&[])).unwrap().listen,
            DEFAULT_LISTEN.parse().unwrap()
        );
        assert!(matches!(
            parse(&args(&["--listen"])),
            Err(UsageError::MissingValue(_))
        ));
        assert!(matches!(
            parse(&args(&["--listen", "nowhere"])),
            Err(UsageError::BadAddress(_))
        ));
        assert!(matches!(
            parse(&args(&["--bogus"])),
            Err(UsageError::Unexpected(_))
        ));
    }
}

//! haproxy in TCP mode under `smclo run`, between a test's client and its
//! server (a proxy, or a sidecar that captured the client's connections).

use crate::{wait_listen, Env, Mode, Proc};
use std::fs;

/// haproxy in TCP mode under `smclo run`, inside `netns` if given: two
/// threads, listening on `front` and dialing `back` for each connection;
/// its configuration in the test's temp dir. Waits until it listens.
pub fn start_haproxy_tcp(
    env: &mut Env,
    netns: Option<&str>,
    front: (&str, u16),
    back: (&str, u16),
) -> Proc {
    start_haproxy_tcp_with(env, netns, front, back, &[])
}

/// [`start_haproxy_tcp`] with `options` added to its defaults (e.g.
/// `option splice-response`).
pub fn start_haproxy_tcp_with(
    env: &mut Env,
    netns: Option<&str>,
    front: (&str, u16),
    back: (&str, u16),
    options: &[&str],
) -> Proc {
    let options: String = options.iter().map(|o| format!("  {o}\n")).collect();
    let cfg = env.path("haproxy.cfg");
    fs::write(
        &cfg,
        format!(
            "global\n  maxconn 256\n  nbthread 2\n\
             defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n{}\
             frontend f\n  bind {}:{}\n  default_backend b\n\
             backend b\n  server s1 {}:{}\n",
            options, front.0, front.1, back.0, back.1
        ),
    )
    .unwrap();
    let cmd = env.command(
        Mode::Smclo,
        netns,
        "haproxy",
        &["-f", cfg.to_str().unwrap(), "-db"],
    );
    let mut proxy = env.spawn_cmd("haproxy", cmd);
    wait_listen(&mut proxy, front.1);
    proxy
}

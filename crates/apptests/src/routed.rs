//! A routed path between network namespaces, the layout of routed
//! container networks: a client and a server each on a veth to a
//! forwarding namespace (a node), through one or more of them.

use crate::{exec_in, ip_in, veth, Env, Netns};

/// The namespaces of a routed path, client's first, server's last; link
/// `l` (between namespaces `l` and `l + 1`) is a /30 of
/// 10.199.(`first_link` + `l`).0, the side nearer the client `.1`, the
/// other `.2`.
pub struct Routed {
    pub hops: Vec<Netns>,
    first_link: u8,
}

impl Routed {
    /// Client — `routers` forwarding namespaces — server, default routes
    /// towards the middle; each router forwards, and reaches the links
    /// beyond its neighbours through them.
    pub fn new(env: &mut Env, routers: usize, first_link: u8) -> Routed {
        let mut hops = vec![env.netns("cli")];
        for r in 0..routers {
            hops.push(env.netns(&format!("r{r}")));
        }
        hops.push(env.netns("srv"));
        let path = Routed { hops, first_link };
        let last = path.hops.len() - 1;
        for link in 0..last {
            let (a, b) = (path.addr(link, 1), path.addr(link, 2));
            veth(&path.hops[link], &path.hops[link + 1], &a, &b);
        }
        let to_router = path.addr(0, 2);
        ip_in(
            path.client(),
            &["route", "add", "default", "via", &to_router],
        );
        let to_router = path.addr(last - 1, 1);
        ip_in(
            path.server(),
            &["route", "add", "default", "via", &to_router],
        );
        for r in 1..last {
            path.forward(r);
        }
        path
    }

    /// Router `r` (a hop) forwards, with routes to the links beyond its
    /// neighbours.
    fn forward(&self, r: usize) {
        let (router, last) = (&self.hops[r].name, self.hops.len() - 1);
        exec_in(router, "sysctl", &["-qw", "net.ipv4.ip_forward=1"]);
        for link in 0..last {
            let via = if link + 1 < r {
                self.addr(r - 1, 1)
            } else if link > r {
                self.addr(r, 2)
            } else {
                continue;
            };
            let net = format!("{}/30", self.addr(link, 0));
            ip_in(router, &["route", "add", &net, "via", &via]);
        }
    }

    /// The address `end` (1: the client's side, 2: the server's; 0: the
    /// network) of link `link`.
    pub fn addr(&self, link: usize, end: u8) -> String {
        format!("10.199.{}.{end}", usize::from(self.first_link) + link)
    }

    pub fn client(&self) -> &str {
        &self.hops[0].name
    }

    pub fn server(&self) -> &str {
        &self.hops[self.hops.len() - 1].name
    }

    /// The forwarding namespace next to the server.
    pub fn last_router(&self) -> &str {
        &self.hops[self.hops.len() - 2].name
    }

    /// The client's address, on the first link.
    pub fn client_ip(&self) -> String {
        self.addr(0, 1)
    }

    /// The server's address, on the last link.
    pub fn server_ip(&self) -> String {
        self.addr(self.hops.len() - 2, 2)
    }
}

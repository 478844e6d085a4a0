//! The core's layers (docs/ARCHITECTURE.md, "Layers of the core"): every
//! `crate::` path in a module's code (its tests excepted) names a module of
//! a lower layer, or one of its own layer listed before it. So the modules
//! form no import loop, and a low module never calls up: what it needs from
//! above it is given to it (a function it is passed or told at setup).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The layers, lowest first; within a layer, a module may use those
/// listed before it. Every module of `src/` is here, and only those.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "system and settings",
        &[
            "numhash", "clock", "debug", "error", "errno", "chan_sys", "signal", "rng", "tcp_syn",
            "sockaddr", "access", "config", "doorbell", "short", "backoff",
        ],
    ),
    (
        "process resources",
        &[
            "fdnum", "deferred", "owner", "vault", "spin", "wait", "fault",
        ],
    ),
    (
        "shared memory",
        &["table", "early_count", "announced", "dmb", "ring"],
    ),
    ("device", &["device"]),
    ("device tables", &["registry", "fallbacks", "rendezvous"]),
    ("connections", &["conn", "poller", "accept_spin", "ss"]),
    ("handshake", &["handshake"]),
    ("native API", &["api"]),
    ("interfaces for adapters and tests", &["adapter", "testing"]),
];

/// A module's place: (layer, position in it).
fn rank(module: &str) -> Option<(usize, usize)> {
    LAYERS
        .iter()
        .enumerate()
        .find_map(|(l, (_, ms))| ms.iter().position(|m| *m == module).map(|p| (l, p)))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The `.rs` files under `dir`, with the top module each belongs to
/// (`conn/exec.rs` belongs to `conn`). The crate root and the binaries
/// (crates of their own) are left out.
fn files(dir: &Path, top: Option<&str>, out: &mut Vec<(String, PathBuf)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_str().unwrap().to_string();
        let module = top.map_or(name.clone(), str::to_string);
        if p.is_dir() {
            if top.is_none() && name == "bin" {
                continue;
            }
            files(&p, Some(&module), out);
        } else if p.extension().is_some_and(|x| x == "rs") && !(top.is_none() && name == "lib") {
            out.push((module, p));
        }
    }
}

/// `s` without its comments (doc comments too: a link is no use).
fn without_comments(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        rest = rest[i..].find("*/").map_or("", |j| &rest[i + j + 2..]);
    }
    out.push_str(rest);
    out.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `s` without its `#[cfg(test)] mod NAME { ... }` blocks: tests may use
/// any module.
fn without_tests(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        let open = after.find('{').expect("a test module's body");
        assert!(
            after[..open].contains("mod "),
            "#[cfg(test)] on something other than a module: {}",
            &after[..open]
        );
        let mut depth = 0;
        let mut end = after.len();
        for (k, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = open + k + 1;
                break;
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn ident(s: &str) -> &str {
    let n = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..n]
}

/// The top modules that `code` names by `crate::` paths, grouped
/// (`crate::{a, b::c}`) or not.
fn uses(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item_start = true;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start && depth == 1 => {
                        out.insert(ident(&group[k..]).to_string());
                        item_start = false;
                    }
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
            }
        } else {
            out.insert(ident(rest).to_string());
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

#[test]
fn modules_use_only_lower_layers() {
    let mut fs = Vec::new();
    files(&src(), None, &mut fs);
    let modules: BTreeSet<&str> = fs.iter().map(|(m, _)| m.as_str()).collect();
    let listed: BTreeSet<&str> = LAYERS
        .iter()
        .flat_map(|(_, ms)| ms.iter().copied())
        .collect();
    assert_eq!(
        modules, listed,
        "src/ and the layer table name other modules"
    );
    let mut wrong = Vec::new();
    for (m, path) in &fs {
        let code = without_tests(&without_comments(&std::fs::read_to_string(path).unwrap()));
        let me = rank(m).unwrap();
        for used in uses(&code) {
            // Paths into the crate root's re-exports (`crate::Error`) start
            // with an upper-case letter or name a macro's module.
            let Some(r) = rank(&used) else {
                assert!(
                    used.starts_with(|c: char| c.is_ascii_uppercase()),
                    "{}: crate::{used} is no module of the table",
                    path.display()
                );
                continue;
            };
            if used != *m && r >= me {
                wrong.push(format!("{} uses crate::{used}", path.display()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "modules calling up:\n{}",
        wrong.join("\n")
    );
}

/// The parsing above sees what it must see.
#[test]
fn uses_are_found_in_every_form() {
    let code = "use crate::a::B;\nuse crate::{c, d::{E, F}, self};\nlet x = crate::g::h();\n\
                // crate::comment\n#[cfg(test)]\nmod tests { use crate::t; }\n";
    let found = uses(&without_tests(&without_comments(code)));
    let want: BTreeSet<String> = ["a", "c", "d", "g"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, want);
}

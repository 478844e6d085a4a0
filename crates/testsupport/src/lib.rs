//! What the workspace's tests share: C programs compiled for them
//! ([`compile_c`]), the artifacts of this build ([`built`]), throw-away
//! device directories ([`DevDir`]), child processes killed when a test ends
//! ([`ChildGuard`], [`Peer`]) and a test binary re-run as a child in a role
//! ([`spawn_child`], [`child_role`]).

mod cc;
mod child;

pub use cc::{compile_c, compile_c_with, CFLAGS};
pub use child::{child_role, spawn_child, spawn_child_env, ChildGuard, Peer, CHILD_ENTRY};

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// The test executable's directory (`target/<profile>/deps`, where cargo
/// always writes the workspace's libraries too) and `target/<profile>`
/// (where binaries and copies of the libraries are).
fn build_dirs() -> [PathBuf; 2] {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe
        .parent()
        .expect("test executable has a directory")
        .to_path_buf();
    let profile = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().unwrap().to_path_buf()
    } else {
        deps.clone()
    };
    [deps, profile]
}

/// `target/<profile>` of the running test executable.
pub fn profile_dir() -> PathBuf {
    let [_, profile] = build_dirs();
    profile
}

/// The file `name` of this build (`libsmclo_preload.so`, `smclo-testpeer`,
/// ...), from `deps/` or `target/<profile>`; panics naming what to build
/// when it is in neither.
pub fn built(name: &str) -> PathBuf {
    let dirs = build_dirs();
    for d in &dirs {
        let p = d.join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "{name} is in none of {dirs:?}: build it with the same profile and target directory \
         (`cargo build --release --workspace`)"
    );
}

/// A device directory under /dev/shm, unique per process and call, removed
/// on drop. The directory itself is not created: the device creates it.
pub struct DevDir(pub PathBuf);

impl DevDir {
    /// A fresh path, `tag` naming the test in it.
    pub fn new(tag: &str) -> DevDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = PathBuf::from(format!(
            "/dev/shm/smclo-test-{tag}-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        DevDir(p)
    }
}

impl Drop for DevDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

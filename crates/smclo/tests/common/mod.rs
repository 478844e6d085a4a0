//! What the device tests share: a throw-away device directory and child
//! processes that are killed when a test ends, passing or failing.
#![allow(dead_code)] // each test file uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A device directory under /dev/shm, unique per process and call, removed
/// on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A fresh path (the directory itself is not created).
    pub fn new(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = PathBuf::from(format!(
            "/dev/shm/smclo-test-{tag}-{}-{n}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills the child on drop, so a failing test leaves no process behind.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Reads the child's stdout up to the line `READY`; returns the lines
    /// before it.
    pub fn wait_ready(&mut self) -> Vec<String> {
        use std::io::BufRead;
        let mut r = std::io::BufReader::new(self.0.stdout.as_mut().unwrap());
        let mut seen = Vec::new();
        loop {
            let mut l = String::new();
            assert!(
                r.read_line(&mut l).unwrap() > 0,
                "child exited before READY: {seen:?}"
            );
            let l = l.trim().to_string();
            if l == "READY" {
                return seen;
            }
            seen.push(l);
        }
    }
}

/// In a child made by [`spawn_child`]: its role and device directory;
/// `None` in the test run itself.
pub fn child_role() -> Option<(String, PathBuf)> {
    let role = std::env::var("SMCLO_TEST_ROLE").ok()?;
    Some((
        role,
        PathBuf::from(std::env::var("SMCLO_TEST_DIR").unwrap()),
    ))
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Re-runs this test binary as a child that executes only the test named
/// `child_entry`, which reads its role and device directory from the
/// environment (`SMCLO_TEST_ROLE`, `SMCLO_TEST_DIR`).
pub fn spawn_child(role: &str, dir: &Path) -> ChildGuard {
    spawn_child_env(role, dir, &[])
}

/// [`spawn_child`] with more environment variables for the child.
pub fn spawn_child_env(role: &str, dir: &Path, env: &[(&str, &str)]) -> ChildGuard {
    let c = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_entry",
            "--nocapture",
            "--test-threads=1",
            "-q",
        ])
        .env("SMCLO_TEST_ROLE", role)
        .env("SMCLO_TEST_DIR", dir)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    ChildGuard(c)
}

//! Child processes of a test, killed when it ends, passing or failing.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

/// Kills the child on drop, so a failing test leaves no process behind.
pub struct ChildGuard(pub Child);

impl ChildGuard {
    /// Reads the child's stdout up to the line `READY`; returns the lines
    /// before it.
    pub fn wait_ready(&mut self) -> Vec<String> {
        let mut r = BufReader::new(self.0.stdout.as_mut().unwrap());
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

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A peer process whose stdout the test reads line by line (its stderr
/// goes to the test's); killed when dropped.
pub struct Peer {
    pub child: Child,
    /// The peer's stdout, read by [`Peer::line`].
    pub out: BufReader<ChildStdout>,
}

impl Peer {
    /// Starts `cmd`.
    pub fn start(mut cmd: Command) -> Peer {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let out = BufReader::new(child.stdout.take().unwrap());
        Peer { child, out }
    }

    /// The next line the peer printed, trimmed ("" at its end).
    pub fn line(&mut self) -> String {
        let mut s = String::new();
        self.out.read_line(&mut s).unwrap();
        s.trim().to_string()
    }

    pub fn kill9(&mut self) {
        // SAFETY: kill(2) on our own child's pid, not reaped before the
        // wait below.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// Waits for the peer and checks that it succeeded.
    pub fn wait_ok(mut self) {
        let st = self.child.wait().unwrap();
        assert!(st.success(), "peer exited with {st}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The arguments that make a test binary run only its test `child_entry`
/// (the entry point of the children that tests start from their own
/// binary), printing what it prints.
pub const CHILD_ENTRY: [&str; 5] = [
    "--exact",
    "child_entry",
    "--nocapture",
    "--test-threads=1",
    "-q",
];

/// In a child made by [`spawn_child`]: its role and device directory;
/// `None` in the test run itself.
pub fn child_role() -> Option<(String, PathBuf)> {
    let role = std::env::var("SMCLO_TEST_ROLE").ok()?;
    Some((
        role,
        PathBuf::from(std::env::var("SMCLO_TEST_DIR").unwrap()),
    ))
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
        .args(CHILD_ENTRY)
        .env("SMCLO_TEST_ROLE", role)
        .env("SMCLO_TEST_DIR", dir)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    ChildGuard(c)
}

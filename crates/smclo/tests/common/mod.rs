//! What the device tests share (from smclo-testsupport): a throw-away device
//! directory and child processes that are killed when a test ends, passing
//! or failing.
#![allow(unused_imports)] // each test file uses a different subset

pub use smclo_testsupport::{
    child_role, spawn_child, spawn_child_env, ChildGuard, DevDir as TempDir, CHILD_ENTRY,
};

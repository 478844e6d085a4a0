//! C API.

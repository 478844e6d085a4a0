//! Pure byte layouts of smclo.

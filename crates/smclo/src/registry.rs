//! registry (being written).

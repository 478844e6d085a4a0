//! reason (being written).

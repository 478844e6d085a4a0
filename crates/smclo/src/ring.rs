//! ring (being written).

//! device (being written).

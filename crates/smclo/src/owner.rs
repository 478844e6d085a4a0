//! owner (being written).

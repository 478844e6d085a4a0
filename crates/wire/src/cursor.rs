//! cursor (being written).

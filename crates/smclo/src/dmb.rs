//! dmb (being written).

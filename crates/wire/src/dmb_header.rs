//! dmb_header (being written).

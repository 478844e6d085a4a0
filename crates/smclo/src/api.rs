//! api (being written).

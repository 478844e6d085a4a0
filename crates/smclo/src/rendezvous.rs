//! rendezvous (being written).

//! handshake (being written).

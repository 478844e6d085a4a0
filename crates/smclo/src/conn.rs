//! conn (being written).

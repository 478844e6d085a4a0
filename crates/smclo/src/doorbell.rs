//! doorbell (being written).

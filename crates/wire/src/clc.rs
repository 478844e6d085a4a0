//! clc (being written).

//! The rig's tests: the data pattern shared with the host, a KTAP writer, and helpers for the
//! in-guest test binaries under `src/bin/`.

pub mod ctl;
pub mod guest;
pub mod ktap;
pub mod pattern;

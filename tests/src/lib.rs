//! The rig's tests: the data pattern shared with the host, a KTAP writer, a sampling profiler,
//! and helpers for the
//! in-guest test binaries under `src/bin/`.

pub mod ctl;
pub mod errno;
pub mod guest;
pub mod ktap;
pub mod pattern;
pub mod profile;

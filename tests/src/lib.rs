//! What the rig's in-guest test programs under `src/bin/` share: the data pattern (its own crate,
//! `tests/pattern/`, which the host's crates take alone), raw access to the driver (`common`),
//! fault-injection helpers (`fault`), vfio by hand (`vfio`), a KTAP writer and a sampling
//! profiler.

pub use fgds_pattern as pattern;

pub mod common;
pub mod ctl;
pub mod errno;
pub mod fault;
pub mod guest;
pub mod ktap;
pub mod profile;
pub mod vfio;

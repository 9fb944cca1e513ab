//! The rig's tests: the data pattern shared with the host, and, with the `guest` feature (on by
//! default), what the in-guest test programs under `src/bin/` share: raw access to the driver
//! (`common`), fault-injection helpers (`fault`), vfio by hand (`vfio`), a KTAP writer and a
//! sampling profiler. The host's crates take the pattern alone.

pub mod pattern;

#[cfg(feature = "guest")]
pub mod common;
#[cfg(feature = "guest")]
pub mod ctl;
#[cfg(feature = "guest")]
pub mod errno;
#[cfg(feature = "guest")]
pub mod fault;
#[cfg(feature = "guest")]
pub mod guest;
#[cfg(feature = "guest")]
pub mod ktap;
#[cfg(feature = "guest")]
pub mod profile;
#[cfg(feature = "guest")]
pub mod vfio;

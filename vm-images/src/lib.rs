//! Placeholder, replaced by the rig code.

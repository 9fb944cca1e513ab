//! Userspace API for fgds.

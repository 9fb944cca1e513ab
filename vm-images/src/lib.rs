//! What the guest runs: kernels (Debian packages or a tree the user built), the initramfs with
//! the static init and the test binaries, and the NVMe and GPU images.

pub mod disk;
pub mod initramfs;
pub mod kernel;

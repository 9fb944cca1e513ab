//! QEMU for the fgds rig: the machine (q35, an NVMe drive and an ivshmem "GPU" behind one PCIe
//! switch), the QEMU process and its QMP socket, and the parsing of what the guest reports
//! (KTAP results, kernel console splats).

pub mod backing;
pub mod console;
pub mod control;
pub mod ktap;
pub mod machine;
pub mod qmp;

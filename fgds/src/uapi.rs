//! The driver's UAPI, `driver/include/uapi/linux/fgds.h`, mirrored field for field.
//!
//! `tests/uapi_layout.rs` compiles a C program against the header and fails if the sizes,
//! offsets or ioctl numbers here differ from it.

use rustix::ioctl::{Opcode, opcode};

/// `struct fgds_ioctl_reg_buffer`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RegBuffer {
    pub dmabuf_fd: i32,
    pub flags: u32,
    pub dmabuf_offset: u64,
    pub size: u64,
    pub idx: u64,
}

/// `struct fgds_ioctl_unreg_buffer`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UnregBuffer {
    pub idx: u64,
}

/// `FGDS_IOCTL_MAGIC`.
pub const MAGIC: u8 = 0x88;
/// `FGDS_IOCTL_REG_BUFFER`.
pub const REG_BUFFER: Opcode = opcode::read_write::<RegBuffer>(MAGIC, 0x01);
/// `FGDS_IOCTL_UNREG_BUFFER`.
pub const UNREG_BUFFER: Opcode = opcode::write::<UnregBuffer>(MAGIC, 0x02);

/// `struct fgds_io`: the argument of `FGDS_IOCTL_READ`/`WRITE`, and the command area of an
/// `FGDS_URING_CMD_READ`/`WRITE` SQE (128-byte entries).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Io {
    pub idx: u64,
    pub offset: u64,
    pub len: u64,
    pub file_offset: u64,
    pub fd: i32,
    pub flags: u32,
}

impl Io {
    /// The 80 bytes of a 128-byte SQE's command area.
    pub fn to_cmd(self) -> [u8; 80] {
        let mut cmd = [0u8; 80];
        cmd[..8].copy_from_slice(&self.idx.to_ne_bytes());
        cmd[8..16].copy_from_slice(&self.offset.to_ne_bytes());
        cmd[16..24].copy_from_slice(&self.len.to_ne_bytes());
        cmd[24..32].copy_from_slice(&self.file_offset.to_ne_bytes());
        cmd[32..36].copy_from_slice(&self.fd.to_ne_bytes());
        cmd[36..40].copy_from_slice(&self.flags.to_ne_bytes());
        cmd
    }
}

/// `FGDS_IOCTL_READ`: from the file into the registration.
pub const IOCTL_READ: Opcode = opcode::write::<Io>(MAGIC, 0x03);
/// `FGDS_IOCTL_WRITE`: from the registration to the file.
pub const IOCTL_WRITE: Opcode = opcode::write::<Io>(MAGIC, 0x04);
/// `FGDS_URING_CMD_READ` (an io_uring command's `cmd_op`).
pub const URING_CMD_READ: Opcode = opcode::write::<Io>(MAGIC, 0x12);
/// `FGDS_URING_CMD_WRITE`.
pub const URING_CMD_WRITE: Opcode = opcode::write::<Io>(MAGIC, 0x13);

/// `struct fgds_check_file`: the argument of `FGDS_IOCTL_CHECK_FILE`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CheckFile {
    pub idx: u64,
    pub fd: i32,
    pub flags: u32,
    pub path: u32,
    pub dma_domain: u32,
    pub dma_bdf: u32,
    pub reserved: u32,
}

impl CheckFile {
    /// The device the driver found doing the file's DMA, as `DDDD:BB:DD.F`.
    pub fn dma_dev(&self) -> Option<String> {
        (self.dma_bdf != CHECK_NO_DEV).then(|| {
            format!(
                "{:04x}:{:02x}:{:02x}.{}",
                self.dma_domain,
                self.dma_bdf >> 8,
                (self.dma_bdf >> 3) & 0x1f,
                self.dma_bdf & 7
            )
        })
    }
}

/// `FGDS_CHECK_WRITE`.
pub const CHECK_WRITE: u32 = 0x1;
/// `FGDS_CHECK_NO_DEV`.
pub const CHECK_NO_DEV: u32 = 0xffff_ffff;
/// `FGDS_IOCTL_CHECK_FILE`: where fgds's reads and writes of a file would go.
pub const IOCTL_CHECK_FILE: Opcode = opcode::read_write::<CheckFile>(MAGIC, 0x05);

//! The crate's UAPI mirror must match the C header byte for byte: this compiles a C program
//! against driver/include/uapi/linux/fgds.h and compares sizes, offsets and ioctl numbers.

use std::mem::{offset_of, size_of};
use std::path::Path;
use std::process::Command;

use fgds::uapi::{self, CheckFile, Io, RegBuffer, UnregBuffer};

const PROBE: &str = r#"
#include <stdio.h>
#include <stddef.h>
#include <linux/fgds.h>
int main(void)
{
	printf("reg_size %zu\n", sizeof(struct fgds_ioctl_reg_buffer));
	printf("reg_dmabuf_fd %zu\n", offsetof(struct fgds_ioctl_reg_buffer, dmabuf_fd));
	printf("reg_flags %zu\n", offsetof(struct fgds_ioctl_reg_buffer, flags));
	printf("reg_dmabuf_offset %zu\n", offsetof(struct fgds_ioctl_reg_buffer, dmabuf_offset));
	printf("reg_size_field %zu\n", offsetof(struct fgds_ioctl_reg_buffer, size));
	printf("reg_idx %zu\n", offsetof(struct fgds_ioctl_reg_buffer, idx));
	printf("unreg_size %zu\n", sizeof(struct fgds_ioctl_unreg_buffer));
	printf("unreg_idx %zu\n", offsetof(struct fgds_ioctl_unreg_buffer, idx));
	printf("magic %u\n", (unsigned)FGDS_IOCTL_MAGIC);
	printf("reg_ioctl %lu\n", (unsigned long)FGDS_IOCTL_REG_BUFFER);
	printf("unreg_ioctl %lu\n", (unsigned long)FGDS_IOCTL_UNREG_BUFFER);
	printf("io_size %zu\n", sizeof(struct fgds_io));
	printf("io_idx %zu\n", offsetof(struct fgds_io, idx));
	printf("io_offset %zu\n", offsetof(struct fgds_io, offset));
	printf("io_len %zu\n", offsetof(struct fgds_io, len));
	printf("io_file_offset %zu\n", offsetof(struct fgds_io, file_offset));
	printf("io_fd %zu\n", offsetof(struct fgds_io, fd));
	printf("io_flags %zu\n", offsetof(struct fgds_io, flags));
	printf("io_read %lu\n", (unsigned long)FGDS_IOCTL_READ);
	printf("io_write %lu\n", (unsigned long)FGDS_IOCTL_WRITE);
	printf("uring_read %lu\n", (unsigned long)FGDS_URING_CMD_READ);
	printf("uring_write %lu\n", (unsigned long)FGDS_URING_CMD_WRITE);
	printf("check_size %zu\n", sizeof(struct fgds_check_file));
	printf("check_idx %zu\n", offsetof(struct fgds_check_file, idx));
	printf("check_fd %zu\n", offsetof(struct fgds_check_file, fd));
	printf("check_flags %zu\n", offsetof(struct fgds_check_file, flags));
	printf("check_path %zu\n", offsetof(struct fgds_check_file, path));
	printf("check_dma_domain %zu\n", offsetof(struct fgds_check_file, dma_domain));
	printf("check_dma_bdf %zu\n", offsetof(struct fgds_check_file, dma_bdf));
	printf("check_write %u\n", FGDS_CHECK_WRITE);
	printf("check_no_dev %u\n", FGDS_CHECK_NO_DEV);
	printf("check_ioctl %lu\n", (unsigned long)FGDS_IOCTL_CHECK_FILE);
	printf("path_direct %d\n", FGDS_PATH_DIRECT);
	printf("path_not_o_direct %d\n", FGDS_PATH_NOT_O_DIRECT);
	return 0;
}
"#;

fn c_values() -> Vec<(String, u64)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out_dir = root.join("target/uapi-layout");
    std::fs::create_dir_all(&out_dir).unwrap();
    let src = out_dir.join("probe.c");
    let exe = out_dir.join("probe");
    std::fs::write(&src, PROBE).unwrap();
    let status = Command::new("cc")
        .arg("-I")
        .arg(root.join("driver/include/uapi"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .expect("cannot run cc: install gcc to check the UAPI layout");
    assert!(
        status.success(),
        "the probe did not compile against driver/include/uapi/linux/fgds.h"
    );
    let out = Command::new(&exe).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect()
}

#[test]
fn rust_mirror_matches_the_c_header() {
    let rust = [
        ("reg_size", size_of::<RegBuffer>() as u64),
        ("reg_dmabuf_fd", offset_of!(RegBuffer, dmabuf_fd) as u64),
        ("reg_flags", offset_of!(RegBuffer, flags) as u64),
        (
            "reg_dmabuf_offset",
            offset_of!(RegBuffer, dmabuf_offset) as u64,
        ),
        ("reg_size_field", offset_of!(RegBuffer, size) as u64),
        ("reg_idx", offset_of!(RegBuffer, idx) as u64),
        ("unreg_size", size_of::<UnregBuffer>() as u64),
        ("unreg_idx", offset_of!(UnregBuffer, idx) as u64),
        ("magic", u64::from(uapi::MAGIC)),
        ("reg_ioctl", uapi::REG_BUFFER as u64),
        ("unreg_ioctl", uapi::UNREG_BUFFER as u64),
        ("io_size", size_of::<Io>() as u64),
        ("io_idx", offset_of!(Io, idx) as u64),
        ("io_offset", offset_of!(Io, offset) as u64),
        ("io_len", offset_of!(Io, len) as u64),
        ("io_file_offset", offset_of!(Io, file_offset) as u64),
        ("io_fd", offset_of!(Io, fd) as u64),
        ("io_flags", offset_of!(Io, flags) as u64),
        ("io_read", uapi::IOCTL_READ as u64),
        ("io_write", uapi::IOCTL_WRITE as u64),
        ("uring_read", uapi::URING_CMD_READ as u64),
        ("uring_write", uapi::URING_CMD_WRITE as u64),
        ("check_size", size_of::<CheckFile>() as u64),
        ("check_idx", offset_of!(CheckFile, idx) as u64),
        ("check_fd", offset_of!(CheckFile, fd) as u64),
        ("check_flags", offset_of!(CheckFile, flags) as u64),
        ("check_path", offset_of!(CheckFile, path) as u64),
        ("check_dma_domain", offset_of!(CheckFile, dma_domain) as u64),
        ("check_dma_bdf", offset_of!(CheckFile, dma_bdf) as u64),
        ("check_write", u64::from(uapi::CHECK_WRITE)),
        ("check_no_dev", u64::from(uapi::CHECK_NO_DEV)),
        ("check_ioctl", uapi::IOCTL_CHECK_FILE as u64),
        ("path_direct", 0),
        ("path_not_o_direct", 9),
    ];
    let c = c_values();
    assert_eq!(c.len(), rust.len(), "the probe printed {c:?}");
    for ((c_name, c_value), (r_name, r_value)) in c.iter().zip(rust) {
        assert_eq!(c_name, r_name);
        assert_eq!(
            *c_value, r_value,
            "{c_name}: the C header says {c_value}, the crate says {r_value}"
        );
    }
}

/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * fgds: direct I/O between NVMe and GPU memory exported as a dma-buf.
 *
 * Layout-identical to the UAPI of the "[RFC PATCH] misc: fgds" driver: a
 * program written against that header works unchanged.
 *
 * Flow: open("/dev/fgds_DDDD_BB_DD_F", O_RDWR), FGDS_IOCTL_REG_BUFFER with a
 * dma-buf fd exported by the GPU's driver, mmap(NULL, size, PROT_READ |
 * PROT_WRITE, MAP_SHARED, fd, idx), then pread()/pwrite()/io_uring on an
 * O_DIRECT file with the mapped address as the user buffer. The mapping is
 * device memory: the CPU should only use it as a DMA target or source.
 *
 * DOC: revocation contract
 *
 * A registration is revoked when the exporter invalidates the dma-buf
 * (move_notify up to Linux 6.12, invalidate_mappings from 7.x), when the GPU's
 * driver unbinds, or when the GPU is removed. On revocation fgds
 *
 *  - removes every user mapping of the buffer (in every process, including
 *    children after fork); a later CPU access to the mapped range raises
 *    SIGBUS, and a later read()/write()/io_uring request on it fails with
 *    EFAULT (the kernel cannot pin the pages any more); a later
 *    FGDS_IOCTL_READ/WRITE or FGDS_URING_CMD_READ/WRITE of the token fails
 *    with ENODEV;
 *  - if I/O already in flight still references the buffer's pages, adds a
 *    fence to the dma-buf's reservation object that signals once it has
 *    ended: the exporter gets the memory back only then, however long that
 *    takes (no timer ends the wait);
 *  - then unmaps and unpins the dma-buf, as the dma-buf contract requires.
 *
 * GPU memory can never be pinned long-term through fgds (io_uring fixed
 * buffers, IORING_REGISTER_BUFFERS, fail): such a pin would outlive a
 * revocation. FGDS_IOCTL_READ/WRITE and FGDS_URING_CMD_READ/WRITE move data
 * between a file and a registration with no mapping and no pin at all, on
 * every kernel, to block devices and files on ext4 or xfs whose NVMe drive
 * can reach the GPU (EREMOTEIO elsewhere, struct fgds_io).
 *
 * The token stays registered until FGDS_IOCTL_UNREG_BUFFER or close: mmap()
 * of a revoked token fails with ENODEV. Revocation is permanent; register the
 * dma-buf again to get a new token.
 */
#ifndef _UAPI_LINUX_FGDS_H
#define _UAPI_LINUX_FGDS_H

#include <linux/ioctl.h>
#include <linux/types.h>

/**
 * struct fgds_ioctl_reg_buffer - argument of FGDS_IOCTL_REG_BUFFER
 * @dmabuf_fd: in: dma-buf fd exported by the GPU's driver for memory in the
 *	GPU's BAR. The caller may close it once the ioctl returns.
 * @flags: in: reserved, must be 0.
 * @dmabuf_offset: in: offset of the registered range inside the dma-buf,
 *	PAGE_SIZE aligned.
 * @size: in: length of the registered range, PAGE_SIZE aligned, non-zero.
 *	Any larger alignment a GPU runtime needs (e.g. 64 KiB) is the caller's.
 * @idx: out: token to pass as the offset argument of mmap(2).
 *
 * Errors (returned by ioctl(2) in errno):
 *
 * - EFAULT: the argument cannot be read or @idx cannot be written.
 * - EINVAL: @flags is not 0; @dmabuf_fd is negative or not a dma-buf;
 *   @dmabuf_offset or @size is not PAGE_SIZE aligned; @size is 0 or larger
 *   than 8 TiB; @dmabuf_offset + @size is beyond the dma-buf; the
 *   exporter's mapping contains an address outside the GPU's BAR or not page
 *   aligned (a dma-buf of system RAM, such as a udmabuf, always is).
 * - EOVERFLOW: @dmabuf_offset + @size overflows.
 * - EBADF: @dmabuf_fd is not an open file descriptor.
 * - EMFILE: the open file already holds max_buffers_per_file registrations,
 *   or the system half a million.
 * - ENOSPC: the GPU would have more than max_bytes_per_gpu bytes registered,
 *   or the calling user more than max_bytes_per_user on this GPU.
 * - ENOMEM: the registration would take the calling user past its
 *   RLIMIT_MEMLOCK (without CAP_IPC_LOCK; the kernel log says so), or the
 *   kernel is out of memory.
 * - ENODEV: the GPU was removed, or has no driver bound, or is being torn
 *   down.
 * - EOPNOTSUPP: fgds cannot make struct pages for this GPU safely (a kernel
 *   without CONFIG_PCI_P2PDMA and a translating IOMMU, or no P2P path
 *   between the GPU and an NVMe controller; pages=p2pdma without
 *   CONFIG_PCI_P2PDMA); the kernel log says why and what to change.
 * - EBUSY: the BAR's memory type cannot be settled as write-combined or
 *   uncached (see the kernel log).
 * - EINTR or ERESTARTSYS semantics: a signal arrived while waiting for the
 *   dma-buf's reservation lock or fences; the call can be repeated.
 * - Any error the exporter returns from attach, pin or map (for example
 *   EOPNOTSUPP when it refuses peer-to-peer importers).
 */
struct fgds_ioctl_reg_buffer {
	__s32 dmabuf_fd;
	__u32 flags;
	__u64 dmabuf_offset;
	__u64 size;
	__u64 idx;
};

/**
 * struct fgds_ioctl_unreg_buffer - argument of FGDS_IOCTL_UNREG_BUFFER
 * @idx: in: token returned by FGDS_IOCTL_REG_BUFFER on the same open file.
 *
 * Removes the token. Mappings made from it stay valid until munmap(2); the
 * buffer is released with the last of them.
 *
 * Errors:
 *
 * - EFAULT: the argument cannot be read.
 * - EINVAL: @idx is not PAGE_SIZE aligned.
 * - ENOENT: no registration with this token on this open file.
 */
struct fgds_ioctl_unreg_buffer {
	__u64 idx;
};

#define FGDS_IOCTL_MAGIC	0x88
#define FGDS_IOCTL_REG_BUFFER	_IOWR(FGDS_IOCTL_MAGIC, 0x01, struct fgds_ioctl_reg_buffer)
#define FGDS_IOCTL_UNREG_BUFFER	_IOW(FGDS_IOCTL_MAGIC, 0x02, struct fgds_ioctl_unreg_buffer)

/*
 * 0x10 and 0x11 were FGDS_URING_CMD_REGISTER and FGDS_URING_CMD_UNREGISTER,
 * which put a registration into an io_uring fixed-buffer slot on kernels
 * with a change fgds carried (never upstream). Removed: any read or write of
 * the ring, on any file, could use such a slot, and so hold a revocation.
 * The numbers stay unused.
 */

/**
 * struct fgds_io - the argument of FGDS_IOCTL_READ and FGDS_IOCTL_WRITE, and
 *	the command of FGDS_URING_CMD_READ and FGDS_URING_CMD_WRITE
 * @idx: in: a token of the open file the call is made on
 * @offset: in: byte offset into the registration
 * @len: in: bytes to move, 1 to 0x7ffff000 (the kernel's MAX_RW_COUNT on
 *	4 KiB pages), within the registration
 * @file_offset: in: byte offset in the file
 * @fd: in: the file, opened with O_DIRECT: readable for READ (file to
 *	registration), writable for WRITE (registration to file)
 * @flags: in: reserved, must be 0
 *
 * fgds moves the data itself, as pread()/pwrite() of @fd would with the
 * registration's memory as the buffer, but with neither a mapping nor a pin:
 * it hands the file an iterator over the registration's pages. A revocation
 * waits for every such call in flight (its fence signals after the last one
 * returned); calls made after it fail with ENODEV. A registration of a
 * dma-buf opened read-only can only be written from.
 *
 * FGDS_IOCTL_READ and FGDS_IOCTL_WRITE return the bytes moved, fewer than
 * @len only at the end of the file (as pread() and pwrite()).
 * FGDS_URING_CMD_READ and FGDS_URING_CMD_WRITE are io_uring commands
 * (IORING_OP_URING_CMD on a ring set up with IORING_SETUP_SQE128, sqe->fd a
 * node's open file, sqe->cmd_op, this structure in sqe->cmd); the CQE's res
 * is the same count or a negative errno. Their I/O completes asynchronously,
 * as a read into RAM does, so that a ring keeps many in flight.
 *
 * Errors (errno, or the CQE's res):
 *
 * - EINVAL: @flags is not 0; @idx is not PAGE_SIZE aligned; @len is 0 or
 *   too large; the range is past the registration's end; @fd was not opened
 *   with O_DIRECT, or the file cannot do this I/O (no read or write method,
 *   offsets or length not aligned as its O_DIRECT requires); the ring's
 *   entries are 64 bytes (io_uring commands).
 * - ENOENT: no registration with token @idx on this open file.
 * - EBADF: @fd is not an open file, or not open for reading (READ) or
 *   writing (WRITE).
 * - EACCES: READ into a registration of a dma-buf opened read-only.
 * - ENODEV: the registration was revoked.
 * - EREMOTEIO: the GPU's memory may not go to this file by peer-to-peer
 *   DMA: it is not a block device nor a file on ext4 or xfs (a pipe, a
 *   socket, tmpfs, FUSE, NFS, ...), or its file's data goes through the CPU
 *   (DAX, encryption, verity), or its block device's queue takes no P2PDMA
 *   pages (loop, brd, zram, dm, md, ...), is on no PCI device, is not
 *   reachable from the GPU, or, with P2PDMA pages, may merge requests (set
 *   its queue's nomerges to 2). Nothing was moved; the kernel log says which.
 *   Read through the mapping or RAM instead.
 * - EOPNOTSUPP: (io_uring commands) this kernel's io_uring cannot post the
 *   commands' byte counts (Linux 6.1); use FGDS_IOCTL_READ/WRITE.
 * - ENOMEM: out of memory.
 * - anything the file's own read or write returns (EIO, ENOSPC, ...).
 */
struct fgds_io {
	__u64 idx;
	__u64 offset;
	__u64 len;
	__u64 file_offset;
	__s32 fd;
	__u32 flags;
};

#define FGDS_IOCTL_READ		_IOW(FGDS_IOCTL_MAGIC, 0x03, struct fgds_io)
#define FGDS_IOCTL_WRITE	_IOW(FGDS_IOCTL_MAGIC, 0x04, struct fgds_io)
#define FGDS_URING_CMD_READ	_IOW(FGDS_IOCTL_MAGIC, 0x12, struct fgds_io)
#define FGDS_URING_CMD_WRITE	_IOW(FGDS_IOCTL_MAGIC, 0x13, struct fgds_io)

/**
 * enum fgds_path - where FGDS_IOCTL_CHECK_FILE finds a file's I/O would go
 * @FGDS_PATH_DIRECT: fgds's reads and writes take the file: peer-to-peer
 *	DMA between its drive and the GPU
 * @FGDS_PATH_FILE_TYPE: neither a block device nor a regular file (a pipe,
 *	a socket, a character device, ...)
 * @FGDS_PATH_NO_OFFSET: the file cannot be read (or written) at an offset
 * @FGDS_PATH_FS: a file of a file system whose direct I/O is not the block
 *	layer's DMA to its own device (tmpfs, btrfs, NFS, FUSE, ...)
 * @FGDS_PATH_CPU_COPY: a DAX, encrypted or verity file: the CPU copies its
 *	data
 * @FGDS_PATH_QUEUE: the block device's queue takes no P2PDMA pages (loop,
 *	brd, zram, dm, NVMe over TCP or RDMA, ...)
 * @FGDS_PATH_NO_PCI: the disk hangs from no PCI device, which fgds could
 *	check (md, NVMe multipath heads)
 * @FGDS_PATH_NO_P2P: the PCI device doing the disk's DMA cannot reach the
 *	GPU's memory
 * @FGDS_PATH_MERGES: the GPU's pages are P2PDMA pages and the queue may
 *	merge requests: set its nomerges to 2
 * @FGDS_PATH_NOT_O_DIRECT: fgds would take the file, but it is not open
 *	with O_DIRECT
 *
 * Every value but FGDS_PATH_DIRECT is a reason FGDS_IOCTL_READ/WRITE and
 * FGDS_URING_CMD_READ/WRITE refuse the file (EREMOTEIO; EINVAL for the last).
 */
enum fgds_path {
	FGDS_PATH_DIRECT = 0,
	FGDS_PATH_FILE_TYPE = 1,
	FGDS_PATH_NO_OFFSET = 2,
	FGDS_PATH_FS = 3,
	FGDS_PATH_CPU_COPY = 4,
	FGDS_PATH_QUEUE = 5,
	FGDS_PATH_NO_PCI = 6,
	FGDS_PATH_NO_P2P = 7,
	FGDS_PATH_MERGES = 8,
	FGDS_PATH_NOT_O_DIRECT = 9,
};

/* struct fgds_check_file @flags: the registration would be written to the file. */
#define FGDS_CHECK_WRITE	0x1U
/* struct fgds_check_file @dma_bdf when fgds found no device doing the DMA. */
#define FGDS_CHECK_NO_DEV	0xffffffffU

/**
 * struct fgds_check_file - the argument of FGDS_IOCTL_CHECK_FILE
 * @idx: in: a token of the open file the call is made on
 * @fd: in: the file
 * @flags: in: 0 (read into the registration) or FGDS_CHECK_WRITE
 * @path: out: enum fgds_path
 * @dma_domain: out: the PCI domain of the device that does, or would do,
 *	the file's DMA
 * @dma_bdf: out: its bus << 8 | devfn, FGDS_CHECK_NO_DEV where fgds found
 *	none (the file has no disk, or the disk no PCI device)
 * @reserved: out: 0
 *
 * Tells, without moving data and without a log line, whether
 * FGDS_IOCTL_READ/WRITE of @idx with @fd would take the file, and if not
 * why: what `fgds doctor FILE` and the user-space libraries report when
 * they fall back to RAM. The answer is the one fgds's reads and writes get
 * at the time of the call.
 *
 * Errors: EINVAL: unknown @flags; ENOENT: no registration @idx; EBADF: @fd
 * is not an open file; ENODEV: the registration was revoked.
 */
struct fgds_check_file {
	__u64 idx;
	__s32 fd;
	__u32 flags;
	__u32 path;
	__u32 dma_domain;
	__u32 dma_bdf;
	__u32 reserved;
};

#define FGDS_IOCTL_CHECK_FILE	_IOWR(FGDS_IOCTL_MAGIC, 0x05, struct fgds_check_file)

/*
 * mmap(2) of a token: offset = idx, length = the registered size exactly,
 * MAP_SHARED only, PROT_READ and/or PROT_WRITE. The CPU mapping is
 * write-combined. Errors:
 *
 * - EINVAL: not MAP_SHARED, or the length differs from the registered size.
 * - EACCES: PROT_WRITE, and the dma-buf was opened read-only (such a
 *   mapping can never become writable, and reads from a drive into it fail
 *   with EFAULT).
 * - ENOENT: the offset is not a token of this open file.
 * - ENODEV: the registration was revoked, or the GPU was removed.
 *
 * Other ioctl numbers fail with ENOTTY.
 */

#endif /* _UAPI_LINUX_FGDS_H */

/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * The UAPI of the "[RFC PATCH] misc: fgds" driver, as the RFC defines it (layout and ioctl
 * numbers only). The client in ../rfc_client.c is written against this header alone, to prove
 * that a program written for the RFC works unchanged with this tree's driver.
 */
#ifndef _RFC_FGDS_H
#define _RFC_FGDS_H

#include <linux/ioctl.h>
#include <linux/types.h>

struct fgds_ioctl_reg_buffer {
	__s32 dmabuf_fd;	/* in: fd exported by the GPU runtime */
	__u32 flags;		/* in: reserved, must be 0 */
	__u64 dmabuf_offset;	/* in: PAGE_SIZE aligned */
	__u64 size;		/* in: PAGE_SIZE aligned, non-zero */
	__u64 idx;		/* out: token to pass as mmap(2) offset */
};

struct fgds_ioctl_unreg_buffer {
	__u64 idx;
};

#define FGDS_IOCTL_MAGIC	0x88
#define FGDS_IOCTL_REG_BUFFER	_IOWR(FGDS_IOCTL_MAGIC, 0x01, struct fgds_ioctl_reg_buffer)
#define FGDS_IOCTL_UNREG_BUFFER	_IOW(FGDS_IOCTL_MAGIC, 0x02, struct fgds_ioctl_unreg_buffer)

#endif

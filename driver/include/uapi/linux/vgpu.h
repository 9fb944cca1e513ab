/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * vgpu: the fgds test rig's fake GPU.
 *
 * vgpu binds QEMU's ivshmem-plain device (PCI 1af4:1110) and treats its
 * BAR2 as GPU "VRAM". Userspace asks /dev/vgpuN for a buffer, gets it back
 * as a dma-buf file descriptor, and hands that to an importer such as fgds.
 */
#ifndef _UAPI_LINUX_VGPU_H
#define _UAPI_LINUX_VGPU_H

#include <linux/const.h>
#include <linux/ioctl.h>
#include <linux/types.h>

/**
 * DOC: vgpu interface
 *
 * Character device: one ``/dev/vgpuN`` per bound device. Its only operation
 * is &VGPU_IOCTL_ALLOC. Class device: ``/sys/class/vgpu/vgpuN``, whose
 * ``device`` link points at the PCI device.
 *
 * The dma-buf file descriptor returned by &VGPU_IOCTL_ALLOC:
 *
 * - can be attached only by importers that set
 *   &dma_buf_attach_ops.allow_peer2peer and can be told to drop their
 *   mappings (dynamic importers); others get ``EOPNOTSUPP``. The memory is
 *   PCI BAR memory and the scatterlists vgpu hands out carry DMA addresses
 *   only, never pages;
 * - can be mapped with ``mmap(MAP_SHARED)`` (offset and length within the
 *   buffer, in pages). The mapping is write-combined device memory.
 *   ``MAP_PRIVATE`` fails with ``EINVAL``, a range outside the buffer with
 *   ``EINVAL``, a revoked buffer with ``ENODEV``;
 * - is freed, and its BAR2 range returned to vgpu, when the last reference
 *   to it goes (every fd closed, every mapping and importer gone).
 *
 * sysfs attributes of ``/sys/class/vgpu/vgpuN``:
 *
 * ``mode`` (read-only)
 *	``plain`` (BAR2 has no struct pages, like real VRAM) or ``p2pdma``
 *	(vgpu registered BAR2 as PCI P2PDMA memory and allocates buffers from
 *	that pool, so their pages are P2PDMA pages owned by vgpu).
 *
 * ``buffers`` (read-only)
 *	One line per live buffer, four decimal fields separated by one space:
 *	``bar_offset size pins revoked``. ``pins`` counts importer pins,
 *	``revoked`` is 0 or 1. At most one page of text: if more buffers exist
 *	than fit, the last line is ``...``.
 *
 * ``revoke`` (write-only, root)
 *	Write a buffer's ``bar_offset`` (decimal, or hex with ``0x``) to take
 *	the buffer away, as a GPU driver does when it evicts or loses VRAM:
 *	every CPU mapping is zapped so that later accesses raise ``SIGBUS``,
 *	importers are told to drop their mappings (``move_notify`` or
 *	``invalidate_mappings``), new mappings and mmaps fail with ``ENODEV``.
 *	Then, holding the reservation lock as vfio-pci does, vgpu waits for
 *	every fence in the buffer's reservation object, with no time limit: an
 *	importer whose DMA into the buffer is still in flight adds one and
 *	signals it once that DMA is done. The write returns once the fences
 *	signalled and every importer has unmapped the buffer. It fails with
 *	``ENOENT`` if no live buffer starts at that offset, with ``EINVAL`` if
 *	the text is not a number and with ``ETIMEDOUT`` if importers still map
 *	the buffer ``revoke_timeout_ms`` (a module parameter) after their
 *	fences signalled (the buffer stays revoked). Revoking twice is not an
 *	error.
 *
 * ``last_revoke`` (read-only)
 *	Three decimal fields about the latest revocation: the buffer's
 *	``bar_offset``, how long the importers' invalidation callbacks took and
 *	how long the wait for their fences took, both in nanoseconds.
 *
 * ``fill`` (write-only, root)
 *	Write ``<offset> <length> <seed>`` (decimal, 8-byte aligned, inside
 *	BAR2) to fill that range of BAR2 with the test rig's data pattern of
 *	that seed (``tests/src/pattern.rs``, the pattern stream starting at the
 *	range), as the GPU does when memory goes to its next user.
 *
 * When the PCI device goes away (unbind, hot-unplug), every buffer is revoked
 * as above and the removal waits until importers have unmapped them (in
 * ``p2pdma`` mode also until no page of theirs is referenced any more).
 * Their dma-bufs stay valid but empty until closed, and &VGPU_IOCTL_ALLOC
 * on a still open ``/dev/vgpuN`` fails with ``ENODEV``.
 */

/**
 * struct vgpu_alloc - argument of &VGPU_IOCTL_ALLOC
 * @size: in: size of the buffer in bytes, a non-zero multiple of the page
 *	size and at most the size of BAR2.
 * @flags: in: 0, or a combination of &VGPU_ALLOC_RDONLY and
 *	&VGPU_ALLOC_SKEW.
 * @fd: out: the new dma-buf file descriptor, opened ``O_RDWR | O_CLOEXEC``.
 *	Ignored on input.
 * @bar_offset: out: offset of the buffer in BAR2, a multiple of the page
 *	size. The buffer occupies the contiguous range
 *	[@bar_offset, @bar_offset + @size) of BAR2 (with &VGPU_ALLOC_SKEW, see
 *	there). Ignored on input.
 */
struct vgpu_alloc {
	__u64 size;
	__u32 flags;
	__s32 fd;
	__u64 bar_offset;
};

/**
 * define VGPU_IOCTL_ALLOC - allocate a buffer in BAR2 and export it as a dma-buf
 *
 * Takes a &struct vgpu_alloc. Each call hands out a fresh contiguous range
 * of BAR2 that no other live buffer overlaps; its contents are whatever the
 * range held before (vgpu does not clear it). The range returns to vgpu
 * when the dma-buf is released.
 *
 * Return: 0 on success, -1 with errno set on failure:
 *
 * - ``EFAULT``: the argument is not readable or not writable.
 * - ``EINVAL``: @flags has an unknown bit, @size is 0, not a multiple of the
 *   page size, or larger than BAR2; &VGPU_ALLOC_SKEW in ``p2pdma`` mode or
 *   with a size it does not allow.
 * - ``ENOMEM``: BAR2 has no free contiguous range of @size bytes (free or
 *   revoke and close other buffers first), or the kernel is out of memory.
 * - ``ENODEV``: the PCI device was removed while ``/dev/vgpuN`` stayed open.
 * - ``EMFILE``: the process has no free file descriptor.
 * - ``ENFILE``: the system is out of files.
 * - ``ENOTTY``: not a vgpu ioctl.
 */
#define VGPU_IOCTL_ALLOC _IOWR('V', 0x01, struct vgpu_alloc)

/**
 * define VGPU_ALLOC_RDONLY - export the buffer read-only
 *
 * The dma-buf file is opened ``O_RDONLY``: importers must not write to it,
 * and its own mmap cannot be writable.
 */
#define VGPU_ALLOC_RDONLY	_BITUL(0)

/**
 * define VGPU_ALLOC_SKEW - a buffer of two runs at different 2 MiB phases
 *
 * For importers' tests of buffers that are not one run of BAR2 (``mode``
 * ``plain`` only; @size at least 4 MiB, a multiple of 2 MiB). vgpu takes
 * the range [@bar_offset, @bar_offset + @size + 2 MiB), @bar_offset 2 MiB
 * aligned; the buffer's first 2 MiB are BAR2 [@bar_offset + 4 KiB,
 * @bar_offset + 4 KiB + 2 MiB), the rest is BAR2 [@bar_offset + 4 MiB,
 * @bar_offset + 2 MiB + @size). The DMA addresses and the CPU mapping
 * follow that layout.
 */
#define VGPU_ALLOC_SKEW		_BITUL(1)

#endif /* _UAPI_LINUX_VGPU_H */

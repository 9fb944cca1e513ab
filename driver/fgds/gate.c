// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: where fgds's own reads and writes may take a registration's pages.
 *
 * FGDS_IOCTL_READ/WRITE and FGDS_URING_CMD_READ/WRITE hand a file a bvec
 * iterator over GPU pages (rw.c). The block layer takes a bvec iterator as it
 * is (bio_iov_bvec_set()): none of the checks that keep user pages with
 * FOLL_PCI_P2PDMA away from devices that cannot reach them apply, and the
 * revocation fence waits for the call's I/O however long the file takes. So
 * fgds admits a file only where both hold by construction:
 *
 *  - the file is a block device, or a regular file of a file system that
 *    does its direct I/O to its own block device (ext4, xfs), not DAX,
 *    encrypted or verity (those copy with the CPU); pipes, sockets, FUSE,
 *    NFS, tmpfs and the rest are refused, since their I/O completes when
 *    some process or server decides;
 *  - that block device's queue takes P2PDMA pages (blk_queue_pci_p2pdma(),
 *    the flag bio_iov_iter_get_pages() asks before it lets GUP return such
 *    pages), so loop, brd, zram, dm-crypt and the like are refused;
 *  - the disk sits on a PCI device, which does the DMA, and that device
 *    reaches the GPU: pci_p2pdma_distance() for P2PDMA pages, fgds's own
 *    rules for GENERIC pages (fgds_gpu_dma_dev_check()). A disk without one
 *    (md, dm, NVMe multipath heads, fabrics) is refused: fgds cannot name
 *    the devices that would do the DMA, nor bound how long its I/O waits
 *    for a path;
 *  - P2PDMA pages never share a request with RAM: kernels that map a
 *    request by its first segment (blk_rq_dma_map_iter_start(), 6.17 on)
 *    would map RAM as bus addresses or BAR pages through the IOMMU as RAM.
 *    User pages get REQ_NOMERGE from bio_iov_iter_get_pages(); a bvec bio
 *    does not, so fgds requires the queue not to merge at all (nomerges=2:
 *    QUEUE_FLAG_NOMERGES, which every merge path tests), on every kernel.
 *    GENERIC pages are RAM to the DMA layer: they may merge.
 *
 * What is admitted then completes within the block layer's own bound for
 * the device: its I/O timeout, retries and controller reset
 * (docs/driver.md, Revocation). Every refusal is -EREMOTEIO with one log
 * line that names the file's type or the queue, and what to do.
 */

#include <linux/blkdev.h>
#include <linux/fs.h>
#include <linux/pci.h>
#include <linux/string.h>

#include "fgds_compat.h"
#include "fgds_drv.h"

/* File systems whose O_DIRECT I/O goes to sb->s_bdev as bios of the caller's pages. */
static const char * const fgds_block_fs[] = { "ext4", "xfs" };

static const char *fgds_file_type(umode_t mode)
{
	switch (mode & S_IFMT) {
	case S_IFIFO:
		return "a pipe";
	case S_IFSOCK:
		return "a socket";
	case S_IFCHR:
		return "a character device";
	case S_IFDIR:
		return "a directory";
	case S_IFLNK:
		return "a symbolic link";
	default:
		return "a special file";
	}
}

static bool fgds_fs_is_block(struct super_block *sb)
{
	unsigned int i;

	if (!sb->s_bdev || !(sb->s_type->fs_flags & FS_REQUIRES_DEV))
		return false;
	for (i = 0; i < ARRAY_SIZE(fgds_block_fs); i++)
		if (!strcmp(sb->s_type->name, fgds_block_fs[i]))
			return true;
	return false;
}

/* The PCI device a disk hangs from, which does its DMA; NULL if none. */
static struct pci_dev *fgds_disk_pci_dev(struct gendisk *disk)
{
	struct device *dev;

	for (dev = disk_to_dev(disk)->parent; dev; dev = dev->parent)
		if (dev_is_pci(dev))
			return to_pci_dev(dev);
	return NULL;
}

#define fgds_refuse(gpu, fd, fmt, ...)					\
	dev_info_ratelimited(&(gpu)->dev, "%s: fd %d: " fmt "\n",	\
			     current->comm, fd, ##__VA_ARGS__)

static int fgds_gate_bdev(struct fgds_gpu *gpu, int fd,
			  struct block_device *bdev, struct pci_dev **dma_dev)
{
	struct request_queue *q = bdev_get_queue(bdev);
	u64 seq = bdev->bd_disk->diskseq;
	struct pci_dev *pdev;
	const char *why;

	if (!blk_queue_pci_p2pdma(q)) {
		fgds_refuse(gpu, fd,
			    "the queue of %pg does not take P2PDMA pages: fgds's reads and writes go only to NVMe drives that can DMA to the GPU; read this file into RAM instead",
			    bdev);
		return -EREMOTEIO;
	}
	pdev = fgds_disk_pci_dev(bdev->bd_disk);
	if (!pdev) {
		fgds_refuse(gpu, fd,
			    "%pg is not on a PCI device (md, dm, NVMe multipath or fabrics): fgds cannot tell which device does its DMA; read its members directly or go through RAM",
			    bdev);
		return -EREMOTEIO;
	}
	*dma_dev = pdev;
	/*
	 * The disk's DMA device and its reach stay what they are for the
	 * disk's life; its diskseq is never given to another disk.
	 */
	if (READ_ONCE(gpu->gate_diskseq) == seq)
		goto merges;
	why = fgds_gpu_dma_dev_check(gpu, pdev);
	if (why) {
		fgds_refuse(gpu, fd,
			    "%pg: %s %s; put the drive and the GPU behind one PCIe switch (docs/driver.md, The gate)",
			    bdev, why, pci_name(pdev));
		return -EREMOTEIO;
	}
	WRITE_ONCE(gpu->gate_diskseq, seq);
merges:
	if (READ_ONCE(gpu->mode) != FGDS_MODE_GENERIC && !blk_queue_nomerges(q)) {
		fgds_refuse(gpu, fd,
			    "requests of %pg may merge, and P2PDMA pages must not share a request with RAM; echo 2 > /sys/block/%s/queue/nomerges",
			    bdev, bdev->bd_disk->disk_name);
		return -EREMOTEIO;
	}
	return 0;
}

/**
 * fgds_io_gate() - may fgds hand a registration's pages to a file's I/O?
 * @gpu: the registration's GPU, its provider set up (@users held)
 * @file: the file, open with O_DIRECT
 * @fd: its descriptor, for the log
 * @write: the registration is written to the file (else read into)
 * @dma_dev: set to the PCI device that does the file's DMA (the file, open,
 *	keeps its disk and so that device)
 *
 * The rules of the top of this file.
 *
 * Return: 0, or -EREMOTEIO (logged, ratelimited).
 */
int fgds_io_gate(struct fgds_gpu *gpu, struct file *file, int fd, bool write,
		 struct pci_dev **dma_dev)
{
	struct inode *inode = file_inode(file);
	struct super_block *sb = inode->i_sb;

	if (!S_ISBLK(inode->i_mode) && !S_ISREG(inode->i_mode)) {
		fgds_refuse(gpu, fd,
			    "%s: fgds's reads and writes take block devices and files on ext4 or xfs only",
			    fgds_file_type(inode->i_mode));
		return -EREMOTEIO;
	}
	if (!(file->f_mode & (write ? FMODE_PWRITE : FMODE_PREAD))) {
		fgds_refuse(gpu, fd, "the file cannot be %s at an offset",
			    write ? "written" : "read");
		return -EREMOTEIO;
	}
	if (S_ISBLK(inode->i_mode))
		return fgds_gate_bdev(gpu, fd, I_BDEV(file->f_mapping->host),
				      dma_dev);
	if (!fgds_fs_is_block(sb)) {
		fgds_refuse(gpu, fd,
			    "a file on %s: its direct I/O is not the block layer's DMA (fgds takes files on ext4 or xfs); go through RAM",
			    sb->s_type->name);
		return -EREMOTEIO;
	}
	if (IS_DAX(inode) || IS_ENCRYPTED(inode) || IS_VERITY(inode)) {
		fgds_refuse(gpu, fd,
			    "a %s file on %s: its data goes through the CPU; go through RAM",
			    IS_DAX(inode) ? "DAX" :
			    IS_ENCRYPTED(inode) ? "encrypted" : "verity", sb->s_id);
		return -EREMOTEIO;
	}
	return fgds_gate_bdev(gpu, fd, sb->s_bdev, dma_dev);
}

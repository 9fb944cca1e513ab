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
 *    (md, NVMe multipath heads) is refused: fgds cannot name the devices
 *    that would do the DMA, nor bound how long its I/O waits for a path;
 *    userspace may still use the mapped address where each member passes
 *    this gate (FGDS_IOCTL_CHECK_FILE on the member);
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
#include <linux/file.h>
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

/* What fgds_gate_file() found out about a file. */
struct fgds_gate {
	enum fgds_path path;
	/* The file's disk, where it has one. */
	struct block_device *bdev;
	/* The PCI device that does the disk's DMA, where found. */
	struct pci_dev *dma_dev;
	/* FGDS_PATH_NO_P2P: fgds_gpu_dma_dev_check()'s phrase. */
	const char *why;
};

static void fgds_gate_bdev(struct fgds_gpu *gpu, struct block_device *bdev,
			   struct fgds_gate *g)
{
	struct request_queue *q = bdev_get_queue(bdev);
	u64 seq = bdev->bd_disk->diskseq;

	g->bdev = bdev;
	if (!blk_queue_pci_p2pdma(q)) {
		g->path = FGDS_PATH_QUEUE;
		return;
	}
	g->dma_dev = fgds_disk_pci_dev(bdev->bd_disk);
	if (!g->dma_dev) {
		g->path = FGDS_PATH_NO_PCI;
		return;
	}
	/*
	 * The disk's DMA device and its reach stay what they are for the
	 * disk's life; its diskseq is never given to another disk.
	 */
	if (READ_ONCE(gpu->gate_diskseq) != seq) {
		g->why = fgds_gpu_dma_dev_check(gpu, g->dma_dev);
		if (g->why) {
			g->path = FGDS_PATH_NO_P2P;
			return;
		}
		WRITE_ONCE(gpu->gate_diskseq, seq);
	}
	if (READ_ONCE(gpu->mode) != FGDS_MODE_GENERIC && !blk_queue_nomerges(q)) {
		g->path = FGDS_PATH_MERGES;
		return;
	}
	g->path = FGDS_PATH_DIRECT;
}

/* The rules of the top of this file, as a verdict in @g. */
static void fgds_gate_file(struct fgds_gpu *gpu, struct file *file,
			   bool write, struct fgds_gate *g)
{
	struct inode *inode = file_inode(file);
	struct super_block *sb = inode->i_sb;

	*g = (struct fgds_gate){};
	if (!S_ISBLK(inode->i_mode) && !S_ISREG(inode->i_mode))
		g->path = FGDS_PATH_FILE_TYPE;
	else if (!(file->f_mode & (write ? FMODE_PWRITE : FMODE_PREAD)))
		g->path = FGDS_PATH_NO_OFFSET;
	else if (S_ISBLK(inode->i_mode))
		fgds_gate_bdev(gpu, I_BDEV(file->f_mapping->host), g);
	else if (!fgds_fs_is_block(sb))
		g->path = FGDS_PATH_FS;
	else if (IS_DAX(inode) || IS_ENCRYPTED(inode) || IS_VERITY(inode))
		g->path = FGDS_PATH_CPU_COPY;
	else
		fgds_gate_bdev(gpu, sb->s_bdev, g);
}

#define fgds_refuse(gpu, fd, fmt, ...)					\
	dev_info_ratelimited(&(gpu)->dev, "%s: fd %d: " fmt "\n",	\
			     current->comm, fd, ##__VA_ARGS__)

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
	struct fgds_gate g;

	fgds_gate_file(gpu, file, write, &g);
	switch (g.path) {
	case FGDS_PATH_DIRECT:
		*dma_dev = g.dma_dev;
		return 0;
	case FGDS_PATH_FILE_TYPE:
		fgds_refuse(gpu, fd,
			    "%s: fgds's reads and writes take block devices and files on ext4 or xfs only",
			    fgds_file_type(inode->i_mode));
		break;
	case FGDS_PATH_NO_OFFSET:
		fgds_refuse(gpu, fd, "the file cannot be %s at an offset",
			    write ? "written" : "read");
		break;
	case FGDS_PATH_FS:
		fgds_refuse(gpu, fd,
			    "a file on %s: its direct I/O is not the block layer's DMA (fgds takes files on ext4 or xfs); go through RAM",
			    inode->i_sb->s_type->name);
		break;
	case FGDS_PATH_CPU_COPY:
		fgds_refuse(gpu, fd,
			    "a %s file on %s: its data goes through the CPU; go through RAM",
			    IS_DAX(inode) ? "DAX" :
			    IS_ENCRYPTED(inode) ? "encrypted" : "verity",
			    inode->i_sb->s_id);
		break;
	case FGDS_PATH_QUEUE:
		fgds_refuse(gpu, fd,
			    "the queue of %pg does not take P2PDMA pages: fgds's reads and writes go only to NVMe drives that can DMA to the GPU; read this file into RAM instead",
			    g.bdev);
		break;
	case FGDS_PATH_NO_PCI:
		fgds_refuse(gpu, fd,
			    "%pg is not on a PCI device (md, NVMe multipath): fgds cannot tell which device does its DMA; read through the registration's mapping where each member passes (fgds doctor FILE), or through RAM",
			    g.bdev);
		break;
	case FGDS_PATH_NO_P2P:
		fgds_refuse(gpu, fd,
			    "%pg: %s %s; put the drive and the GPU behind one PCIe switch (docs/driver.md, The gate)",
			    g.bdev, g.why, pci_name(g.dma_dev));
		break;
	case FGDS_PATH_MERGES:
		fgds_refuse(gpu, fd,
			    "requests of %pg may merge, and P2PDMA pages must not share a request with RAM; echo 2 > /sys/block/%s/queue/nomerges",
			    g.bdev, g.bdev->bd_disk->disk_name);
		break;
	default:
		WARN_ON_ONCE(1);
		break;
	}
	return -EREMOTEIO;
}

/**
 * fgds_ioctl_check_file() - FGDS_IOCTL_CHECK_FILE
 * @f: the node's open file
 * @uarg: the user's struct fgds_check_file
 *
 * The verdict of fgds_io_gate() on a file, without moving data or logging.
 *
 * Return: 0, or a negative errno.
 */
long fgds_ioctl_check_file(struct fgds_file *f, void __user *uarg)
{
	struct fgds_check_file arg;
	struct fgds_gate g;
	struct fgds_buf *buf;
	struct file *file;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags & ~FGDS_CHECK_WRITE || (arg.idx & ~PAGE_MASK))
		return -EINVAL;
	buf = fgds_file_buf_get(f, arg.idx >> PAGE_SHIFT);
	if (!buf)
		return -ENOENT;
	ret = -EBADF;
	file = fget(arg.fd);
	if (!file)
		goto put_buf;
	/* @users held: the provider, whose mode the gate reads, stays. */
	ret = fgds_buf_users_get(buf);
	if (ret)
		goto put_file;
	fgds_gate_file(buf->gpu, file, arg.flags & FGDS_CHECK_WRITE, &g);
	fgds_buf_users_put(buf);
	if (g.path == FGDS_PATH_DIRECT && !(file->f_flags & O_DIRECT))
		g.path = FGDS_PATH_NOT_O_DIRECT;
	arg.path = g.path;
	arg.dma_domain = g.dma_dev ? pci_domain_nr(g.dma_dev->bus) : 0;
	arg.dma_bdf = g.dma_dev ? PCI_DEVID(g.dma_dev->bus->number,
					   g.dma_dev->devfn) :
				  FGDS_CHECK_NO_DEV;
	arg.reserved = 0;
	ret = copy_to_user(uarg, &arg, sizeof(arg)) ? -EFAULT : 0;
put_file:
	fput(file);
put_buf:
	fgds_buf_put(buf);
	return ret;
}

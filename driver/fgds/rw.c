// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: file I/O between a file and a registration, done by fgds.
 *
 * O_DIRECT I/O into a mapped registration pins its pages per request: GUP
 * walks the mapping one PTE at a time (P2PDMA pages are order 0), and the
 * pages are unpinned at completion. FGDS_IOCTL_READ/WRITE and
 * FGDS_URING_CMD_READ/WRITE name the registration and the file instead, and
 * fgds hands the file's ->read_iter()/->write_iter() a bvec iterator over the
 * registration's pages, one segment per run that is contiguous in the BAR,
 * as the loop driver does with its backing file: nothing is pinned, no page
 * reference is taken, and no mapping is needed.
 *
 * What keeps that safe is the registration's @users: each call takes a live
 * reference before it looks at the pages and drops it once its I/O has
 * ended: when the file's method returned for the ioctls (a synchronous
 * kiocb), in the task work that follows ->ki_complete() for the io_uring
 * commands (uring.c). A
 * revocation kills @users under buf->lock as it sets @revoked, and the pages
 * count as quiet only once @users reached zero (@users_done), so the
 * revocation fence signals after the last call in flight returned, however
 * long that takes, and the dma-buf is given back only then.
 *
 * Before a call's first I/O through a device, the dma-buf is attached as that
 * device (fgds_buf_dma_attach()): the device that does the DMA is the
 * importer, and the exporter judges its path.
 *
 * @users is only switched on (@in_use) the first time a call uses the
 * registration, so that revoking one never used that way needs no RCU
 * grace period before its pages count as quiet.
 */

#include <linux/bvec.h>
#include <linux/dma-buf.h>
#include <linux/dma-fence.h>
#include <linux/dma-resv.h>
#include <linux/err.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/percpu-refcount.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/uio.h>

#include <uapi/linux/fgds.h>

#include "fgds_compat.h"
#include "fgds_drv.h"

static void fgds_users_release(struct percpu_ref *ref)
{
	struct fgds_buf *buf = container_of(ref, struct fgds_buf, users);

	/* Last: from here on the registration may be cleaned up and freed. */
	smp_store_release(&buf->users_done, true);
}

/**
 * fgds_buf_users_init() - set up a new registration's @users
 * @buf: the registration
 *
 * Return: 0 or -ENOMEM.
 */
int fgds_buf_users_init(struct fgds_buf *buf)
{
	return percpu_ref_init(&buf->users, fgds_users_release, 0, GFP_KERNEL);
}

/**
 * fgds_buf_users_exit() - free a registration's @users
 * @buf: the registration, quiet (fgds_buf_users_quiet())
 */
void fgds_buf_users_exit(struct fgds_buf *buf)
{
	percpu_ref_exit(&buf->users);
}

/**
 * fgds_buf_users_get() - take a live reference of a registration's @users
 * @buf: the registration (reference held)
 *
 * Return: 0, or -ENODEV if @buf is revoked.
 */
int fgds_buf_users_get(struct fgds_buf *buf)
{
	/* Once @in_use, @users dies exactly when @buf is revoked. */
	if (READ_ONCE(buf->in_use) && percpu_ref_tryget_live(&buf->users))
		return 0;
	down_read(&buf->lock);
	if (buf->revoked) {
		up_read(&buf->lock);
		return -ENODEV;
	}
	WRITE_ONCE(buf->in_use, true);
	/* Not killed: that happens under @lock held for writing. */
	percpu_ref_get(&buf->users);
	up_read(&buf->lock);
	return 0;
}

/**
 * fgds_buf_users_put() - drop a reference taken by fgds_buf_users_get()
 * @buf: the registration
 */
void fgds_buf_users_put(struct fgds_buf *buf)
{
	percpu_ref_put(&buf->users);
}

/**
 * fgds_buf_users_kill() - no new call or request may reach a registration
 * @buf: the registration, being revoked; dmabuf->resv held, and @lock held
 *	for writing
 *
 * A released registration is left alone: every call held a reference on
 * it, so none is left, and none can come. Killing its @users
 * would start an RCU callback that the registration's free, which may
 * follow at once, must not outrun.
 */
void fgds_buf_users_kill(struct fgds_buf *buf)
{
	dma_resv_assert_held(buf->dmabuf->resv);
	lockdep_assert_held_write(&buf->lock);
	if (!buf->in_use || buf->users_dead || buf->released)
		return;
	WRITE_ONCE(buf->users_dead, true);
	percpu_ref_kill(&buf->users);
}

/**
 * fgds_buf_users_quiet() - can a call still reach a registration's pages
 *	through @users?
 * @buf: the registration
 *
 * Asked only of a registration that is revoked or released. Revoked before
 * it was released: @users was killed if it was ever used, and is quiet once
 * it reached zero (its RCU callback has ended then). Released first: calls
 * hold a reference on the registration, so none is left, and a later
 * revocation leaves @users alone.
 *
 * Return: true if none can.
 */
bool fgds_buf_users_quiet(struct fgds_buf *buf)
{
	if (!READ_ONCE(buf->users_dead))
		return true;
	/* Pairs with the release in fgds_users_release(). */
	return smp_load_acquire(&buf->users_done);
}

/*
 * Bytes [@off, @off + @len) of the registration as bvec segments, one per run
 * contiguous in the BAR, into @bv (@max entries) or, if more are needed, a
 * new array. The first and last runs are found by bisection. @users held: the
 * provider and its pages exist; the range lies inside the registration.
 */
static struct bio_vec *fgds_buf_range_bvecs(struct fgds_buf *buf, u64 off,
					    u64 len, struct bio_vec *bv,
					    unsigned int max, unsigned int *nr)
{
	const struct fgds_extent *e = fgds_buf_extent(buf, off >> PAGE_SHIFT);
	const struct fgds_extent *last =
		fgds_buf_extent(buf, (off + len - 1) >> PAGE_SHIFT);
	unsigned int n, i = 0;

	if (WARN_ON_ONCE(!e || !last))
		return ERR_PTR(-EINVAL);
	n = last - e + 1;
	if (n > max) {
		bv = kvmalloc_array(n, sizeof(*bv), GFP_KERNEL);
		if (!bv)
			return ERR_PTR(-ENOMEM);
	}
	for (; e <= last; e++) {
		u64 at = off - ((u64)e->pgoff << PAGE_SHIFT);
		u64 seg = min(len, ((u64)e->npages << PAGE_SHIFT) - at);

		/* @len is at most MAX_RW_COUNT: a segment fits bv_len. */
		bvec_set_page(&bv[i++],
			      fgds_gpu_page(buf->gpu,
					    e->bar_pg + (at >> PAGE_SHIFT)),
			      seg, offset_in_page(at));
		off += seg;
		len -= seg;
	}
	*nr = i;
	return bv;
}

/**
 * fgds_io_rewind() - set a prepared request up to be issued (again)
 * @req: the request, from fgds_io_prepare(), not in flight
 * @iter: set to the registration's bytes, as segments of @req
 */
void fgds_io_rewind(struct fgds_io_req *req, struct iov_iter *iter)
{
	iov_iter_bvec(iter, req->write ? ITER_SOURCE : ITER_DEST, req->bv,
		      req->nr, req->len);
	req->kiocb.ki_pos = req->pos;
}

/**
 * fgds_io_prepare() - check a call and take what its I/O needs
 * @req: the request to set up (its kiocb is synchronous until the caller
 *	sets ->ki_complete)
 * @f: the node's open file the call was made on
 * @arg: the call's struct fgds_io, copied from user space
 * @file: the file @arg->fd named, a reference the caller took
 * @write: from the registration to the file (else from the file into it)
 * @nowait: the I/O may not wait (IOCB_NOWAIT): -EAGAIN for a file that
 *	cannot promise that, or where the dma-buf is not yet attached as the
 *	file's DMA device
 * @iter: set to the registration's bytes, as segments of @req
 *
 * On success @req holds a reference on the registration, a live reference of
 * its @users, and @file's reference; fgds_io_release() gives them back once
 * the I/O has ended.
 *
 * Return: 0 or a negative errno (see struct fgds_io); nothing is held then,
 * and @file's reference is still the caller's.
 */
int fgds_io_prepare(struct fgds_io_req *req, struct fgds_file *f,
		    const struct fgds_io *arg, struct file *file, bool write,
		    bool nowait, struct iov_iter *iter)
{
	struct pci_dev *dma_dev = NULL;
	struct fgds_buf *buf;
	int ret;

	if (arg->flags || (arg->idx & ~PAGE_MASK) || !arg->len ||
	    arg->len > MAX_RW_COUNT || arg->file_offset > LLONG_MAX)
		return -EINVAL;
	buf = fgds_file_buf_get(f, arg->idx >> PAGE_SHIFT);
	if (!buf)
		return -ENOENT;
	ret = -EINVAL;
	if (arg->offset > buf->size || arg->len > buf->size - arg->offset)
		goto put_buf;
	ret = -EACCES;
	if (!write && buf->readonly)
		goto put_buf;
	ret = -EAGAIN;
	if (nowait && !(file->f_mode & FMODE_NOWAIT))
		goto put_buf;
	ret = fgds_buf_users_get(buf);
	if (ret)
		goto put_buf;
	/* @users held: the provider, whose mode the gate reads, stays. */
	ret = fgds_io_gate(buf->gpu, file, arg->fd, write, &dma_dev);
	if (ret)
		goto put_users;
	if (!fgds_buf_dma_mapped(buf, dma_dev)) {
		ret = -EAGAIN;
		if (nowait)
			goto put_users;
		/* An exporter may hold the reservation lock while it waits for @users. */
		fgds_buf_users_put(buf);
		ret = fgds_buf_dma_attach(buf, dma_dev);
		if (!ret)
			ret = fgds_buf_users_get(buf);
		if (ret)
			goto put_buf;
	}
	init_sync_kiocb(&req->kiocb, file);
	if (!(req->kiocb.ki_flags & IOCB_DIRECT)) {
		dev_info_ratelimited(&buf->gpu->dev,
				     "%s: fd %d is not open with O_DIRECT: fgds moves GPU memory by DMA only; open the file with O_DIRECT\n",
				     current->comm, arg->fd);
		ret = -EINVAL;
		goto put_users;
	}
	req->bv = fgds_buf_range_bvecs(buf, arg->offset, arg->len, req->fast,
				       ARRAY_SIZE(req->fast), &req->nr);
	if (IS_ERR(req->bv)) {
		ret = PTR_ERR(req->bv);
		goto put_users;
	}
	if (write)
		req->kiocb.ki_flags |= IOCB_WRITE;
	/*
	 * The block layer's per-CPU bio cache, as io_uring's own reads have it
	 * (6.x: opt-in per kiocb; 7.x caches every bio and ignores the flag).
	 */
	req->kiocb.ki_flags |= IOCB_ALLOC_CACHE;
	if (nowait)
		req->kiocb.ki_flags |= IOCB_NOWAIT;
	req->buf = buf;
	req->write = write;
	req->pos = arg->file_offset;
	req->len = arg->len;
	fgds_io_rewind(req, iter);
	return 0;

put_users:
	fgds_buf_users_put(buf);
put_buf:
	fgds_buf_put(buf);
	return ret;
}

/**
 * fgds_io_issue() - start a prepared request's I/O
 * @req: the request, from fgds_io_prepare()
 * @iter: its iterator
 *
 * Return: what the file's method returned: bytes moved, a negative errno, or
 * -EIOCBQUEUED if ->ki_complete will be called.
 */
ssize_t fgds_io_issue(struct fgds_io_req *req, struct iov_iter *iter)
{
	struct file *file = req->kiocb.ki_filp;

	if (req->write)
		return fgds_iocb_iter_write(file, &req->kiocb, iter);
	return vfs_iocb_iter_read(file, &req->kiocb, iter);
}

/**
 * fgds_io_release() - give back what fgds_io_prepare() took
 * @req: the request, whose I/O has ended
 *
 * Process context: the registration's last reference may go here.
 */
void fgds_io_release(struct fgds_io_req *req)
{
	struct fgds_buf *buf = req->buf;
	bool cookie;

	if (req->bv != req->fast)
		kvfree(req->bv);
	/*
	 * A revocation fence may be waiting for this drop: from the I/O's end
	 * to here nothing may wait for what a fence waiter holds (lockdep
	 * checks it on the debug kernels). The file and the registration,
	 * whose last reference may take the reservation lock, go after.
	 */
	cookie = dma_fence_begin_signalling();
	fgds_buf_users_put(buf);
	dma_fence_end_signalling(cookie);
	fput(req->kiocb.ki_filp);
	fgds_buf_put(buf);
}

/**
 * fgds_io() - move data between a file and a registration, synchronously
 * @f: the node's open file the call was made on
 * @arg: the call's struct fgds_io, copied from user space
 * @write: from the registration to the file (else from the file into it)
 *
 * Sleeps until the I/O has ended (FGDS_IOCTL_READ/WRITE).
 *
 * Return: bytes moved, or a negative errno (see struct fgds_io).
 */
ssize_t fgds_io(struct fgds_file *f, const struct fgds_io *arg, bool write)
{
	struct fgds_io_req *req;
	struct iov_iter iter;
	struct file *file;
	ssize_t ret;

	req = kzalloc(sizeof(*req), GFP_KERNEL);
	if (!req)
		return -ENOMEM;
	ret = -EBADF;
	file = fget(arg->fd);
	if (!file)
		goto free;
	ret = fgds_io_prepare(req, f, arg, file, write, false, &iter);
	if (ret) {
		fput(file);
		goto free;
	}
	ret = fgds_io_issue(req, &iter);
	/*
	 * A synchronous kiocb: the file's method waited for its I/O. One that
	 * answers -EIOCBQUEUED breaks that contract and may still have I/O on
	 * the registration's pages: the request, its @users reference and all
	 * it holds are kept for good, so that the revocation waits for ever
	 * rather than give the exporter memory that DMA may still reach.
	 */
	if (WARN_ON_ONCE(ret == -EIOCBQUEUED))
		return -EIO;
	fgds_io_release(req);
free:
	kfree(req);
	return ret;
}

/**
 * fgds_ioctl_io() - FGDS_IOCTL_READ and FGDS_IOCTL_WRITE
 * @f: the node's open file
 * @uarg: the user's struct fgds_io
 * @write: FGDS_IOCTL_WRITE
 *
 * Return: bytes moved, or a negative errno.
 */
long fgds_ioctl_io(struct fgds_file *f, void __user *uarg, bool write)
{
	struct fgds_io arg;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	return fgds_io(f, &arg, write);
}

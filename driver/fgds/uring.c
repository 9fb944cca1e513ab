// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: the node's io_uring commands.
 *
 * FGDS_URING_CMD_READ/WRITE are FGDS_IOCTL_READ/WRITE as io_uring commands
 * (rw.c prepares and issues the I/O), on every kernel whose io_uring posts
 * their byte count (not 6.1: fgds_compat.h). The I/O is asynchronous, as
 * io_uring's own reads are: queued with IOCB_NOWAIT as the command is issued
 * (-EAGAIN where it would wait, and io_uring issues the command again from a
 * worker, which may), completed by the file system's ->ki_complete(), which
 * hands the command to task work: there the request lets go of the
 * registration's @users and the file, and the CQE is posted. An I/O that
 * ended with -EAGAIN after it was queued is issued again, waiting, from
 * fgds_io_wq with the submitter's credentials: task work runs under the
 * ring's uring_lock, which nothing may hold while it waits for the block
 * layer. Task work that runs because the task or its ring is going away
 * (io_uring's cancel) issues nothing: the command ends with -ECANCELED.
 *
 * Where the kernel lets the owner of an io_uring kernel buffer end the access
 * itself (io_buffer_register_kbuf(), vm-images/kernel-patches/
 * io-uring-revocable-kbuf; not upstream), FGDS_URING_CMD_REGISTER also puts a
 * whole registration into a slot of the issuing ring's fixed-buffer table:
 * requests name the slot and take its pages as they are, with no GUP, pin or
 * unpin, and complete asynchronously like any read into RAM.
 *
 * No pin: the slot holds a reference on the registration, not on its pages,
 * and every request that uses the slot holds a live reference of the
 * registration's @users from its lookup of the slot until it is freed. A
 * revocation kills @users (under buf->lock, as it sets @revoked), so that
 * later requests on the slot fail with EFAULT, and the registration's pages
 * count as quiet only once @users has reached zero (@users_done): its fence
 * signals after the last request that used a slot has been freed, and only
 * then does the cleanup give the dma-buf back. The slot itself stays until
 * the ring's user empties it (FGDS_URING_CMD_UNREGISTER,
 * IORING_UNREGISTER_BUFFERS, the ring's exit), holding the registration's
 * structure, not its memory.
 *
 * Lock order: the ring's uring_lock (held while a command is issued) ->
 * f->lock, buf->lock. buf->lock is not held while the slot is put into the
 * ring (the ring's lock may be taken there), so that a page fault under the
 * ring's lock cannot wait behind a revocation waiting for this command.
 */

#include "fgds_compat.h"

#include <linux/bvec.h>
#include <linux/cred.h>
#include <linux/module.h>
#include <linux/slab.h>
#include <linux/uio.h>
#include <linux/workqueue.h>

#include <uapi/linux/fgds.h>

#include "fgds_drv.h"

#ifdef FGDS_HAVE_IO_BUFFER_REGISTER_KBUF

/**
 * struct fgds_slot - an io_uring slot made of a registration
 * @buf: the registration (reference held)
 * @put: drops that reference and a module reference, on fgds_wq, once the
 *	ring has let go of the slot
 */
struct fgds_slot {
	struct fgds_buf *buf;
	struct work_struct put;
};

static void fgds_slot_put_fn(struct work_struct *work)
{
	struct fgds_slot *slot = container_of(work, struct fgds_slot, put);

	fgds_buf_put(slot->buf);
	kfree(slot);
	/* Last: this work runs on fgds_wq, which module exit flushes. */
	module_put(THIS_MODULE);
}

/*
 * io_uring let go of a slot: emptied, and the last request that used it
 * freed. Runs under the ring's lock: the registration is put from fgds_wq.
 */
static void fgds_slot_release(void *priv)
{
	struct fgds_slot *slot = priv;

	queue_work(fgds_wq, &slot->put);
}

/*
 * The registration's pages as one segment per folio of the provider, in
 * order; buf->lock held, not revoked (so the provider and its pages exist).
 */
static struct bio_vec *fgds_buf_bvecs(struct fgds_buf *buf, unsigned int *nr)
{
	struct fgds_gpu *gpu = buf->gpu;
	unsigned long per = 1UL << READ_ONCE(gpu->order);
	const struct fgds_extent *e;
	struct bio_vec *bv;
	unsigned long n = 0;
	unsigned int i = 0;

	for (e = buf->ext; e < buf->ext + buf->nr_ext; e++)
		n += (e->bar_pg + e->npages - 1) / per - e->bar_pg / per + 1;
	/* At most FGDS_MAX_BUF_PAGES segments, which fits. */
	bv = kvmalloc_array(n, sizeof(*bv), GFP_KERNEL);
	if (!bv)
		return NULL;
	for (e = buf->ext; e < buf->ext + buf->nr_ext; e++) {
		pgoff_t pg = e->bar_pg, left = e->npages;

		while (left) {
			pgoff_t run = min_t(pgoff_t, left, per - (pg & (per - 1)));

			bvec_set_page(&bv[i++], fgds_gpu_page(gpu, pg),
				      run << PAGE_SHIFT, 0);
			pg += run;
			left -= run;
		}
	}
	*nr = i;
	return bv;
}

static int fgds_uring_register(struct io_uring_cmd *cmd, u64 idx, u32 index,
			       unsigned int issue_flags)
{
	struct fgds_file *f = cmd->file->private_data;
	struct io_kbuf_desc desc = {};
	struct fgds_slot *slot;
	struct fgds_buf *buf;
	struct bio_vec *bv;
	unsigned int nr;
	int ret;

	if (idx & ~PAGE_MASK)
		return -EINVAL;
	buf = fgds_file_buf_get(f, idx >> PAGE_SHIFT);
	if (!buf)
		return -ENOENT;
	slot = kzalloc(sizeof(*slot), GFP_KERNEL);
	if (!slot) {
		ret = -ENOMEM;
		goto put_buf;
	}
	INIT_WORK(&slot->put, fgds_slot_put_fn);
	slot->buf = buf;

	down_read(&buf->lock);
	if (buf->revoked) {
		up_read(&buf->lock);
		ret = -ENODEV;
		goto free_slot;
	}
	bv = fgds_buf_bvecs(buf, &nr);
	if (bv)
		WRITE_ONCE(buf->in_use, true);
	up_read(&buf->lock);
	if (!bv) {
		ret = -ENOMEM;
		goto free_slot;
	}

	desc.bvec = bv;
	desc.nr_bvecs = nr;
	desc.dir = BIT(ITER_SOURCE);
	if (!buf->readonly)
		desc.dir |= BIT(ITER_DEST);
	desc.release = fgds_slot_release;
	desc.priv = slot;
	desc.users = &buf->users;
	__module_get(THIS_MODULE);
	ret = io_buffer_register_kbuf(cmd, &desc, index, issue_flags);
	kvfree(bv);
	if (ret) {
		module_put(THIS_MODULE);
		if (ret != -ENOMEM)
			dev_info_ratelimited(&buf->gpu->dev,
					     "%s: cannot put buffer %#llx into io_uring slot %u (%d): the ring needs a sparse buffer table (IORING_RSRC_REGISTER_SPARSE) with that slot empty\n",
					     current->comm, idx, index, ret);
		goto free_slot;
	}
	return 0;

free_slot:
	kfree(slot);
put_buf:
	fgds_buf_put(buf);
	return ret;
}

static int fgds_uring_slot(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	const struct fgds_uring_buffer *arg = fgds_uring_cmd_bytes(cmd);
	u64 idx = READ_ONCE(arg->idx);
	u32 index = READ_ONCE(arg->index);

	if (READ_ONCE(arg->flags))
		return -EINVAL;
	if (cmd->cmd_op == FGDS_URING_CMD_REGISTER)
		return fgds_uring_register(cmd, idx, index, issue_flags);
	if (idx)
		return -EINVAL;
	return io_buffer_unregister_bvec(cmd, index, issue_flags);
}
#else
/* No slots without the kernel change: the caller maps the token instead. */
static int fgds_uring_slot(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	return -EOPNOTSUPP;
}
#endif /* FGDS_HAVE_IO_BUFFER_REGISTER_KBUF */

#ifdef FGDS_URING_CMD_RESULTS
static void fgds_uring_io_complete(struct kiocb *kiocb, long ret);
static FGDS_URING_TW_PROTO(fgds_uring_io_tw);

/*
 * An I/O that could not be queued without waiting (IOCB_NOWAIT), issued
 * again, waiting, on fgds_io_wq; its completion comes back through
 * fgds_uring_io_complete() as the first one's would have.
 */
static void fgds_uring_reissue_fn(struct work_struct *work)
{
	struct fgds_io_req *req = container_of(work, struct fgds_io_req,
					       reissue);
	const struct cred *old = override_creds(req->cred);
	struct iov_iter iter;
	ssize_t ret;

	fgds_io_rewind(req, &iter);
	ret = fgds_io_issue(req, &iter);
	revert_creds(old);
	if (ret == -EIOCBQUEUED)
		return;
	/* Ended at once: the file's method also ended its write. */
	req->ret = ret;
	req->ended = true;
	io_uring_cmd_complete_in_task(req->cmd, fgds_uring_io_tw);
}

/*
 * The I/O ended and its task work runs, under the ring's uring_lock: the
 * CQE, after everything is let go. An I/O that could not be queued without
 * waiting goes to fgds_uring_reissue_fn(), unless the task or its ring is
 * going away.
 */
static void fgds_uring_io_done(struct io_uring_cmd *cmd,
			       unsigned int issue_flags, bool dead)
{
	struct fgds_io_req *req = *io_uring_cmd_to_pdu(cmd, struct fgds_io_req *);
	long ret = req->ret;

	if (req->write && !req->ended)
		kiocb_end_write(&req->kiocb);
	if (ret == -EAGAIN && (req->kiocb.ki_flags & IOCB_NOWAIT)) {
		if (dead) {
			ret = -ECANCELED;
		} else {
			req->kiocb.ki_flags &= ~IOCB_NOWAIT;
			req->cred = get_current_cred();
			INIT_WORK(&req->reissue, fgds_uring_reissue_fn);
			queue_work(fgds_io_wq, &req->reissue);
			return;
		}
	}
	if (req->cred)
		put_cred(req->cred);
	fgds_io_release(req);
	kfree(req);
	fgds_uring_cmd_done(cmd, ret, issue_flags);
}

FGDS_DEFINE_URING_TW(fgds_uring_io_tw, fgds_uring_io_done)

/* From the file system's completion, maybe in an interrupt. */
static void fgds_uring_io_complete(struct kiocb *kiocb, long ret)
{
	struct fgds_io_req *req = container_of(kiocb, struct fgds_io_req, kiocb);

	req->ret = ret;
	io_uring_cmd_complete_in_task(req->cmd, fgds_uring_io_tw);
}

static int fgds_uring_io(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	struct fgds_file *f = cmd->file->private_data;
	struct fgds_io_req *req;
	struct iov_iter iter;
	struct fgds_io arg;
	ssize_t ret;

	if (!(issue_flags & IO_URING_F_SQE128)) {
		dev_info_ratelimited(&f->gpu->dev,
				     "%s: FGDS_URING_CMD_READ/WRITE need 128-byte submission entries: set the ring up with IORING_SETUP_SQE128\n",
				     current->comm);
		return -EINVAL;
	}
	memcpy(&arg, fgds_uring_cmd_bytes(cmd), sizeof(arg));
	req = kzalloc(sizeof(*req), GFP_KERNEL);
	if (!req)
		return -ENOMEM;
	/*
	 * Not allowed to block, the I/O is queued with IOCB_NOWAIT; where it
	 * would wait to be queued, -EAGAIN, and io_uring issues the command
	 * again from a worker, which may wait.
	 */
	ret = fgds_io_prepare(req, f, &arg, cmd->cmd_op == FGDS_URING_CMD_WRITE,
			      issue_flags & IO_URING_F_NONBLOCK, &iter);
	if (ret)
		goto free;
	req->cmd = cmd;
	req->kiocb.ki_complete = fgds_uring_io_complete;
	*io_uring_cmd_to_pdu(cmd, struct fgds_io_req *) = req;
	ret = fgds_io_issue(req, &iter);
	if (ret == -EIOCBQUEUED)
		return -EIOCBQUEUED;
	/* Ended at once (an error, or no I/O left to queue). */
	fgds_io_release(req);
free:
	kfree(req);
	return ret;
}
#else
/* This io_uring would lose the byte count: FGDS_IOCTL_READ/WRITE instead. */
static int fgds_uring_io(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	return -EOPNOTSUPP;
}
#endif

/**
 * fgds_uring_cmd() - the node's io_uring commands (FGDS_URING_CMD_*)
 * @cmd: the command
 * @issue_flags: its issue flags
 *
 * Return: the CQE's result: bytes moved (READ, WRITE), 0 (REGISTER,
 * UNREGISTER), or a negative errno; -EAGAIN to be issued again from an
 * io_uring worker. Never queued.
 */
int fgds_uring_cmd(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	switch (cmd->cmd_op) {
	case FGDS_URING_CMD_READ:
	case FGDS_URING_CMD_WRITE:
		return fgds_uring_io(cmd, issue_flags);
	case FGDS_URING_CMD_REGISTER:
	case FGDS_URING_CMD_UNREGISTER:
		return fgds_uring_slot(cmd, issue_flags);
	default:
		return -ENOTTY;
	}
}

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
 * Lock order: the ring's uring_lock (held while a command is issued and
 * while its task work runs) -> f->lock, buf->lock (read).
 *
 * There are no io_uring slots of registrations (fixed buffers a request
 * names by index): a slot could be used by any read or write of the ring,
 * on any file, which fgds's gate (gate.c) never sees, so a pipe could hold
 * a revocation again. The kernel's own dma-buf registered buffers, where
 * the NVMe driver is the importer, are the way to fixed buffers.
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
 * Return: the CQE's result: bytes moved, or a negative errno; -EAGAIN to be
 * issued again from an io_uring worker.
 */
int fgds_uring_cmd(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	switch (cmd->cmd_op) {
	case FGDS_URING_CMD_READ:
	case FGDS_URING_CMD_WRITE:
		return fgds_uring_io(cmd, issue_flags);
	default:
		return -ENOTTY;
	}
}

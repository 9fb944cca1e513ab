// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: the node's io_uring commands.
 *
 * FGDS_URING_CMD_READ/WRITE are FGDS_IOCTL_READ/WRITE as io_uring commands
 * (rw.c prepares and issues the I/O), on every kernel whose io_uring posts
 * their byte count (not 6.1: fgds_compat.h). The I/O is asynchronous, as
 * io_uring's own reads are: queued with IOCB_NOWAIT as the command is issued,
 * completed by the file system's ->ki_complete(), which hands the command to
 * task work: there the request lets go of the registration's @users and the
 * file, and the CQE is posted. Where the command would wait (the first use
 * of a DMA device attaches the dma-buf as it, rw.c; the block layer has no
 * request free for a NOWAIT I/O, at once or after it was queued), fgds does
 * it again itself, waiting, from fgds_io_wq with the submitter's
 * credentials, never by answering -EAGAIN: io_uring's own issue from a worker
 * reads the command from the submission queue entry again, which on 6.12
 * (io_uring_cmd() copies the entry but leaves the command pointing at the
 * ring's, fixed upstream by "io_uring/uring_cmd: switch sqe to async_data on
 * EAGAIN") may hold another command by then: a read of the wrong range,
 * reported done. Task work runs under the ring's uring_lock, which nothing
 * may hold while it waits for the block layer. Task work that runs because
 * the task or its ring is going away (io_uring's cancel) issues nothing: the
 * command ends with -ECANCELED.
 *
 * Lock order: the ring's uring_lock (held while a command is issued and
 * while its task work runs) -> buf->lock (read); the registration is looked
 * up under RCU, with no lock.
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
#include <linux/debugfs.h>
#include <linux/module.h>
#include <linux/slab.h>
#include <linux/uio.h>
#include <linux/workqueue.h>

#include <uapi/linux/fgds.h>

#include "fgds_drv.h"

/*
 * What the rig's tests read to know that the paths they aim at ran
 * (debugfs, fgds/): commands issued again after -EAGAIN, and I/Os that
 * completed before the file's method that queued them, on a worker, had
 * returned (the task work would have freed its kiocb under it).
 */
static atomic_t fgds_uring_reissued = ATOMIC_INIT(0);
static atomic_t fgds_uring_completed_in_issue = ATOMIC_INIT(0);

#ifdef FGDS_URING_CMD_RESULTS
static void fgds_uring_io_complete(struct kiocb *kiocb, long ret);
static FGDS_URING_TW_PROTO(fgds_uring_io_tw);
static void fgds_uring_reissue_fn(struct work_struct *work);

/*
 * Whether an issue runs on a worker (fgds_io_wq, io-wq), where the
 * submitter's task work can run while the file's method still does.
 */
static bool fgds_uring_on_worker(void)
{
	return current->flags & (PF_WQ_WORKER | PF_IO_WORKER);
}

/*
 * Starts a prepared request's I/O; on -EIOCBQUEUED the caller lets go of
 * @issuing with fgds_uring_issued(), after it is done with what the request
 * lent it (its credentials).
 */
static ssize_t fgds_uring_issue(struct fgds_io_req *req, struct iov_iter *iter)
{
	ssize_t ret;

	refcount_set(&req->issuing, 2);
	ret = fgds_io_issue(req, iter);
	if (ret == -EIOCBQUEUED && fgds_uring_on_worker())
		fgds_issue_window(&req->kiocb);
	return ret;
}

/*
 * After an issue: an I/O under way goes to task work once it completed too
 * (fgds_uring_io_complete()); one that ended at once (its write ended with
 * it by the file's method), or a preparation that failed, ends the command.
 */
static void fgds_uring_issued(struct fgds_io_req *req, ssize_t ret)
{
	if (ret == -EIOCBQUEUED) {
		if (!refcount_dec_and_test(&req->issuing))
			return;
		/* Completed first: the submitter could have freed it. */
		if (fgds_uring_on_worker())
			atomic_inc(&fgds_uring_completed_in_issue);
		io_uring_cmd_complete_in_task(req->cmd, fgds_uring_io_tw);
		return;
	}
	req->ret = ret;
	req->ended = true;
	io_uring_cmd_complete_in_task(req->cmd, fgds_uring_io_tw);
}

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

	atomic_inc(&fgds_uring_reissued);
	fgds_io_rewind(req, &iter);
	ret = fgds_uring_issue(req, &iter);
	revert_creds(old);
	fgds_uring_issued(req, ret);
}

/*
 * A command that could not be prepared without waiting (the dma-buf not yet
 * attached as its DMA device), prepared and issued on fgds_io_wq; its
 * completion comes back through fgds_uring_io_complete(), or, where the
 * preparation fails, ends the command with nothing held.
 */
static void fgds_uring_prepare_fn(struct work_struct *work)
{
	struct fgds_io_req *req = container_of(work, struct fgds_io_req,
					       reissue);
	struct io_uring_cmd *cmd = req->cmd;
	const struct cred *old = override_creds(req->cred);
	struct iov_iter iter;
	ssize_t ret;

	ret = fgds_io_prepare(req, cmd->file->private_data, &req->arg,
			      req->file, cmd->cmd_op == FGDS_URING_CMD_WRITE,
			      false, &iter);
	if (ret)
		fput(req->file);
	req->file = NULL;
	if (!ret) {
		req->prepared = true;
		req->kiocb.ki_complete = fgds_uring_io_complete;
		ret = fgds_uring_issue(req, &iter);
	}
	revert_creds(old);
	fgds_uring_issued(req, ret);
}

/*
 * Hands @req to fgds_io_wq to be issued again (@fn: fgds_uring_reissue_fn)
 * or prepared and issued (fgds_uring_prepare_fn), waiting, with the current
 * task's credentials.
 */
static void fgds_uring_defer(struct fgds_io_req *req, work_func_t fn)
{
	req->kiocb.ki_flags &= ~IOCB_NOWAIT;
	req->cred = get_current_cred();
	INIT_WORK(&req->reissue, fn);
	queue_work(fgds_io_wq, &req->reissue);
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

	if (req->prepared && req->write && !req->ended)
		kiocb_end_write(&req->kiocb);
	if (ret == -EAGAIN && (req->kiocb.ki_flags & IOCB_NOWAIT)) {
		if (dead) {
			ret = -ECANCELED;
		} else {
			fgds_uring_defer(req, fgds_uring_reissue_fn);
			return;
		}
	}
	if (req->cred)
		put_cred(req->cred);
	if (req->prepared)
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
	/* Ordered before the task work by the reference's release. */
	if (refcount_dec_and_test(&req->issuing))
		io_uring_cmd_complete_in_task(req->cmd, fgds_uring_io_tw);
}

static int fgds_uring_io(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	struct fgds_file *f = cmd->file->private_data;
	struct fgds_io_req *req;
	struct iov_iter iter;
	struct fgds_io arg;
	struct file *file;
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
	req->cmd = cmd;
	req->arg = arg;
	*io_uring_cmd_to_pdu(cmd, struct fgds_io_req *) = req;
	/*
	 * Not allowed to block where io_uring says so: the I/O is queued with
	 * IOCB_NOWAIT, and what would wait goes to fgds_io_wq (top of file).
	 */
	ret = -EBADF;
	file = fget(arg.fd);
	if (!file)
		goto free;
	ret = fgds_io_prepare(req, f, &arg, file,
			      cmd->cmd_op == FGDS_URING_CMD_WRITE,
			      issue_flags & IO_URING_F_NONBLOCK, &iter);
	if (ret == -EAGAIN && (issue_flags & IO_URING_F_NONBLOCK)) {
		/* The file was resolved here: a worker has no file table. */
		req->file = file;
		fgds_uring_defer(req, fgds_uring_prepare_fn);
		return -EIOCBQUEUED;
	}
	if (ret) {
		fput(file);
		goto free;
	}
	req->prepared = true;
	req->kiocb.ki_complete = fgds_uring_io_complete;
	ret = fgds_uring_issue(req, &iter);
	if (ret == -EIOCBQUEUED) {
		fgds_uring_issued(req, ret);
		return -EIOCBQUEUED;
	}
	if (ret == -EAGAIN && (req->kiocb.ki_flags & IOCB_NOWAIT)) {
		/* Not queued: the file's method ended its write. */
		req->ended = true;
		fgds_uring_defer(req, fgds_uring_reissue_fn);
		return -EIOCBQUEUED;
	}
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
 * fgds_uring_debugfs_init() - the counters the rig's tests read
 * @dir: fgds's debugfs directory, or an error pointer where there is none
 */
void fgds_uring_debugfs_init(struct dentry *dir)
{
	debugfs_create_atomic_t("uring_reissued", 0444, dir,
				&fgds_uring_reissued);
	debugfs_create_atomic_t("uring_completed_in_issue", 0444, dir,
				&fgds_uring_completed_in_issue);
}

/**
 * fgds_uring_cmd() - the node's io_uring commands (FGDS_URING_CMD_*)
 * @cmd: the command
 * @issue_flags: its issue flags
 *
 * Return: the CQE's result: bytes moved, or a negative errno; -EIOCBQUEUED
 * while it is under way. Never -EAGAIN (top of file).
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

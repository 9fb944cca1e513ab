// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: revocation, and letting go of a registration's pages.
 *
 * The promise to an exporter: once it invalidates a dma-buf (or the GPU's
 * driver unbinds, or the GPU goes away), nothing fgds handed out reaches the
 * memory again, and the exporter gets the memory back only when that holds.
 * No timer ends that wait.
 *
 * The invalidation callback never sleeps for I/O, under any failure. Under
 * the reservation lock it marks the registration revoked (the fault handler
 * checks the flag under buf->lock, so no PTE appears afterwards) and zaps
 * every user mapping of it
 * (later CPU access gets SIGBUS, later I/O EFAULT). If the pages are quiet it
 * unmaps and unpins the dma-buf right away. Otherwise (I/O in flight, or
 * pages spliced into a pipe) it adds the registration's fence to the
 * reservation object and puts the registration on its GPU's pending list.
 * The fence's usage is WRITE: it stands for the DMA of an importer's
 * userspace I/O, which may write the memory, and include/linux/dma-buf.h
 * (struct dma_buf, @resv: "Drivers may just always add a write fence")
 * gives an importer's access that usage; KERNEL is for the kernel's own
 * memory management (include/linux/dma-resv.h, enum dma_resv_usage).
 * The exporter waits for that fence before it reuses the memory: vfio-pci
 * and vgpu wait for every usage (BOOKKEEP).
 *
 * The quiesce work polls the pending list. Once a registration's pages are
 * quiet it signals the fence and queues the registration's cleanup work,
 * which replaces the signalled fence in the reservation object with the stub
 * fence, unmaps and unpins the dma-buf, and gives fgds's page references
 * back. Past revoke_timeout_ms nothing is given back early: teardown logs who
 * still holds the pages and keeps waiting.
 *
 * Exporters wait for the fence while holding the reservation lock (vfio-pci
 * does), so the quiesce work takes no lock that anyone holds while waiting
 * for a fence or while allocating memory: only gpu->pending_lock. It runs
 * alone on fgds_signal_wq, which has a rescuer (WQ_MEM_RECLAIM) and nothing
 * else that could block it, and it is annotated as a fence-signalling
 * critical section for lockdep. The cleanup, which needs the reservation
 * lock, runs on fgds_wq.
 *
 * Released registrations (no registry entry, no VMA) whose pages are still
 * referenced go on the same pending list, without a fence: they keep the
 * dma-buf pinned and mapped until the pages are quiet. Every registration on
 * the pending list holds a module reference, so the module cannot be
 * unloaded from under it; the cleanup work drops it, on fgds's own workqueue,
 * which module exit flushes.
 *
 * Lock order: PCI device_lock -> fgds_lock (the bus notifier runs under the
 * device lock; nothing takes a device lock under fgds_lock, which only
 * guards the GPU list), and PCI device_lock -> gpu->lock -> gpu->bufs_lock ->
 * dmabuf->resv -> buf->lock -> i_mmap_rwsem (zap) -> gpu->holds_lock ->
 * gpu->pending_lock. The mmap lock comes before gpu->bufs_lock (a
 * registration's last reference can go in munmap()) and never before
 * gpu->lock, which is held while the provider's sysfs files come and go.
 * A ring's uring_lock, under which io_uring commands are issued and their
 * task work runs, comes before f->lock and buf->lock (read), and before
 * gpu->bufs_lock -> dmabuf->resv where a command's end drops a
 * registration's last reference.
 */

#include <linux/delay.h>
#include <linux/dma-buf.h>
#include <linux/dma-fence.h>
#include <linux/dma-resv.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/slab.h>

#include "fgds_compat.h"
#include "fgds_drv.h"

/* First and longest delay between two looks at the pending list. */
#define FGDS_QUIESCE_MIN	1
#define FGDS_QUIESCE_MAX	(HZ / 50)

/* How often teardown repeats who still holds pages, past the deadline. */
#define FGDS_HOLDER_REPORT	(10 * HZ)

static const char *fgds_fence_driver_name(struct dma_fence *fence)
{
	return "fgds";
}

static const char *fgds_fence_timeline_name(struct dma_fence *fence)
{
	return "revocation";
}

/*
 * Whether the dma-buf core calls a fence's ops after it was signalled
 * depends on the kernel (7.x drops the ops of a signalled fence that has no
 * release op), a rule inside drivers/dma-buf that no compile probe sees. So
 * on every kernel a published fence has a release op and holds a module
 * reference, dropped from fgds's own workqueue (which module exit flushes)
 * so that no fgds code runs after the last one.
 */
static void fgds_fence_free_fn(struct work_struct *work)
{
	struct fgds_fence *f = container_of(work, struct fgds_fence,
					    free_work);

	kfree_rcu(&f->base, rcu);
	module_put(THIS_MODULE);
}

static void fgds_fence_release(struct dma_fence *fence)
{
	struct fgds_fence *f = container_of(fence, struct fgds_fence, base);

	INIT_WORK(&f->free_work, fgds_fence_free_fn);
	queue_work(fgds_wq, &f->free_work);
}

/* The core frees a fence with kfree_rcu() of its @base (7.x): first, then. */
static_assert(offsetof(struct fgds_fence, base) == 0);

static const struct dma_fence_ops fgds_fence_ops = {
	.get_driver_name = fgds_fence_driver_name,
	.get_timeline_name = fgds_fence_timeline_name,
	.release = fgds_fence_release,
};

/**
 * fgds_fence_prepare() - allocate a registration's revocation fence
 * @buf: the registration being created
 *
 * Allocated up front so that revocation, which runs in the exporter's
 * invalidation callback, needs no allocation but the reservation slot.
 *
 * Return: 0 or -ENOMEM.
 */
int fgds_fence_prepare(struct fgds_buf *buf)
{
	buf->fence = kzalloc(sizeof(*buf->fence), GFP_KERNEL);
	if (!buf->fence)
		return -ENOMEM;
	spin_lock_init(&buf->fence->lock);
	return 0;
}

/**
 * fgds_fence_discard() - free a fence that was never added to a dma-buf
 * @buf: the registration
 */
void fgds_fence_discard(struct fgds_buf *buf)
{
	if (!buf->fence_live)
		kfree(buf->fence);
	buf->fence = NULL;
}

/* What fgds_fence_publish_locked() did. */
enum fgds_fence_state {
	FGDS_FENCE_PUBLISHED,	/* in the reservation object (now or before) */
	FGDS_FENCE_NOT_NEEDED,	/* the quiesce work found the pages quiet */
};

/*
 * A slot for one more fence in the reservation object; dmabuf->resv held.
 * dma_resv_reserve_fences() allocates only when the object's list is full,
 * and a slot reserved earlier does not survive the lock's release (debug
 * kernels shrink the list at unlock), so it cannot be set aside at
 * registration. Without one the exporter would reuse memory that I/O still
 * reaches, so this waits for memory, as any allocation with __GFP_NOFAIL
 * would, and never for I/O: logged once per registration.
 */
static void fgds_fence_reserve_locked(struct fgds_buf *buf)
{
	struct dma_resv *resv = buf->dmabuf->resv;
	bool told = false;

	while (dma_resv_reserve_fences(resv, 1)) {
		if (!told)
			dev_warn(&buf->gpu->dev,
				 "no memory for the revocation fence of a buffer of %s; retrying\n",
				 buf->owner);
		told = true;
		memalloc_retry_wait(GFP_KERNEL);
	}
}

/*
 * Adds the revocation fence to the reservation object; dmabuf->resv held.
 * The quiesce work decides under gpu->pending_lock that a registration is
 * quiet and signals its fence if one is published; the fence is published
 * under the same lock, so it is either signalled by that decision or not
 * published at all. On kernels where fence ops stay in use after
 * signalling, the fence pins the module.
 */
static enum fgds_fence_state fgds_fence_publish_locked(struct fgds_buf *buf)
{
	struct dma_resv *resv = buf->dmabuf->resv;
	struct fgds_fence *f = buf->fence;
	struct fgds_gpu *gpu = buf->gpu;
	enum fgds_fence_state state = FGDS_FENCE_PUBLISHED;

	if (buf->fence_live)
		return FGDS_FENCE_PUBLISHED;
	/* Allocated at registration, and only ever published once. */
	if (WARN_ON_ONCE(!f))
		return FGDS_FENCE_NOT_NEEDED;
	fgds_fence_reserve_locked(buf);
	/*
	 * The registration holds a module reference, through its open file
	 * or, once released, its place on the pending list.
	 */
	__module_get(THIS_MODULE);
	spin_lock(&gpu->pending_lock);
	if (buf->quiet) {
		state = FGDS_FENCE_NOT_NEEDED;
	} else {
		dma_fence_init(&f->base, &fgds_fence_ops, &f->lock,
			       dma_fence_context_alloc(1), 1);
		dma_resv_add_fence(resv, &f->base, DMA_RESV_USAGE_WRITE);
		buf->fence_live = true;
	}
	spin_unlock(&gpu->pending_lock);
	if (state != FGDS_FENCE_PUBLISHED)
		module_put(THIS_MODULE);
	return state;
}

static void fgds_gpu_kick(struct fgds_gpu *gpu, unsigned long delay)
{
	/* A queued run holds a reference on the GPU. */
	get_device(&gpu->dev);
	if (!queue_delayed_work(fgds_signal_wq, &gpu->quiesce, delay))
		put_device(&gpu->dev);
}

/*
 * Puts a registration whose pages are still referenced on the GPU's pending
 * list; dmabuf->resv held. A registration not yet released is kept alive by
 * a reference of the list's; a released one is owned by the list. The list
 * entry holds a module reference: the caller's registration holds one until
 * then (its open file, or, in munmap(), the VMA's file).
 */
static void fgds_buf_add_pending(struct fgds_buf *buf)
{
	struct fgds_gpu *gpu = buf->gpu;

	dma_resv_assert_held(buf->dmabuf->resv);
	if (buf->pending)
		return;
	__module_get(THIS_MODULE);
	if (!buf->released && kref_get_unless_zero(&buf->ref))
		buf->pending_ref = true;
	buf->pending = true;
	buf->pending_since = jiffies;
	buf->quiet_upto = 0;
	spin_lock(&gpu->pending_lock);
	list_add_tail(&buf->pending_node, &gpu->pending);
	spin_unlock(&gpu->pending_lock);
	fgds_gpu_kick(gpu, FGDS_QUIESCE_MIN);
}

/*
 * Signals the revocation fence of a registration whose pages are quiet, if it
 * was published, and replaces it in the reservation object with the stub
 * fence, so that nothing keeps fgds's fence alive there; dmabuf->resv held.
 */
static void fgds_fence_retire_locked(struct fgds_buf *buf)
{
	struct dma_resv *resv = buf->dmabuf->resv;
	struct dma_fence *stub;

	if (!buf->fence_live)
		return;
	dma_fence_signal(&buf->fence->base);
	stub = dma_fence_get_stub();
	dma_resv_replace_fences(resv, buf->fence->base.context, stub,
				DMA_RESV_USAGE_WRITE);
	dma_fence_put(stub);
	dma_fence_put(&buf->fence->base);
	buf->fence = NULL;
	buf->fence_live = false;
}

/**
 * fgds_buf_unmap_locked() - unmap and unpin a registration's dma-buf
 * @buf: the registration; dmabuf->resv held
 *
 * Only once no DMA fgds enabled can reach the memory: the pages are quiet,
 * or a signalled fence says so.
 */
void fgds_buf_unmap_locked(struct fgds_buf *buf)
{
	struct fgds_dma_map *m;

	dma_resv_assert_held(buf->dmabuf->resv);
	for (m = buf->dma_maps; m; m = m->next)
		fgds_dma_map_drop(buf, m);
	if (buf->sgt) {
		dma_buf_unmap_attachment(buf->attach, buf->sgt,
					 fgds_buf_dma_dir(buf));
		buf->sgt = NULL;
	}
	if (buf->pinned) {
		dma_buf_unpin(buf->attach);
		buf->pinned = false;
	}
}

/**
 * fgds_buf_revoke_locked() - revoke a registration; never sleeps for I/O
 * @buf: the registration; dmabuf->resv held
 *
 * Idempotent. Called by the exporter's invalidation and by GPU teardown.
 */
void fgds_buf_revoke_locked(struct fgds_buf *buf)
{
	dma_resv_assert_held(buf->dmabuf->resv);

	down_write(&buf->lock);
	if (buf->revoked) {
		up_write(&buf->lock);
		return;
	}
	buf->revoked = true;
	fgds_buf_users_kill(buf);
	up_write(&buf->lock);

	/* A released buffer has no mapping left to zap. */
	if (buf->mapping)
		unmap_mapping_range(buf->mapping,
				    (loff_t)fgds_buf_vm_pgoff(buf) << PAGE_SHIFT,
				    buf->size, 1);

	/*
	 * Pending already (released with I/O in flight): the fence joins it,
	 * unless the quiesce work found the pages quiet meanwhile, then its
	 * cleanup work may be waiting for the reservation lock, and nothing
	 * is left to wait for.
	 */
	if (buf->pending) {
		if (fgds_fence_publish_locked(buf) == FGDS_FENCE_PUBLISHED)
			return;
		fgds_buf_unmap_locked(buf);
		return;
	}
	if (!fgds_buf_quiet(buf, NULL) &&
	    fgds_fence_publish_locked(buf) == FGDS_FENCE_PUBLISHED) {
		fgds_buf_add_pending(buf);
		return;
	}
	fgds_buf_unmap_locked(buf);
	fgds_buf_reap(buf);
	wake_up_all(&buf->gpu->quiet_wq);
}

/**
 * fgds_buf_revoke() - revoke a registration (GPU unbind or removal)
 * @buf: the registration
 */
void fgds_buf_revoke(struct fgds_buf *buf)
{
	dma_resv_lock(buf->dmabuf->resv, NULL);
	fgds_buf_revoke_locked(buf);
	dma_resv_unlock(buf->dmabuf->resv);
}

/**
 * fgds_buf_let_go() - the last user reference to a registration is gone
 * @buf: the registration, unlisted from its GPU
 *
 * No registry entry and no VMA are left, so no new PTE and no new pin can
 * appear. Pins of I/O still in flight (or pages in a pipe) may remain: then
 * the registration keeps its dma-buf pinned and mapped, so that the exporter
 * cannot reuse memory that DMA may still reach, and goes on the pending list.
 * Nothing here waits: this runs in close() and in the exit of a killed
 * process.
 */
void fgds_buf_let_go(struct fgds_buf *buf)
{
	struct dma_resv *resv;
	bool quiet;

	if (!buf->attach) {
		fgds_buf_free(buf);
		return;
	}
	resv = buf->dmabuf->resv;
	dma_resv_lock(resv, NULL);
	buf->released = true;
	buf->mapping = NULL;
	if (buf->pending) {
		/* Revoked with I/O in flight: the pending list frees it. */
		dma_resv_unlock(resv);
		return;
	}
	quiet = fgds_buf_quiet(buf, NULL);
	if (!quiet)
		fgds_buf_add_pending(buf);
	if (quiet) {
		fgds_buf_unmap_locked(buf);
		/*
		 * Under the lock: until fgds_buf_free() detaches, an invalidation
		 * can still come, and must find a registration that holds
		 * nothing (not one whose pages I/O through another registration
		 * of the same memory keeps busy, which it would put on the
		 * pending list to be cleaned up after the free).
		 */
		fgds_buf_reap(buf);
	}
	dma_resv_unlock(resv);
	/* Until fgds_buf_free() detaches, an invalidation may still come. */
	fgds_race_window();
	if (quiet) {
		wake_up_all(&buf->gpu->quiet_wq);
		fgds_buf_free(buf);
	}
}

/* Logs a pending registration whose pages are still referenced. */
static void fgds_report_holder(struct fgds_buf *buf)
{
	pgoff_t bar_pg = fgds_buf_bar_pg(buf, buf->quiet_upto);
	struct fgds_gpu *gpu = buf->gpu;
	struct folio *folio;

	if (!fgds_buf_users_quiet(buf)) {
		dev_warn(&gpu->dev,
			 "revoked buffer of %s (%llu bytes) still in use by fgds's reads and writes after %u ms; the exporter gets the memory back only when they end\n",
			 buf->owner, buf->size,
			 jiffies_to_msecs(jiffies - buf->pending_since));
		return;
	}
	folio = page_folio(fgds_gpu_page(gpu, bar_pg));
	dev_warn(&gpu->dev,
		 "%s buffer of %s (%llu bytes) still referenced after %u ms: BAR page %#lx has %d references, %d mapped (I/O in flight, or pages in a pipe); the exporter gets the memory back only when they go\n",
		 buf->revoked ? "revoked" : "released", buf->owner, buf->size,
		 jiffies_to_msecs(jiffies - buf->pending_since), bar_pg,
		 folio_ref_count(folio), fgds_folio_mapcount(folio));
}

/*
 * Checks each pending registration's pages, from where the previous look
 * stopped: once revoked or released no new pin can appear, so pages found
 * quiet stay quiet.
 */
static void fgds_quiesce_scan(struct fgds_gpu *gpu, struct list_head *quiet,
			      bool *left)
{
	struct fgds_buf *buf, *tmp;
	LIST_HEAD(scan);

	spin_lock(&gpu->pending_lock);
	list_splice_init(&gpu->pending, &scan);
	spin_unlock(&gpu->pending_lock);

	list_for_each_entry_safe(buf, tmp, &scan, pending_node) {
		if (fgds_buf_users_quiet(buf) &&
		    fgds_pages_quiet(gpu, buf->ext, buf->nr_ext,
				     &buf->quiet_upto))
			list_move_tail(&buf->pending_node, quiet);
	}

	spin_lock(&gpu->pending_lock);
	list_splice(&scan, &gpu->pending);
	*left = !list_empty(&gpu->pending);
	spin_unlock(&gpu->pending_lock);
}

/**
 * fgds_quiesce_fn() - signal the fences of registrations whose pages are quiet
 * @work: the GPU's quiesce work
 *
 * A fence-signalling critical section: takes no lock but pending_lock,
 * allocates nothing.
 */
void fgds_quiesce_fn(struct work_struct *work)
{
	struct fgds_gpu *gpu = container_of(to_delayed_work(work),
					    struct fgds_gpu, quiesce);
	struct fgds_buf *buf, *tmp;
	LIST_HEAD(quiet);
	bool cookie, left;

	cookie = dma_fence_begin_signalling();
	fgds_quiesce_scan(gpu, &quiet, &left);
	list_for_each_entry_safe(buf, tmp, &quiet, pending_node) {
		list_del_init(&buf->pending_node);
		/* Under the lock fences are published with (see above). */
		spin_lock(&gpu->pending_lock);
		buf->quiet = true;
		if (buf->fence_live)
			dma_fence_signal(&buf->fence->base);
		spin_unlock(&gpu->pending_lock);
		queue_work(fgds_wq, &buf->cleanup);
	}
	dma_fence_end_signalling(cookie);

	if (left) {
		unsigned long delay = FGDS_QUIESCE_MIN;

		/* Back off while the same I/O stays in flight. */
		if (list_empty(&quiet))
			delay = FGDS_QUIESCE_MAX;
		fgds_gpu_kick(gpu, delay);
	}
	/* The reference of this run; may be the GPU's last. */
	put_device(&gpu->dev);
}

/**
 * fgds_cleanup_fn() - give back what a quiet registration still holds
 * @work: the registration's cleanup work
 *
 * Its fence (if any) is signalled. Replaces it in the reservation object with
 * the stub fence (nothing keeps fgds's fence alive there), unmaps and unpins
 * the dma-buf, gives back fgds's page references; a released registration is
 * then freed.
 */
void fgds_cleanup_fn(struct work_struct *work)
{
	struct fgds_buf *buf = container_of(work, struct fgds_buf, cleanup);
	struct dma_resv *resv = buf->dmabuf->resv;
	struct fgds_gpu *gpu = buf->gpu;
	bool released, put;

	fgds_buf_reap(buf);
	wake_up_all(&gpu->quiet_wq);

	dma_resv_lock(resv, NULL);
	fgds_fence_retire_locked(buf);
	fgds_buf_unmap_locked(buf);
	buf->pending = false;
	released = buf->released;
	put = buf->pending_ref;
	buf->pending_ref = false;
	dma_resv_unlock(resv);

	if (put)
		fgds_buf_put(buf);
	else if (released)
		fgds_buf_free(buf);
	/* Last: this work runs on fgds_wq, which module exit flushes. */
	module_put(THIS_MODULE);
}

static bool fgds_gpu_unheld(struct fgds_gpu *gpu)
{
	bool idle;

	spin_lock(&gpu->pending_lock);
	idle = list_empty(&gpu->pending);
	spin_unlock(&gpu->pending_lock);
	return idle && !READ_ONCE(gpu->nr_held);
}

static void fgds_report_holders(struct fgds_gpu *gpu)
{
	struct fgds_buf *buf;
	unsigned int n = 0;

	spin_lock(&gpu->pending_lock);
	list_for_each_entry(buf, &gpu->pending, pending_node) {
		if (n++ < 8)
			fgds_report_holder(buf);
	}
	spin_unlock(&gpu->pending_lock);
	if (!n)
		dev_warn(&gpu->dev, "%lu registrations still hold pages\n",
			 READ_ONCE(gpu->nr_held));
}

/*
 * Waits until fgds holds no page of the GPU: every registration revoked or
 * released and its pages quiet. Holds no lock, so other devices' notifications
 * and other processes' munmap go on meanwhile. One deadline for all buffers;
 * past it, logs who still holds pages, and keeps waiting: nothing is given
 * back under a pin.
 */
static void fgds_gpu_wait_unheld(struct fgds_gpu *gpu)
{
	unsigned long deadline = msecs_to_jiffies(fgds_revoke_timeout_ms);

	if (wait_event_timeout(gpu->quiet_wq, fgds_gpu_unheld(gpu),
			       deadline))
		return;
	do {
		fgds_report_holders(gpu);
	} while (!wait_event_timeout(gpu->quiet_wq, fgds_gpu_unheld(gpu),
				     FGDS_HOLDER_REPORT));
	dev_info(&gpu->dev, "the last page reference went; teardown goes on\n");
}

/**
 * fgds_gpu_teardown() - revoke everything and drop the page provider
 * @gpu: the GPU; no fgds lock held (its PCI device lock may be)
 *
 * Called when the GPU's driver unbinds, when the GPU is removed and at module
 * unload.
 */
void fgds_gpu_teardown(struct fgds_gpu *gpu)
{
	struct fgds_buf *buf;

	mutex_lock(&gpu->lock);
	WRITE_ONCE(gpu->refused, 0);
	if (gpu->mode == FGDS_MODE_NONE || gpu->tearing) {
		mutex_unlock(&gpu->lock);
		return;
	}
	gpu->tearing = true;
	gpu->gen++;
	mutex_lock(&gpu->bufs_lock);
	list_for_each_entry(buf, &gpu->bufs, gpu_node)
		fgds_buf_revoke(buf);
	mutex_unlock(&gpu->bufs_lock);
	mutex_unlock(&gpu->lock);

	fgds_gpu_wait_unheld(gpu);

	mutex_lock(&gpu->lock);
	fgds_gpu_drop_pages(gpu);
	gpu->tearing = false;
	mutex_unlock(&gpu->lock);
}

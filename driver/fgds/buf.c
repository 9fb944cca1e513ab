// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: registrations (dma-buf import) and their user mappings.
 *
 * Import follows the dma-buf locking convention and the model of RDMA's
 * pinned, revocable dma-buf umem (drivers/infiniband/core/umem_dmabuf.c):
 * dynamic attach with allow_peer2peer, then under dmabuf->resv dma_buf_pin()
 * and dma_buf_map_attachment(), and a wait for the exporter's kernel fences.
 * The invalidation callback (move_notify, invalidate_mappings in 7.x) is a
 * permanent revocation (revoke.c).
 *
 * fgds attaches as the GPU's own PCI device, so the exporter returns the
 * addresses at which the GPU reaches its own memory: the BAR's PCI bus
 * addresses (or, from a driver using dma_map_resource() without IOMMU
 * translation, the CPU physical addresses, which equal them on x86). For
 * vfio-pci, whose dma_buf_phys_vec_to_sgt() asks pci_p2pdma_map_type() of
 * the BAR's device and the attaching one, the same PCI function means
 * PCI_P2PDMA_MAP_BUS_ADDR, with or without an IOMMU: bus addresses. Every
 * segment must lie inside the GPU's BAR in bus address space; anything else,
 * such as an IOVA or system RAM, is refused. fgds never looks at sg_page():
 * the struct page of a segment is the ZONE_DEVICE page at the same offset of
 * the BAR. The DMA addresses themselves are never used for DMA: the block
 * layer maps the pages for the NVMe controller as it maps any user page
 * (through the P2PDMA distance check for P2PDMA pages).
 *
 * Long-term pins: P2PDMA pages cannot be pinned long-term (GUP refuses
 * FOLL_LONGTERM on them). GENERIC pages look like RAM to GUP, so their
 * mappings get a page_mkwrite handler: a shared writable mapping that wants
 * write notification "needs dirty tracking", and GUP refuses long-term
 * writable pins of such mappings (mm/gup.c writable_file_mapping_allowed()),
 * io_uring's fixed buffers included. The PTEs start read-only and the first
 * write to each page takes one more fault.
 */

#include <linux/capability.h>
#include <linux/cred.h>
#include <linux/dma-buf.h>
#include <linux/dma-resv.h>
#include <linux/fs.h>
#include <linux/huge_mm.h>
#include <linux/idr.h>
#include <linux/mm.h>
#include <linux/pagemap.h>
#include <linux/rcupdate.h>
#include <linux/sched/signal.h>
#include <linux/sched/user.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include <uapi/linux/fgds.h>

#include "fgds_compat.h"
#include "fgds_drv.h"

/* Pages mapped at once by a fault, beyond the faulting one. */
#define FGDS_FAULT_AROUND	511

/* Places of buffers in fgds_mapping (see fgds_buf_vm_pgoff()). */
static DEFINE_IDA(fgds_vm_ida);

/**
 * fgds_buf_extent() - the run of a registration that holds one of its pages
 * @buf: the registration
 * @pgoff: the page, counted from the registration's start
 *
 * The extents are sorted by @pgoff and cover the registration without gaps,
 * so a bisection finds the one: a request's cost does not grow with the
 * number of runs the exporter's memory came in.
 *
 * Return: the extent, or NULL for a @pgoff past the registration's end.
 */
const struct fgds_extent *fgds_buf_extent(const struct fgds_buf *buf,
					  pgoff_t pgoff)
{
	unsigned int lo = 0, hi = buf->nr_ext;

	while (lo < hi) {
		unsigned int mid = lo + (hi - lo) / 2;
		const struct fgds_extent *e = &buf->ext[mid];

		if (pgoff < e->pgoff)
			hi = mid;
		else if (pgoff >= e->pgoff + e->npages)
			lo = mid + 1;
		else
			return e;
	}
	return NULL;
}

static struct page *fgds_buf_page(struct fgds_buf *buf, pgoff_t pgoff,
				  pgoff_t *run)
{
	const struct fgds_extent *e = fgds_buf_extent(buf, pgoff);

	if (!e)
		return NULL;
	*run = e->pgoff + e->npages - pgoff;
	return fgds_gpu_page(buf->gpu, e->bar_pg + pgoff - e->pgoff);
}

static void fgds_invalidate(struct dma_buf_attachment *attach)
{
	struct fgds_buf *buf = attach->importer_priv;

	if (!buf->revoked)
		dev_info_ratelimited(&buf->gpu->dev,
				     "exporter invalidated a buffer of %s: revoked\n",
				     buf->owner);
	fgds_buf_revoke_locked(buf);
}

static const struct dma_buf_attach_ops fgds_attach_ops = {
	.allow_peer2peer = true,
	FGDS_ATTACH_OPS_INVALIDATE(fgds_invalidate),
};

/* RLIMIT_MEMLOCK, as io_uring and RDMA charge pinned memory. */
static int fgds_account(struct fgds_buf *buf)
{
	unsigned long limit, cur, new;

	if (capable(CAP_IPC_LOCK))
		return 0;
	limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	cur = atomic_long_read(&buf->user->locked_vm);
	do {
		new = cur + buf->npages;
		if (new > limit || new < cur) {
			dev_info_ratelimited(&buf->gpu->dev,
					     "%s: registering %llu bytes would exceed RLIMIT_MEMLOCK (%lu KiB locked, limit %lu KiB); raise it (ulimit -l, limits.conf) or grant CAP_IPC_LOCK\n",
					     buf->owner, buf->size,
					     cur << (PAGE_SHIFT - 10),
					     limit << (PAGE_SHIFT - 10));
			return -ENOMEM;
		}
	} while (!atomic_long_try_cmpxchg(&buf->user->locked_vm, &cur, new));
	buf->charged = true;
	return 0;
}

/**
 * fgds_buf_free() - free a registration that holds nothing any more
 * @buf: the registration: released, its pages quiet and given back, its
 *	dma-buf unpinned and unmapped
 */
void fgds_buf_free(struct fgds_buf *buf)
{
	struct fgds_dma_map *m;

	WARN_ON_ONCE(buf->holding || buf->pinned || buf->sgt);
	/* Killed @users are freed only once their RCU callback ended. */
	WARN_ON_ONCE(!fgds_buf_users_quiet(buf));
	while ((m = buf->dma_maps)) {
		WARN_ON_ONCE(m->pinned || m->sgt);
		buf->dma_maps = m->next;
		dma_buf_detach(buf->dmabuf, m->attach);
		pci_dev_put(m->pdev);
		kfree(m);
	}
	if (buf->attach)
		dma_buf_detach(buf->dmabuf, buf->attach);
	if (buf->dmabuf)
		dma_buf_put(buf->dmabuf);
	fgds_fence_discard(buf);
	if (buf->charged)
		atomic_long_sub(buf->npages, &buf->user->locked_vm);
	free_uid(buf->user);
	if (buf->vm_id > 0)
		ida_free(&fgds_vm_ida, buf->vm_id);
	put_device(&buf->gpu->dev);
	fgds_buf_users_exit(buf);
	kvfree(buf->ext);
	/* A lookup under RCU may still look at @ref (fgds_file_buf_get()). */
	kfree_rcu(buf, rcu);
}

/* Takes @npages off what @uid has registered on @gpu; gpu->bufs_lock held. */
static void fgds_user_pages_sub(struct fgds_gpu *gpu, unsigned long uid,
				unsigned long npages)
{
	void *entry = xa_load(&gpu->user_pages, uid);
	unsigned long pages = entry ? xa_to_value(entry) : 0;

	if (WARN_ON_ONCE(pages < npages) || pages == npages)
		xa_erase(&gpu->user_pages, uid);
	else
		/*
		 * Replaces the entry in its slot: no node is allocated
		 * (lib/xarray.c, xas_store() of a present index), so this
		 * cannot fail and leak the user's quota.
		 */
		WARN_ON_ONCE(xa_is_err(xa_store(&gpu->user_pages, uid,
						xa_mk_value(pages - npages),
						GFP_KERNEL)));
}

/* Drops what a registration counts against its GPU and user; bufs_lock held. */
static void fgds_buf_unlist(struct fgds_buf *buf)
{
	struct fgds_gpu *gpu = buf->gpu;

	lockdep_assert_held(&gpu->bufs_lock);
	list_del(&buf->gpu_node);
	buf->listed = false;
	gpu->nr_bufs--;
	gpu->nr_bytes -= buf->size;
	fgds_user_pages_sub(gpu, from_kuid(&init_user_ns, buf->uid),
			    buf->npages);
}

/*
 * The last registry entry or VMA is gone: no new PTE and no new pin can
 * appear. fgds_buf_let_go() releases the dma-buf now if the pages are quiet,
 * else once they are (without waiting here).
 */
static void fgds_buf_release(struct kref *ref)
{
	struct fgds_buf *buf = container_of(ref, struct fgds_buf, ref);
	struct fgds_gpu *gpu = buf->gpu;

	/* Not gpu->lock: this can run in munmap(), under the mmap lock. */
	mutex_lock(&gpu->bufs_lock);
	if (buf->listed)
		fgds_buf_unlist(buf);
	mutex_unlock(&gpu->bufs_lock);
	fgds_buf_let_go(buf);
}

void fgds_buf_put(struct fgds_buf *buf)
{
	kref_put(&buf->ref, fgds_buf_release);
}

static int fgds_reg_validate(const struct fgds_ioctl_reg_buffer *arg)
{
	u64 end;

	if (arg->flags || arg->dmabuf_fd < 0)
		return -EINVAL;
	if (!arg->size || !PAGE_ALIGNED(arg->size) ||
	    !PAGE_ALIGNED(arg->dmabuf_offset))
		return -EINVAL;
	if (arg->size >> PAGE_SHIFT > FGDS_MAX_BUF_PAGES)
		return -EINVAL;
	if (check_add_overflow(arg->dmabuf_offset, arg->size, &end))
		return -EOVERFLOW;
	return 0;
}

/*
 * Sets the provider up if needed (reading the BAR's geometry again); returns
 * its generation or an error, and in @geo the geometry the import is checked
 * against.
 */
static long fgds_gpu_prepare(struct fgds_gpu *gpu, struct fgds_geometry *geo)
{
	struct device *dev = &gpu->pdev->dev;
	long ret;

	ret = device_lock_interruptible(dev);
	if (ret)
		return ret;
	mutex_lock(&gpu->lock);
	if (gpu->dead || gpu->tearing)
		ret = -ENODEV;
	else
		ret = fgds_gpu_setup_pages(gpu);
	if (!ret)
		ret = gpu->gen & LONG_MAX;
	if (geo)
		*geo = gpu->geo;
	mutex_unlock(&gpu->lock);
	device_unlock(dev);
	return ret;
}

/*
 * Makes fgds's pages under the registration's extents (gpu.c), with the
 * locks a provider's set-up takes, if the provider is still the one of
 * generation @gen.
 */
static int fgds_gpu_make_buf_pages(struct fgds_buf *buf, long gen)
{
	struct fgds_gpu *gpu = buf->gpu;
	struct device *dev = &gpu->pdev->dev;
	int ret;

	ret = device_lock_interruptible(dev);
	if (ret)
		return ret;
	mutex_lock(&gpu->lock);
	if (gpu->dead || gpu->tearing || (gpu->gen & LONG_MAX) != gen)
		ret = -ENODEV;
	else
		ret = fgds_gpu_make_pages(gpu, buf->ext, buf->nr_ext);
	mutex_unlock(&gpu->lock);
	device_unlock(dev);
	return ret;
}

static int fgds_seg_to_bar(struct fgds_buf *buf, const struct fgds_geometry *geo,
			   dma_addr_t addr, u64 len, pgoff_t *bar_pg)
{
	u64 off = addr - geo->bus;

	if (!PAGE_ALIGNED(addr) || !PAGE_ALIGNED(len) || addr < geo->bus ||
	    off >= geo->len || len > geo->len - off) {
		dev_err(&buf->gpu->dev,
			"dma-buf segment %pad+%#llx is not page aligned inside BAR %d (bus %#llx+%pa): not memory of this GPU, refused\n",
			&addr, len, geo->bar, (u64)geo->bus, &geo->len);
		return -EINVAL;
	}
	*bar_pg = off >> PAGE_SHIFT;
	return 0;
}

/*
 * Turns the part [offset, offset + size) of the exporter's mapping into runs
 * of BAR pages, merging runs that are contiguous in the BAR. dmabuf->resv held.
 */
static int fgds_buf_build_extents(struct fgds_buf *buf,
				  const struct fgds_geometry *geo, u64 offset)
{
	struct sg_table *sgt = buf->sgt;
	u64 skip = offset, want = buf->size;
	struct fgds_extent *e = NULL;
	struct scatterlist *sg;
	pgoff_t pgoff = 0, bar_pg;
	int i, ret;

	buf->ext = kvcalloc(max(sgt->nents, 1U), sizeof(*buf->ext), GFP_KERNEL);
	if (!buf->ext)
		return -ENOMEM;

	for_each_sgtable_dma_sg(sgt, sg, i) {
		dma_addr_t addr = sg_dma_address(sg);
		u64 len = sg_dma_len(sg);

		if (skip >= len) {
			skip -= len;
			continue;
		}
		addr += skip;
		len = min(len - skip, want);
		skip = 0;
		ret = fgds_seg_to_bar(buf, geo, addr, len, &bar_pg);
		if (ret)
			return ret;
		if (e && e->bar_pg + e->npages == bar_pg) {
			e->npages += len >> PAGE_SHIFT;
		} else {
			e = &buf->ext[buf->nr_ext++];
			e->pgoff = pgoff;
			e->bar_pg = bar_pg;
			e->npages = len >> PAGE_SHIFT;
		}
		pgoff += len >> PAGE_SHIFT;
		want -= len;
		if (!want)
			return 0;
	}
	dev_err(&buf->gpu->dev, "dma-buf mapping shorter than its size\n");
	return -EINVAL;
}

/* Pins and maps the dma-buf and finds the buffer in the BAR. */
static int fgds_buf_import(struct fgds_buf *buf,
			   const struct fgds_geometry *geo, u64 offset)
{
	struct dma_resv *resv = buf->dmabuf->resv;
	struct sg_table *sgt;
	long ret;

	buf->attach = dma_buf_dynamic_attach(buf->dmabuf, &buf->gpu->pdev->dev,
					     &fgds_attach_ops, buf);
	if (IS_ERR(buf->attach)) {
		ret = PTR_ERR(buf->attach);
		buf->attach = NULL;
		dev_err_ratelimited(&buf->gpu->dev,
				    "%s: the exporter refused the attachment: %ld\n",
				    buf->owner, ret);
		return ret;
	}

	ret = dma_resv_lock_interruptible(resv, NULL);
	if (ret)
		return ret;
	if (buf->revoked) {
		ret = -ENODEV;
		goto out_unlock;
	}
	ret = dma_buf_pin(buf->attach);
	if (ret)
		goto out_unlock;
	buf->pinned = true;

	sgt = dma_buf_map_attachment(buf->attach, fgds_buf_dma_dir(buf));
	if (IS_ERR(sgt)) {
		ret = PTR_ERR(sgt);
		goto out_unlock;
	}
	buf->sgt = sgt;

	/* The mapping is valid, the content may still be on its way. */
	ret = dma_resv_wait_timeout(resv, DMA_RESV_USAGE_KERNEL, true,
				    MAX_SCHEDULE_TIMEOUT);
	if (ret < 0)
		goto out_unlock;

	ret = fgds_buf_build_extents(buf, geo, offset);

out_unlock:
	dma_resv_unlock(resv);
	return ret;
}

/**
 * fgds_buf_dma_mapped() - is a registration mapped for a DMA device?
 * @buf: the registration (a live @users reference held)
 * @pdev: the device that will do the DMA of one of fgds's reads or writes
 *
 * Return: true once fgds_buf_dma_attach() mapped it for @pdev.
 */
bool fgds_buf_dma_mapped(struct fgds_buf *buf, struct pci_dev *pdev)
{
	struct fgds_dma_map *m;

	/* Pairs with the release in fgds_buf_dma_attach(): @m is complete. */
	for (m = smp_load_acquire(&buf->dma_maps); m; m = m->next)
		if (m->pdev == pdev)
			return true;
	return false;
}

/**
 * fgds_buf_dma_attach() - have the exporter map a registration for the
 *	device that will do the DMA of fgds's reads and writes
 * @buf: the registration (reference held, no @users reference: an exporter
 *	may hold the reservation lock while it waits for a revocation, which
 *	waits for @users)
 * @pdev: the device, which the gate admitted
 *
 * The dma-buf rule is that the device doing the DMA is the importer, so the
 * exporter judges its path (vfio-pci and vgpu: pci_p2pdma_map_type()).
 * fgds's pages stay what it hands the block layer, which maps them for
 * @pdev itself; the mapping made here is held, as the GPU's own is, until
 * the registration's pages are quiet after a revocation or its release, and
 * dropped with it. Made once per device and registration.
 *
 * Return: 0, -EREMOTEIO where the exporter refused @pdev (logged), -ENODEV
 * if @buf was revoked, or -ENOMEM.
 */
int fgds_buf_dma_attach(struct fgds_buf *buf, struct pci_dev *pdev)
{
	struct dma_resv *resv = buf->dmabuf->resv;
	struct dma_buf_attachment *attach;
	struct fgds_dma_map *m, *old;
	struct sg_table *sgt;
	int ret;

	m = kzalloc(sizeof(*m), GFP_KERNEL);
	if (!m)
		return -ENOMEM;
	attach = dma_buf_dynamic_attach(buf->dmabuf, &pdev->dev,
					&fgds_attach_ops, buf);
	if (IS_ERR(attach)) {
		ret = PTR_ERR(attach);
		dev_info_ratelimited(&buf->gpu->dev,
				     "%s: the exporter refused an attachment as %s, which would do the DMA (%d): it cannot reach this memory; go through RAM\n",
				     buf->owner, pci_name(pdev), ret);
		kfree(m);
		return ret == -ENOMEM || ret == -ENODEV ? ret : -EREMOTEIO;
	}
	m->pdev = pci_dev_get(pdev);
	m->attach = attach;

	ret = dma_resv_lock_interruptible(resv, NULL);
	if (ret)
		goto err_detach;
	ret = -ENODEV;
	if (buf->revoked)
		goto err_unlock;
	for (old = buf->dma_maps; old; old = old->next)
		if (old->pdev == pdev)
			break;
	ret = 0;
	if (old)	/* Another call got there first. */
		goto err_unlock;
	ret = dma_buf_pin(attach);
	if (ret)
		goto err_unlock;
	m->pinned = true;
	sgt = dma_buf_map_attachment(attach, fgds_buf_dma_dir(buf));
	if (IS_ERR(sgt)) {
		ret = PTR_ERR(sgt);
		dev_info_ratelimited(&buf->gpu->dev,
				     "%s: the exporter refused a mapping for %s, which would do the DMA (%d): it cannot reach this memory; go through RAM\n",
				     buf->owner, pci_name(pdev), ret);
		if (ret != -ENOMEM && ret != -ENODEV)
			ret = -EREMOTEIO;
		dma_buf_unpin(attach);
		goto err_unlock;
	}
	m->sgt = sgt;
	m->next = buf->dma_maps;
	/* Pairs with the acquire in fgds_buf_dma_mapped(). */
	smp_store_release(&buf->dma_maps, m);
	dma_resv_unlock(resv);
	return 0;

err_unlock:
	dma_resv_unlock(resv);
err_detach:
	dma_buf_detach(buf->dmabuf, attach);
	pci_dev_put(m->pdev);
	kfree(m);
	return ret;
}

/**
 * fgds_dma_map_drop() - unmap and unpin a registration's mapping for a DMA
 *	device
 * @buf: the registration; dmabuf->resv held
 * @m: one of its @dma_maps, kept on the list (and attached) until @buf goes
 *
 * Only once no DMA of that device can reach the memory: @buf's pages are
 * quiet, or the device's driver was unbound.
 */
void fgds_dma_map_drop(struct fgds_buf *buf, struct fgds_dma_map *m)
{
	dma_resv_assert_held(buf->dmabuf->resv);
	if (m->sgt)
		dma_buf_unmap_attachment(m->attach, m->sgt,
					 fgds_buf_dma_dir(buf));
	m->sgt = NULL;
	if (m->pinned)
		dma_buf_unpin(m->attach);
	m->pinned = false;
}

/**
 * fgds_gpu_forget_dma_dev() - drop the mappings made for a device whose
 *	driver is gone
 * @gpu: a GPU (reference held)
 * @pdev: a PCI device whose driver was unbound: its I/O has ended, and its
 *	DMA mappings must go before the device itself does (the IOMMU group)
 *
 * Registrations released but not yet quiet are off @gpu->bufs: theirs go
 * when they do.
 */
void fgds_gpu_forget_dma_dev(struct fgds_gpu *gpu, struct pci_dev *pdev)
{
	struct fgds_dma_map *m;
	struct fgds_buf *buf;

	mutex_lock(&gpu->bufs_lock);
	list_for_each_entry(buf, &gpu->bufs, gpu_node) {
		dma_resv_lock(buf->dmabuf->resv, NULL);
		for (m = buf->dma_maps; m; m = m->next)
			if (m->pdev == pdev)
				fgds_dma_map_drop(buf, m);
		dma_resv_unlock(buf->dmabuf->resv);
	}
	mutex_unlock(&gpu->bufs_lock);
}

/*
 * Whether a mapping whose start puts the first extent on a folio boundary puts
 * every extent on one: then 2 MiB folios can be mapped with PMDs.
 */
static bool fgds_buf_pmd_ok(struct fgds_buf *buf, unsigned int order)
{
	pgoff_t phase = (buf->ext[0].bar_pg - buf->ext[0].pgoff) &
			((1UL << order) - 1);
	unsigned int e;

	if (!order || buf->npages < (1UL << order))
		return false;
	for (e = 1; e < buf->nr_ext; e++)
		if (((buf->ext[e].bar_pg - buf->ext[e].pgoff) &
		     ((1UL << order) - 1)) != phase)
			return false;
	return true;
}

/* The per-user share of the GPU; gpu->bufs_lock held. */
static int fgds_user_share(struct fgds_buf *buf)
{
	struct fgds_gpu *gpu = buf->gpu;
	unsigned long uid = from_kuid(&init_user_ns, buf->uid);
	void *entry = xa_load(&gpu->user_pages, uid);
	unsigned long pages = entry ? xa_to_value(entry) : 0;

	if ((u64)(pages + buf->npages) << PAGE_SHIFT > fgds_max_bytes_per_user) {
		dev_info_ratelimited(&gpu->dev,
				     "%s: uid %lu would have more than max_bytes_per_user (%llu) registered on this GPU\n",
				     buf->owner, uid, fgds_max_bytes_per_user);
		return -ENOSPC;
	}
	return xa_err(xa_store(&gpu->user_pages, uid,
			       xa_mk_value(pages + buf->npages), GFP_KERNEL));
}

/* Takes the page references and accounts the buffer on its GPU. */
static int fgds_buf_publish(struct fgds_buf *buf, unsigned long gen)
{
	struct fgds_gpu *gpu = buf->gpu;
	unsigned int e;
	int ret = 0;

	mutex_lock(&gpu->lock);
	if (gpu->dead || gpu->tearing || (gpu->gen & LONG_MAX) != gen ||
	    READ_ONCE(buf->revoked)) {
		ret = -ENODEV;
		goto out;
	}
	for (e = 0; e < buf->nr_ext && !ret; e++)
		ret = fgds_gpu_check_range(gpu, buf->ext[e].bar_pg,
					   buf->ext[e].npages);
	if (ret)
		goto out;
	mutex_lock(&gpu->bufs_lock);
	if (gpu->nr_bytes + buf->size > fgds_max_bytes_per_gpu) {
		dev_info_ratelimited(&gpu->dev,
				     "%s: the GPU would have more than max_bytes_per_gpu (%llu) registered\n",
				     buf->owner, fgds_max_bytes_per_gpu);
		ret = -ENOSPC;
		goto out_bufs;
	}
	ret = fgds_user_share(buf);
	if (ret)
		goto out_bufs;
	ret = fgds_holds_get(gpu, buf->ext, buf->nr_ext);
	if (ret) {
		fgds_user_pages_sub(gpu, from_kuid(&init_user_ns, buf->uid),
				    buf->npages);
		goto out_bufs;
	}
	buf->holding = true;
	buf->owned = gpu->mode == FGDS_MODE_P2PDMA ||
		     gpu->mode == FGDS_MODE_GENERIC;
	buf->wp_notify = FGDS_WRITENOTIFY_REFUSES_LONGTERM &&
			 gpu->mode == FGDS_MODE_GENERIC;
	buf->pmd_ok = fgds_buf_pmd_ok(buf, gpu->order);
	list_add_tail(&buf->gpu_node, &gpu->bufs);
	buf->listed = true;
	gpu->nr_bufs++;
	gpu->nr_bytes += buf->size;
out_bufs:
	mutex_unlock(&gpu->bufs_lock);
out:
	mutex_unlock(&gpu->lock);
	return ret;
}

static struct fgds_buf *fgds_buf_alloc(struct fgds_file *f, u64 size)
{
	struct fgds_gpu *gpu = f->gpu;
	struct fgds_buf *buf;

	buf = kzalloc(sizeof(*buf), GFP_KERNEL);
	if (!buf)
		return NULL;
	if (fgds_buf_users_init(buf)) {
		kfree(buf);
		return NULL;
	}
	kref_init(&buf->ref);
	init_rwsem(&buf->lock);
	INIT_LIST_HEAD(&buf->gpu_node);
	INIT_LIST_HEAD(&buf->pending_node);
	INIT_WORK(&buf->cleanup, fgds_cleanup_fn);
	get_device(&gpu->dev);
	buf->gpu = gpu;
	buf->mapping = f->mapping;
	buf->size = size;
	buf->npages = size >> PAGE_SHIFT;
	buf->user = get_uid(current_user());
	buf->uid = current_uid();
	snprintf(buf->owner, sizeof(buf->owner), "%s[%d]", current->comm,
		 task_tgid_nr(current));
	return buf;
}

static struct fgds_buf *fgds_buf_create(struct fgds_file *f,
					const struct fgds_ioctl_reg_buffer *arg)
{
	struct fgds_gpu *gpu = f->gpu;
	struct fgds_geometry geo;
	struct fgds_buf *buf;
	long gen;
	int ret;

	buf = fgds_buf_alloc(f, arg->size);
	if (!buf)
		return ERR_PTR(-ENOMEM);
	ret = fgds_fence_prepare(buf);
	if (ret)
		goto err;
	buf->vm_id = ida_alloc_range(&fgds_vm_ida, 1, FGDS_VM_IDS - 1,
				     GFP_KERNEL);
	if (buf->vm_id < 0) {
		ret = buf->vm_id == -ENOSPC ? -EMFILE : buf->vm_id;
		goto err;
	}

	buf->dmabuf = dma_buf_get(arg->dmabuf_fd);
	if (IS_ERR(buf->dmabuf)) {
		ret = PTR_ERR(buf->dmabuf);
		buf->dmabuf = NULL;
		goto err;
	}
	if (arg->dmabuf_offset + arg->size > buf->dmabuf->size) {
		ret = -EINVAL;
		goto err;
	}
	buf->readonly = !(buf->dmabuf->file->f_mode & FMODE_WRITE);
	ret = fgds_account(buf);
	if (ret)
		goto err;

	/*
	 * The provider first (it reads the BAR's geometry), then what the
	 * exporter hands out, so that memory not in the BAR gets EINVAL
	 * whatever the provider's fate.
	 */
	gen = fgds_gpu_prepare(gpu, &geo);
	if (gen == -EINTR || gen == -ERESTARTSYS) {
		ret = gen;
		goto err;
	}
	ret = fgds_buf_import(buf, &geo, arg->dmabuf_offset);
	if (ret)
		goto err;
	if (gen < 0) {
		ret = gen;
		goto err;
	}
	ret = fgds_gpu_make_buf_pages(buf, gen);
	if (ret)
		goto err;
	ret = fgds_buf_publish(buf, gen);
	if (ret)
		goto err;
	return buf;

err:
	fgds_buf_put(buf);
	return ERR_PTR(ret);
}

static long fgds_ioctl_reg(struct fgds_file *f, void __user *uarg)
{
	struct fgds_ioctl_reg_buffer arg;
	struct fgds_buf *buf;
	bool full;
	u32 id;
	int ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	ret = fgds_reg_validate(&arg);
	if (ret)
		return ret;

	mutex_lock(&f->lock);
	full = f->nr >= fgds_max_buffers_per_file;
	mutex_unlock(&f->lock);
	if (full)
		return -EMFILE;

	buf = fgds_buf_create(f, &arg);
	if (IS_ERR(buf))
		return PTR_ERR(buf);

	mutex_lock(&f->lock);
	if (f->nr >= fgds_max_buffers_per_file)
		ret = -EMFILE;
	else
		ret = xa_alloc(&f->bufs, &id, buf, XA_LIMIT(1, U32_MAX >> 1),
			       GFP_KERNEL);
	if (!ret)
		f->nr++;
	mutex_unlock(&f->lock);
	if (ret) {
		fgds_buf_put(buf);
		return ret == -EBUSY ? -EMFILE : ret;
	}

	arg.idx = (u64)id << PAGE_SHIFT;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		mutex_lock(&f->lock);
		xa_erase(&f->bufs, id);
		f->nr--;
		mutex_unlock(&f->lock);
		fgds_buf_put(buf);
		return -EFAULT;
	}
	return 0;
}

static long fgds_ioctl_unreg(struct fgds_file *f, void __user *uarg)
{
	struct fgds_ioctl_unreg_buffer arg;
	struct fgds_buf *buf = NULL;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (!PAGE_ALIGNED(arg.idx))
		return -EINVAL;
	if (arg.idx >> PAGE_SHIFT <= U32_MAX) {
		mutex_lock(&f->lock);
		buf = xa_erase(&f->bufs, arg.idx >> PAGE_SHIFT);
		if (buf)
			f->nr--;
		mutex_unlock(&f->lock);
	}
	if (!buf)
		return -ENOENT;
	fgds_buf_put(buf);
	return 0;
}

static long fgds_ioctl(struct file *filp, unsigned int cmd, unsigned long arg)
{
	struct fgds_file *f = filp->private_data;

	switch (cmd) {
	case FGDS_IOCTL_REG_BUFFER:
		return fgds_ioctl_reg(f, (void __user *)arg);
	case FGDS_IOCTL_UNREG_BUFFER:
		return fgds_ioctl_unreg(f, (void __user *)arg);
	case FGDS_IOCTL_READ:
		return fgds_ioctl_io(f, (void __user *)arg, false);
	case FGDS_IOCTL_WRITE:
		return fgds_ioctl_io(f, (void __user *)arg, true);
	case FGDS_IOCTL_CHECK_FILE:
		return fgds_ioctl_check_file(f, (void __user *)arg);
	default:
		return -ENOTTY;
	}
}

/**
 * fgds_file_buf_get() - a registration of an open file, by token
 * @f: the open file
 * @id: the token in pages (token >> PAGE_SHIFT)
 *
 * Return: the registration with a reference held, or NULL if @f has none
 * with this token.
 */
struct fgds_buf *fgds_file_buf_get(struct fgds_file *f, unsigned long id)
{
	struct fgds_buf *buf = NULL;

	if (id > U32_MAX)
		return NULL;
	/*
	 * Every read and write looks its registration up: no lock. The entry
	 * holds a reference, so one found here is released only once it left
	 * the registry, and freed a grace period after that (fgds_buf_free());
	 * one whose last reference already went is not taken again.
	 */
	rcu_read_lock();
	buf = xa_load(&f->bufs, id);
	if (buf) {
		fgds_lookup_window();
		if (!kref_get_unless_zero(&buf->ref))
			buf = NULL;
	}
	rcu_read_unlock();
	return buf;
}

static vm_fault_t fgds_errno_to_fault(int err)
{
	switch (err) {
	case 0:
	case -EBUSY:	/* raced with another fault */
		return VM_FAULT_NOPAGE;
	case -ENOMEM:
		return VM_FAULT_OOM;
	default:
		return VM_FAULT_SIGBUS;
	}
}

/*
 * Records where a page of fgds's own is mapped (@linear: its index in the
 * mapping), so that rmap walks of fgds_mapping find its VMAs. A page covered
 * by overlapping registrations keeps the index of the last one that mapped it.
 */
static void fgds_set_index(struct fgds_buf *buf, struct page *page,
			   pgoff_t linear)
{
	struct folio *folio = page_folio(page);

	if (buf->owned)
		fgds_folio_set_index(folio,
				     linear - folio_page_idx(folio, page));
}

/*
 * Inserts the faulting page, then, in a VM_MIXEDMAP VMA, up to
 * FGDS_FAULT_AROUND following pages of the same run and VMA, so that GUP of a
 * large O_DIRECT buffer does not fault page by page. The pages are the GPU's
 * ZONE_DEVICE pages, inserted as normal (not special) PTEs so that GUP can
 * pin them. A VMA mapped with PMDs (fgds_buf_maps_pmd()) has no VM_MIXEDMAP,
 * which vm_insert_page() needs; it gets one page per fault here, and whole
 * folios from fgds_vm_huge_fault().
 */
static vm_fault_t fgds_vm_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct fgds_buf *buf = vma->vm_private_data;
	pgoff_t base = fgds_buf_vm_pgoff(buf);
	unsigned long addr = vmf->address;
	pgoff_t pgoff, run = 0, n, i;
	struct page *page;
	vm_fault_t ret;
	int err;

	if (vmf->pgoff < base || vmf->pgoff - base >= buf->npages)
		return VM_FAULT_SIGBUS;
	pgoff = vmf->pgoff - base;

	down_read(&buf->lock);
	if (buf->revoked) {
		ret = VM_FAULT_SIGBUS;
		goto out;
	}
	page = fgds_buf_page(buf, pgoff, &run);
	if (WARN_ON_ONCE(!page)) {
		ret = VM_FAULT_SIGBUS;
		goto out;
	}
	fgds_set_index(buf, page, vmf->pgoff);
#ifdef FGDS_FOLIO_PMD
	if (!(vma->vm_flags & VM_MIXEDMAP)) {
		ret = vmf_insert_page_mkwrite(vmf, page,
					      vmf->flags & FAULT_FLAG_WRITE);
		goto out;
	}
#endif
	err = vm_insert_page(vma, addr, page);
	ret = fgds_errno_to_fault(err);
	if (err)
		goto out;

	n = min3(run - 1, (pgoff_t)FGDS_FAULT_AROUND,
		 (pgoff_t)((vma->vm_end - addr) >> PAGE_SHIFT) - 1);
	for (i = 1; i <= n; i++) {
		fgds_set_index(buf, page + i, vmf->pgoff + i);
		if (vm_insert_page(vma, addr + i * PAGE_SIZE, page + i))
			break;
	}
out:
	up_read(&buf->lock);
	return ret;
}

/*
 * GENERIC pages: the first write to a page through a mapping. Nothing to
 * track; the handler exists so that GUP refuses long-term writable pins.
 */
static vm_fault_t fgds_vm_page_mkwrite(struct vm_fault *vmf)
{
	struct fgds_buf *buf = vmf->vma->vm_private_data;
	struct folio *folio = page_folio(vmf->page);
	bool revoked;

	folio_lock(folio);
	down_read(&buf->lock);
	revoked = buf->revoked;
	up_read(&buf->lock);
	if (revoked) {
		folio_unlock(folio);
		return VM_FAULT_SIGBUS;
	}
	return VM_FAULT_LOCKED;
}

#ifdef FGDS_FOLIO_PMD
/*
 * Maps a whole 2 MiB folio with one PMD where the VMA and the buffer allow
 * it; anything else falls back to fgds_vm_fault(), which also answers a
 * revoked buffer with SIGBUS. Never in a VM_MIXEDMAP VMA (a mapping made at
 * an address that did not suit PMDs, or moved by mremap() since): the kernel
 * zaps and splits the huge PMDs of such a VMA as special ones, without
 * dropping their folio references.
 */
static vm_fault_t fgds_vm_huge_fault(struct vm_fault *vmf, unsigned int order)
{
	struct vm_area_struct *vma = vmf->vma;
	struct fgds_buf *buf = vma->vm_private_data;
	unsigned long haddr = vmf->address & PMD_MASK;
	vm_fault_t ret = VM_FAULT_FALLBACK;
	pgoff_t pgoff, linear, run = 0;
	struct folio *folio;
	struct page *page;

	if (order != PMD_ORDER || (vma->vm_flags & VM_MIXEDMAP) ||
	    haddr < vma->vm_start || haddr + PMD_SIZE > vma->vm_end)
		return VM_FAULT_FALLBACK;
	linear = linear_page_index(vma, haddr);
	if (linear < fgds_buf_vm_pgoff(buf))
		return VM_FAULT_FALLBACK;
	pgoff = linear - fgds_buf_vm_pgoff(buf);

	down_read(&buf->lock);
	if (buf->revoked)
		goto out;
	page = fgds_buf_page(buf, pgoff, &run);
	if (!page || run < HPAGE_PMD_NR)
		goto out;
	folio = page_folio(page);
	if (folio_order(folio) != PMD_ORDER || &folio->page != page)
		goto out;
	fgds_set_index(buf, page, linear);
	ret = vmf_insert_folio_pmd(vmf, folio, vmf->flags & FAULT_FLAG_WRITE);
out:
	up_read(&buf->lock);
	return ret;
}
#endif

/*
 * Whether a new VMA of @buf gets PMD mappings: GENERIC 2 MiB folios, and a
 * start address that puts every extent's folio boundaries on 2 MiB ones
 * (fgds_get_unmapped_area() chooses such addresses).
 */
static bool fgds_buf_maps_pmd(struct fgds_buf *buf, struct vm_area_struct *vma)
{
#ifdef FGDS_FOLIO_PMD
	return buf->pmd_ok &&
	       IS_ALIGNED((vma->vm_start >> PAGE_SHIFT) - buf->ext[0].bar_pg,
			  HPAGE_PMD_NR);
#else
	return false;
#endif
}

static void fgds_vm_open(struct vm_area_struct *vma)
{
	struct fgds_buf *buf = vma->vm_private_data;

	kref_get(&buf->ref);
}

static void fgds_vm_close(struct vm_area_struct *vma)
{
	fgds_buf_put(vma->vm_private_data);
}

static const struct vm_operations_struct fgds_vm_ops = {
	.open = fgds_vm_open,
	.close = fgds_vm_close,
	.fault = fgds_vm_fault,
#ifdef FGDS_FOLIO_PMD
	.huge_fault = fgds_vm_huge_fault,
#endif
};

/* GENERIC pages: as fgds_vm_ops, and no long-term writable pin. */
static const struct vm_operations_struct fgds_vm_ops_wp = {
	.open = fgds_vm_open,
	.close = fgds_vm_close,
	.fault = fgds_vm_fault,
	.page_mkwrite = fgds_vm_page_mkwrite,
#ifdef FGDS_FOLIO_PMD
	.huge_fault = fgds_vm_huge_fault,
#endif
};

/*
 * The offset chosen by the caller is the token; once found, the VMA is moved
 * to the buffer's own place in the file's address_space
 * (fgds_buf_vm_pgoff()), so that unmap_mapping_range() at revocation reaches
 * every mapping of this buffer and nothing else, in every process (fork
 * copies the PTEs, and the copies are in the same address_space). Tokens are
 * small integers, buffers span many pages: at the token offsets they would
 * overlap.
 */
static int fgds_mmap(struct file *filp, struct vm_area_struct *vma)
{
	struct fgds_file *f = filp->private_data;
	struct fgds_buf *buf;
	int ret;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	buf = fgds_file_buf_get(f, vma->vm_pgoff);
	if (!buf)
		return -ENOENT;

	if (vma->vm_end - vma->vm_start != buf->size) {
		ret = -EINVAL;
		goto err;
	}
	if (READ_ONCE(buf->revoked)) {
		ret = -ENODEV;
		goto err;
	}
	/* A dma-buf opened read-only gives a mapping that stays read-only. */
	if (buf->readonly) {
		if (vma->vm_flags & VM_WRITE) {
			ret = -EACCES;
			goto err;
		}
		fgds_vm_flags_clear(vma, VM_MAYWRITE);
	}

	fgds_vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP);
	if (fgds_buf_maps_pmd(buf, vma))
		fgds_vm_flags_set(vma, VM_HUGEPAGE);
	else
		fgds_vm_flags_set(vma, VM_MIXEDMAP);
	vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	vma->vm_pgoff = fgds_buf_vm_pgoff(buf);
	vma->vm_private_data = buf;
	vma->vm_ops = buf->wp_notify ? &fgds_vm_ops_wp : &fgds_vm_ops;
	return 0;

err:
	fgds_buf_put(buf);
	return ret;
}

#ifdef FGDS_FOLIO_PMD
/*
 * Places a mapping so that the buffer's 2 MiB folios start on 2 MiB virtual
 * boundaries, as device-dax does. mmap() passes the token as pgoff; the
 * alignment follows the buffer's first BAR page.
 */
static unsigned long fgds_get_unmapped_area(struct file *filp,
					    unsigned long addr,
					    unsigned long len,
					    unsigned long pgoff,
					    unsigned long flags)
{
	struct fgds_file *f = filp->private_data;
	pgoff_t bar_pg = 0;
	struct fgds_buf *buf;

	if (pgoff <= U32_MAX) {
		mutex_lock(&f->lock);
		buf = xa_load(&f->bufs, pgoff);
		if (buf)
			bar_pg = buf->ext[0].bar_pg;
		mutex_unlock(&f->lock);
	}
	return thp_get_unmapped_area(filp, addr, len, bar_pg, flags);
}
#endif

static int fgds_open(struct inode *inode, struct file *filp)
{
	struct fgds_gpu *gpu = container_of(inode->i_cdev, struct fgds_gpu,
					    cdev);
	struct fgds_file *f;
	bool dead;

	mutex_lock(&gpu->lock);
	dead = gpu->dead;
	mutex_unlock(&gpu->lock);
	if (dead)
		return -ENODEV;

	f = kzalloc(sizeof(*f), GFP_KERNEL);
	if (!f)
		return -ENOMEM;
	get_device(&gpu->dev);
	f->gpu = gpu;
	/* As device-dax: the VMAs sit in the mapping their pages point to. */
	filp->f_mapping = fgds_mapping;
	f->mapping = fgds_mapping;
	mutex_init(&f->lock);
	xa_init_flags(&f->bufs, XA_FLAGS_ALLOC1);
	filp->private_data = f;
	/*
	 * The page provider belongs to the GPU and its driver's bind, not to a
	 * buffer: set it up on open, so that REG_BUFFER does no memory hotplug.
	 * A failure is logged where it happens and left to REG_BUFFER, which
	 * tries again or returns the refusal.
	 */
	if (READ_ONCE(gpu->pdev->dev.driver))
		fgds_gpu_prepare(gpu, NULL);
	return 0;
}

static int fgds_release(struct inode *inode, struct file *filp)
{
	struct fgds_file *f = filp->private_data;
	struct fgds_buf *buf;
	unsigned long id;

	xa_for_each(&f->bufs, id, buf) {
		xa_erase(&f->bufs, id);
		fgds_buf_put(buf);
	}
	xa_destroy(&f->bufs);
	mutex_destroy(&f->lock);
	put_device(&f->gpu->dev);
	kfree(f);
	return 0;
}

const struct file_operations fgds_fops = {
	.owner = THIS_MODULE,
	.open = fgds_open,
	.release = fgds_release,
	.unlocked_ioctl = fgds_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
	.mmap = fgds_mmap,
	.uring_cmd = fgds_uring_cmd,
#ifdef FGDS_FOLIO_PMD
	.get_unmapped_area = fgds_get_unmapped_area,
#endif
	.llseek = noop_llseek,
};

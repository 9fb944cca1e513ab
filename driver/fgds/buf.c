// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: registrations (dma-buf import), their user mappings, revocation.
 *
 * Import follows the dma-buf locking convention and the model of RDMA's
 * pinned, revocable dma-buf umem (drivers/infiniband/core/umem_dmabuf.c):
 * dynamic attach with allow_peer2peer, then under dmabuf->resv dma_buf_pin()
 * and dma_buf_map_attachment(), and a wait for the exporter's kernel fences.
 * The invalidation callback (move_notify, invalidate_mappings in 7.x) is a
 * permanent revocation.
 *
 * fgds attaches as the GPU's own PCI device, so the exporter returns the
 * addresses at which the GPU reaches its own memory: the BAR's PCI bus
 * addresses (or, from a driver using dma_map_resource() without IOMMU
 * translation, the CPU physical addresses, which equal them on x86). Every
 * segment must lie inside the GPU's BAR in bus address space; anything else,
 * such as an IOVA or system RAM, is refused. fgds never looks at sg_page():
 * the struct page of a segment is the ZONE_DEVICE page at the same offset of
 * the BAR. The DMA addresses themselves are never used for DMA: the block
 * layer maps the pages for the NVMe controller as it maps any user page
 * (through the P2PDMA distance check for P2PDMA pages).
 */

#include <linux/dma-buf.h>
#include <linux/dma-resv.h>
#include <linux/delay.h>
#include <linux/fs.h>
#include <linux/huge_mm.h>
#include <linux/mm.h>
#include <linux/pagemap.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include <uapi/linux/fgds.h>

#include "fgds_compat.h"
#include "fgds_drv.h"

/* Pages mapped at once by a fault, beyond the faulting one. */
#define FGDS_FAULT_AROUND	511

/* Place of each buffer in its file's address_space (see fgds_mmap()). */
static atomic64_t fgds_next_vm_pgoff = ATOMIC64_INIT(1);

static struct page *fgds_buf_page(struct fgds_buf *buf, pgoff_t pgoff,
				  pgoff_t *run)
{
	unsigned int lo = 0, hi = buf->nr_ext;
	const struct fgds_extent *e;

	while (lo < hi) {
		unsigned int mid = lo + (hi - lo) / 2;

		e = &buf->ext[mid];
		if (pgoff < e->pgoff) {
			hi = mid;
		} else if (pgoff >= e->pgoff + e->npages) {
			lo = mid + 1;
		} else {
			*run = e->pgoff + e->npages - pgoff;
			return fgds_gpu_page(buf->gpu,
					     e->bar_pg + pgoff - e->pgoff);
		}
	}
	return NULL;
}

static bool fgds_buf_wait_quiet(struct fgds_buf *buf)
{
	unsigned long deadline = jiffies +
				 msecs_to_jiffies(fgds_revoke_timeout_ms);
	unsigned int us = 50;

	while (!fgds_pages_quiet(buf->gpu, buf->ext, buf->nr_ext)) {
		if (time_after(jiffies, deadline))
			return false;
		usleep_range(us, 2 * us);
		us = min(us * 2, 20000U);
	}
	return true;
}

/*
 * Revokes a registration; dmabuf->resv held. @zap: user mappings may exist.
 * No new PTE can appear once buf->revoked is set under buf->lock (the fault
 * handler checks it under the same lock), so after the zap only pins of I/O
 * in flight can reach the pages: wait for them, then give the mapping back.
 */
static void fgds_buf_revoke_locked(struct fgds_buf *buf, bool zap)
{
	bool was_revoked;

	dma_resv_assert_held(buf->dmabuf->resv);

	down_write(&buf->lock);
	was_revoked = buf->revoked;
	buf->revoked = true;
	up_write(&buf->lock);

	/* A released buffer (buf->mapping NULL) has no mapping left to zap. */
	if (zap && !was_revoked && buf->mapping)
		unmap_mapping_range(buf->mapping,
				    (loff_t)buf->vm_pgoff << PAGE_SHIFT,
				    buf->size, 1);

	if (buf->holding && !fgds_buf_wait_quiet(buf))
		dev_err_ratelimited(&buf->gpu->dev,
				    "I/O into a revoked buffer still in flight after %u ms; its pages stay held until it ends\n",
				    fgds_revoke_timeout_ms);

	if (buf->sgt) {
		dma_buf_unmap_attachment(buf->attach, buf->sgt,
					 DMA_BIDIRECTIONAL);
		buf->sgt = NULL;
	}
	if (buf->pinned) {
		dma_buf_unpin(buf->attach);
		buf->pinned = false;
	}
	if (buf->holding && !fgds_buf_reap(buf))
		fgds_gpu_kick_reaper(buf->gpu);
}

/**
 * fgds_buf_revoke() - revoke a registration (GPU unbind or removal)
 * @buf: the registration; its GPU's lock held
 */
void fgds_buf_revoke(struct fgds_buf *buf)
{
	dma_resv_lock(buf->dmabuf->resv, NULL);
	fgds_buf_revoke_locked(buf, true);
	dma_resv_unlock(buf->dmabuf->resv);
}

static void fgds_invalidate(struct dma_buf_attachment *attach)
{
	struct fgds_buf *buf = attach->importer_priv;

	if (!buf->revoked)
		dev_info_ratelimited(&buf->gpu->dev,
				     "exporter invalidated a registered buffer: revoked\n");
	fgds_buf_revoke_locked(buf, true);
}

static const struct dma_buf_attach_ops fgds_attach_ops = {
	.allow_peer2peer = true,
	FGDS_ATTACH_OPS_INVALIDATE(fgds_invalidate),
};

/**
 * fgds_buf_free() - free a registration that holds nothing any more
 * @buf: the registration
 */
void fgds_buf_free(struct fgds_buf *buf)
{
	WARN_ON_ONCE(buf->holding);
	put_device(&buf->gpu->dev);
	kvfree(buf->ext);
	kfree(buf);
}

/**
 * fgds_buf_drop_dmabuf() - unmap, unpin, detach and put a registration's dma-buf
 * @buf: a registration without mappings, or revoked
 *
 * Waits (revoke_timeout_ms at most) for I/O still in flight into its pages
 * first, as a revocation does; callers that must not wait check
 * fgds_pages_quiet() before.
 */
void fgds_buf_drop_dmabuf(struct fgds_buf *buf)
{
	if (buf->attach) {
		dma_resv_lock(buf->dmabuf->resv, NULL);
		fgds_buf_revoke_locked(buf, false);
		dma_resv_unlock(buf->dmabuf->resv);
		dma_buf_detach(buf->dmabuf, buf->attach);
		buf->attach = NULL;
	}
	if (buf->dmabuf)
		dma_buf_put(buf->dmabuf);
	buf->dmabuf = NULL;
}

/*
 * The last reference is gone: no mapping, no registry entry, so no new PTE
 * and no new pin can appear. Pins of I/O still in flight (or of an io_uring
 * registered buffer, which outlives the mapping it was made from) may remain:
 * then the buffer becomes a zombie that keeps the dma-buf pinned and mapped,
 * so the exporter cannot reuse memory that DMA may still reach, and the reaper
 * releases it once the pages are quiet. Nothing here waits for I/O: this runs
 * in close() and in the exit of a killed process.
 */
static void fgds_buf_release(struct kref *ref)
{
	struct fgds_buf *buf = container_of(ref, struct fgds_buf, ref);
	struct fgds_gpu *gpu = buf->gpu;
	bool quiet;

	mutex_lock(&gpu->lock);
	if (buf->listed) {
		list_del(&buf->gpu_node);
		buf->listed = false;
		gpu->nr_bufs--;
		gpu->nr_bytes -= buf->size;
	}
	quiet = fgds_buf_quiet(buf);
	if (!quiet) {
		/* Its file may go: an invalidation must not zap through it. */
		if (buf->dmabuf) {
			dma_resv_lock(buf->dmabuf->resv, NULL);
			buf->mapping = NULL;
			dma_resv_unlock(buf->dmabuf->resv);
		}
		list_add_tail(&buf->gpu_node, &gpu->zombies);
	}
	mutex_unlock(&gpu->lock);

	if (!quiet) {
		fgds_gpu_kick_reaper(gpu);
		return;
	}
	fgds_buf_drop_dmabuf(buf);
	if (fgds_buf_reap(buf)) {
		fgds_buf_free(buf);
		return;
	}
	/* Pinned again meanwhile (cannot happen without PTEs): reap later. */
	mutex_lock(&gpu->lock);
	list_add_tail(&buf->gpu_node, &gpu->zombies);
	mutex_unlock(&gpu->lock);
	fgds_gpu_kick_reaper(gpu);
}

void fgds_buf_put(struct fgds_buf *buf)
{
	kref_put(&buf->ref, fgds_buf_release);
}

static int fgds_reg_validate(struct fgds_gpu *gpu,
			     const struct fgds_ioctl_reg_buffer *arg)
{
	u64 end;

	if (arg->flags || arg->dmabuf_fd < 0)
		return -EINVAL;
	if (!arg->size || !PAGE_ALIGNED(arg->size) ||
	    !PAGE_ALIGNED(arg->dmabuf_offset))
		return -EINVAL;
	if (arg->size > gpu->bar_len)
		return -EINVAL;
	if (check_add_overflow(arg->dmabuf_offset, arg->size, &end))
		return -EOVERFLOW;
	return 0;
}

/* Sets the provider up if needed; returns its generation or an error. */
static long fgds_gpu_prepare(struct fgds_gpu *gpu)
{
	struct device *dev = &gpu->pdev->dev;
	long ret;

	ret = device_lock_interruptible(dev);
	if (ret)
		return ret;
	mutex_lock(&gpu->lock);
	if (gpu->dead)
		ret = -ENODEV;
	else
		ret = fgds_gpu_setup_pages(gpu);
	if (!ret)
		ret = gpu->gen & LONG_MAX;
	mutex_unlock(&gpu->lock);
	device_unlock(dev);
	return ret;
}

static int fgds_seg_to_bar(struct fgds_gpu *gpu, dma_addr_t addr, u64 len,
			   pgoff_t *bar_pg)
{
	u64 off = addr - gpu->bar_bus;

	if (!PAGE_ALIGNED(addr) || !PAGE_ALIGNED(len) || addr < gpu->bar_bus ||
	    off >= gpu->bar_len || len > gpu->bar_len - off) {
		dev_err(&gpu->dev,
			"dma-buf segment %pad+%#llx is not page aligned inside BAR %d (bus %#llx+%pa): not memory of this GPU, refused\n",
			&addr, len, gpu->bar, (u64)gpu->bar_bus, &gpu->bar_len);
		return -EINVAL;
	}
	*bar_pg = off >> PAGE_SHIFT;
	return 0;
}

/*
 * Turns the part [offset, offset + size) of the exporter's mapping into runs
 * of BAR pages, merging runs that are contiguous in the BAR. dmabuf->resv held.
 */
static int fgds_buf_build_extents(struct fgds_buf *buf, u64 offset)
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
		ret = fgds_seg_to_bar(buf->gpu, addr, len, &bar_pg);
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
static int fgds_buf_import(struct fgds_buf *buf, u64 offset)
{
	struct dma_resv *resv = buf->dmabuf->resv;
	struct sg_table *sgt;
	long ret;

	buf->attach = dma_buf_dynamic_attach(buf->dmabuf, &buf->gpu->pdev->dev,
					     &fgds_attach_ops, buf);
	if (IS_ERR(buf->attach)) {
		ret = PTR_ERR(buf->attach);
		buf->attach = NULL;
		dev_err(&buf->gpu->dev, "the exporter refused the attachment: %ld\n",
			ret);
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

	sgt = dma_buf_map_attachment(buf->attach, DMA_BIDIRECTIONAL);
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

	ret = fgds_buf_build_extents(buf, offset);

out_unlock:
	dma_resv_unlock(resv);
	return ret;
}

/* Takes the page references and accounts the buffer on its GPU. */
static int fgds_buf_publish(struct fgds_buf *buf, unsigned long gen)
{
	struct fgds_gpu *gpu = buf->gpu;
	unsigned int e;
	int ret = 0;

	mutex_lock(&gpu->lock);
	if (gpu->dead || (gpu->gen & LONG_MAX) != gen || buf->revoked) {
		ret = -ENODEV;
		goto out;
	}
	for (e = 0; e < buf->nr_ext && !ret; e++)
		ret = fgds_gpu_check_range(gpu, buf->ext[e].bar_pg,
					   buf->ext[e].npages);
	if (ret)
		goto out;
	if (gpu->nr_bytes + buf->size > fgds_max_bytes_per_gpu) {
		ret = -ENOSPC;
		goto out;
	}
	ret = fgds_holds_get(gpu, buf->ext, buf->nr_ext);
	if (ret)
		goto out;
	buf->holding = true;
	buf->vm_pgoff = atomic64_add_return(buf->npages + 1,
					    &fgds_next_vm_pgoff) - buf->npages;
	list_add_tail(&buf->gpu_node, &gpu->bufs);
	buf->listed = true;
	gpu->nr_bufs++;
	gpu->nr_bytes += buf->size;
out:
	mutex_unlock(&gpu->lock);
	return ret;
}

static struct fgds_buf *fgds_buf_create(struct fgds_file *f,
					const struct fgds_ioctl_reg_buffer *arg)
{
	struct fgds_gpu *gpu = f->gpu;
	struct fgds_buf *buf;
	long gen;
	int ret;

	buf = kzalloc(sizeof(*buf), GFP_KERNEL);
	if (!buf)
		return ERR_PTR(-ENOMEM);
	kref_init(&buf->ref);
	init_rwsem(&buf->lock);
	INIT_LIST_HEAD(&buf->gpu_node);
	get_device(&gpu->dev);
	buf->gpu = gpu;
	buf->mapping = f->mapping;
	buf->size = arg->size;
	buf->npages = arg->size >> PAGE_SHIFT;

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

	/* First what the exporter hands out, so memory not in the BAR gets EINVAL. */
	ret = fgds_buf_import(buf, arg->dmabuf_offset);
	if (ret)
		goto err;
	gen = fgds_gpu_prepare(gpu);
	if (gen < 0) {
		ret = gen;
		goto err;
	}
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
	ret = fgds_reg_validate(f->gpu, &arg);
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
	default:
		return -ENOTTY;
	}
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
	unsigned long addr = vmf->address;
	pgoff_t pgoff, run = 0, n;
	struct page *page;
	unsigned long pfn;
	vm_fault_t ret;
	int err;

	if (vmf->pgoff < buf->vm_pgoff ||
	    vmf->pgoff - buf->vm_pgoff >= buf->npages)
		return VM_FAULT_SIGBUS;
	pgoff = vmf->pgoff - buf->vm_pgoff;

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
	pfn = page_to_pfn(page);
	while (n--) {
		addr += PAGE_SIZE;
		if (vm_insert_page(vma, addr, pfn_to_page(++pfn)))
			break;
	}
out:
	up_read(&buf->lock);
	return ret;
}

#ifdef FGDS_FOLIO_PMD
/*
 * Maps a whole 2 MiB folio with one PMD where the VMA and the buffer allow
 * it; anything else falls back to fgds_vm_fault(), which also answers a
 * revoked buffer with SIGBUS.
 */
static vm_fault_t fgds_vm_huge_fault(struct vm_fault *vmf, unsigned int order)
{
	struct vm_area_struct *vma = vmf->vma;
	struct fgds_buf *buf = vma->vm_private_data;
	unsigned long haddr = vmf->address & PMD_MASK;
	vm_fault_t ret = VM_FAULT_FALLBACK;
	pgoff_t pgoff, run = 0;
	struct folio *folio;
	struct page *page;

	if (order != PMD_ORDER || haddr < vma->vm_start ||
	    haddr + PMD_SIZE > vma->vm_end)
		return VM_FAULT_FALLBACK;
	pgoff = linear_page_index(vma, haddr);
	if (pgoff < buf->vm_pgoff)
		return VM_FAULT_FALLBACK;
	pgoff -= buf->vm_pgoff;

	down_read(&buf->lock);
	if (buf->revoked)
		goto out;
	page = fgds_buf_page(buf, pgoff, &run);
	if (!page || run < HPAGE_PMD_NR)
		goto out;
	folio = page_folio(page);
	if (folio_order(folio) != PMD_ORDER || &folio->page != page)
		goto out;
	ret = vmf_insert_folio_pmd(vmf, folio, vmf->flags & FAULT_FLAG_WRITE);
out:
	up_read(&buf->lock);
	return ret;
}
#endif

/*
 * Whether a new VMA of @buf gets PMD mappings: GENERIC 2 MiB folios, and a
 * start address that puts the buffer's first folio boundary on a 2 MiB one
 * (fgds_get_unmapped_area() chooses such addresses).
 */
static bool fgds_buf_maps_pmd(struct fgds_buf *buf, struct vm_area_struct *vma)
{
#ifdef FGDS_FOLIO_PMD
	return buf->gpu->order == HPAGE_PMD_ORDER &&
	       buf->npages >= HPAGE_PMD_NR &&
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

/*
 * The offset chosen by the caller is the token; once found, the VMA is moved
 * to the buffer's own place in the file's address_space (buf->vm_pgoff), so
 * that unmap_mapping_range() at revocation reaches every mapping of this
 * buffer and nothing else, in every process (fork copies the PTEs, and the
 * copies are in the same address_space). Tokens are small integers, buffers
 * span many pages: at the token offsets they would overlap.
 */
static int fgds_mmap(struct file *filp, struct vm_area_struct *vma)
{
	struct fgds_file *f = filp->private_data;
	struct fgds_buf *buf = NULL;
	int ret;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	if (vma->vm_pgoff <= U32_MAX) {
		mutex_lock(&f->lock);
		buf = xa_load(&f->bufs, vma->vm_pgoff);
		if (buf)
			kref_get(&buf->ref);
		mutex_unlock(&f->lock);
	}
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

	fgds_vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP);
	if (fgds_buf_maps_pmd(buf, vma))
		fgds_vm_flags_set(vma, VM_HUGEPAGE);
	else
		fgds_vm_flags_set(vma, VM_MIXEDMAP);
	vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	vma->vm_pgoff = buf->vm_pgoff;
	vma->vm_private_data = buf;
	vma->vm_ops = &fgds_vm_ops;
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
		fgds_gpu_prepare(gpu);
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
#ifdef FGDS_FOLIO_PMD
	.get_unmapped_area = fgds_get_unmapped_area,
#endif
	.llseek = noop_llseek,
};

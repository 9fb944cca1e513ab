// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: struct pages over a GPU's BAR, and the references fgds holds on them.
 *
 * Three providers, chosen when the GPU's node is opened (or, if that failed,
 * at the next registration) while the GPU has a driver bound (it is the
 * exporter, or vfio), torn down when that driver unbinds or the GPU goes away:
 *
 *  1. the exporter registered P2PDMA pages for the BAR: fgds maps those,
 *     and adds, frees or claims nothing in the exporter's pool;
 *  2. with CONFIG_PCI_P2PDMA, where the GPU's driver keeps no P2PDMA state
 *     of its own, fgds registers P2PDMA pages for the BAR, each chunk in a
 *     devres group it releases itself with the provider (the kernel has no way
 *     to make them but devres on the GPU's device: docs/driver.md, Whose
 *     device), and claims each chunk from the P2PDMA genpool, so no other
 *     allocator (pci_alloc_p2pmem(), p2pmem/allocate) can hand that memory
 *     out. Where the kernel has pci_p2pdma_add_resource_folios() (the rig's
 *     kernel change p2pdma-folios) the pages are 2 MiB folios, which never
 *     enter the genpool. GUP hands P2PDMA pages only to callers that pass FOLL_PCI_P2PDMA
 *     (the block layer, for queues that can reach them), never pins them
 *     long-term, and the DMA layer maps them through the P2P distance check;
 *  3. without CONFIG_PCI_P2PDMA (Debian's 6.1 and 6.12), or beside P2PDMA
 *     state of the GPU's driver without pages (vfio-pci on 7.x), to which
 *     fgds adds nothing, MEMORY_DEVICE_GENERIC pages of fgds's own pagemap
 *     (no devres), only where fgds can vouch that DMA reaches them exactly as it
 *     would reach P2PDMA pages (fgds_generic_unsafe()): no IOMMU translation,
 *     and a PCIe switch, or a host bridge that routes P2P, between the GPU
 *     and every NVMe controller. GENERIC pages look like RAM to GUP, so their
 *     mappings refuse long-term writable pins (see buf.c).
 * The pages= parameter can insist on 2 or 3 (enum fgds_pages).
 *
 * In modes 2 and 3 the provider is chosen at setup, but its pages are made a
 * chunk (FGDS_CHUNK_SIZE) at a time, when a registration first covers part
 * of the chunk (fgds_gpu_make_pages()), and all go with the provider: what
 * the memmap costs follows what was registered since the GPU's driver bound,
 * not the BAR, whose 256 GiB would take 4 GiB of RAM and seconds of an
 * unprivileged open (docs/driver.md, Page providers).
 *
 * The BAR's geometry is read again at each setup, under the PCI device lock:
 * GPU drivers resize BARs at probe, and root can through sysfs.
 *
 * In modes 2 and 3 fgds first reserves the BAR's memory type write-combined
 * (arch_io_reserve_memtype_wc()). x86 PAT keeps the type of the first
 * reservation of a range and refuses write-back for it afterwards, and
 * memremap_pages() takes the existing type when one exists, so the pages'
 * kernel mapping is never write-back, whichever of fgds and the exporter
 * maps the BAR first. If the range is already reserved write-back, fgds
 * refuses.
 *
 * Page references: P2PDMA pages return to their genpool when their refcount
 * reaches zero, so a page fgds may map must never drop to zero through
 * put_page() behind the allocator's back. fgds therefore holds one reference
 * of its own on every folio it may map, takes it with folio_ref_inc() and
 * gives it back with folio_ref_dec() only once the folio is quiet: no
 * references left but its idle count, fgds's own, and one per PTE. PTEs are
 * only created by fgds's fault handler and removed by zapping; GUP pins of
 * in-flight I/O (and pages spliced into a pipe) are the only other
 * references, so "quiet" means "no I/O in flight".
 *
 * In modes 2 and 3 every page fgds made is fgds's: it takes its reference
 * on every folio of a chunk when it makes the chunk and gives them back when
 * it tears the provider down, so a registration costs no per-page work once
 * its chunks exist. In mode 1 the
 * pages are the exporter's, and fgds holds only those that at least one
 * registration covers, counted per page in gpu->holds.
 *
 * GENERIC pages are compound, one folio per 2 MiB (pgmap->vmemmap_shift), so
 * that the block layer pins, dirties and unpins a 2 MiB run as one folio, as
 * it does for a transparent huge page in RAM.
 *
 * In modes 2 and 3, folio->mapping is fgds_mapping while the provider lives
 * (cleared before the reference goes), as device-dax does: GUP-fast refuses
 * an order-0 page without a mapping (it cannot rule out secretmem, mm/gup.c
 * gup_fast_folio_allowed()) and falls back to walking the page tables page by
 * page under mmap_lock. The mapping's dirty_folio is noop_dirty_folio(), for
 * bio_set_pages_dirty(). The exporter's pages (mode 1) are never touched
 * beyond fgds's reference: their ->mapping and ->index are the exporter's.
 */

#include <linux/cc_platform.h>
#include <linux/delay.h>
#include <linux/dma-resv.h>
#include <linux/io.h>
#include <linux/iommu.h>
#include <linux/memremap.h>
#include <linux/mm.h>
#include <linux/pci-p2pdma.h>
#include <linux/slab.h>
#include <linux/swiotlb.h>

#include "fgds_compat.h"
#include "fgds_drv.h"
#include "fgds_p2p.h"

const char *fgds_mode_name(enum fgds_mode mode)
{
	switch (mode) {
	case FGDS_MODE_EXPORTER_P2PDMA:
		return "exporter-p2pdma";
	case FGDS_MODE_P2PDMA:
		return "p2pdma";
	case FGDS_MODE_GENERIC:
		return "generic";
	default:
		return "none";
	}
}

static unsigned long fgds_bar_pfn(struct fgds_gpu *gpu)
{
	return PHYS_PFN(gpu->geo.start);
}

struct page *fgds_gpu_page(struct fgds_gpu *gpu, pgoff_t bar_pg)
{
	return pfn_to_page(fgds_bar_pfn(gpu) + bar_pg);
}

/* The folio of BAR unit @unit (units are gpu->order pages). */
static struct folio *fgds_unit_folio(struct fgds_gpu *gpu, pgoff_t unit)
{
	return page_folio(fgds_gpu_page(gpu, unit << gpu->order));
}

/* Modes 2 and 3: fgds created the pages and holds all of them. */
static bool fgds_owns_pages(struct fgds_gpu *gpu)
{
	return gpu->mode == FGDS_MODE_P2PDMA || gpu->mode == FGDS_MODE_GENERIC;
}

/* The first and one past the last folio of a chunk (units of gpu->order). */
static pgoff_t fgds_chunk_unit(struct fgds_gpu *gpu, u32 idx)
{
	return ((pgoff_t)idx * FGDS_CHUNK_PAGES) >> gpu->order;
}

/*
 * Takes fgds's reference on every folio of a chunk it has just made (modes
 * 2 and 3): no registration covers the chunk yet, so nothing reaches them.
 */
static void fgds_chunk_claim(struct fgds_gpu *gpu, u32 idx)
{
	pgoff_t unit, n = fgds_chunk_unit(gpu, idx + 1);
	struct folio *folio;

	for (unit = fgds_chunk_unit(gpu, idx); unit < n; unit++) {
		folio = fgds_unit_folio(gpu, unit);
		folio_ref_inc(folio);
		fgds_folio_set_mapping(folio, fgds_mapping);
		if (!(unit & 1023))
			cond_resched();
	}
}

/* Gives back what fgds_chunk_claim() took; every folio is quiet. */
static void fgds_chunk_unclaim(struct fgds_gpu *gpu, u32 idx)
{
	pgoff_t unit, n = fgds_chunk_unit(gpu, idx + 1);
	struct folio *folio;

	for (unit = fgds_chunk_unit(gpu, idx); unit < n; unit++) {
		folio = fgds_unit_folio(gpu, unit);
		fgds_folio_set_mapping(folio, NULL);
		/* Never folio_put(): a P2PDMA page would go back to its pool. */
		folio_ref_dec(folio);
		if (!(unit & 1023))
			cond_resched();
	}
}

/*
 * Returns the type of the first ZONE_DEVICE pagemap found over the BAR, or -1
 * when there is none: not fgds's, since fgds drops its own with its
 * provider. Pagemaps are at least subsection (2 MiB) aligned.
 */
static int fgds_bar_pgmap_type(struct fgds_gpu *gpu)
{
	unsigned long pfn = fgds_bar_pfn(gpu);
	unsigned long end = pfn + PHYS_PFN(gpu->geo.len);
	unsigned long step = PHYS_PFN(SZ_2M);
	struct dev_pagemap *pgmap;
	int type;

	for (; pfn < end; pfn += step) {
		pgmap = fgds_get_dev_pagemap(pfn);
		if (!pgmap)
			continue;
		type = pgmap->type;
		put_dev_pagemap(pgmap);
		return type;
	}
	return -1;
}

static int fgds_reserve_wc(struct fgds_gpu *gpu)
{
	int ret;

	ret = arch_io_reserve_memtype_wc(gpu->geo.start, gpu->geo.len);
	/* Out of memory is no conflict: not a refusal to remember. */
	if (ret == -ENOMEM)
		return ret;
	if (ret) {
		pci_err(gpu->pdev,
			"fgds: BAR %d is already mapped write-back (%d); fgds needs it write-combined or uncached: find and unload whatever maps it cached\n",
			gpu->geo.bar, ret);
		return -EBUSY;
	}
	gpu->memtype_wc = true;
	return 0;
}

static void fgds_unreserve_wc(struct fgds_gpu *gpu)
{
	if (!gpu->memtype_wc)
		return;
	arch_io_free_memtype_wc(gpu->geo.start, gpu->geo.len);
	gpu->memtype_wc = false;
}

#ifdef CONFIG_PCI_P2PDMA
/*
 * The folio order of the P2PDMA pages fgds creates over the BAR: 2 MiB
 * folios where the kernel can make them (pci_p2pdma_add_resource_folios(),
 * the rig's kernel change p2pdma-folios, not upstream) and the BAR is
 * aligned to them, else order 0, all that pci_p2pdma_add_resource() makes.
 */
static unsigned int fgds_p2pdma_order(struct fgds_gpu *gpu)
{
#ifdef FGDS_HAVE_P2PDMA_ADD_RESOURCE_FOLIOS
	if (IS_ALIGNED(gpu->geo.start | gpu->geo.len, PMD_SIZE))
		return PMD_SHIFT - PAGE_SHIFT;
#endif
	return 0;
}

static int fgds_p2pdma_add_resource(struct fgds_gpu *gpu, u64 offset)
{
#ifdef FGDS_HAVE_P2PDMA_ADD_RESOURCE_FOLIOS
	if (gpu->order)
		return pci_p2pdma_add_resource_folios(gpu->pdev, gpu->geo.bar,
						      FGDS_CHUNK_SIZE, offset,
						      gpu->order);
#endif
	return pci_p2pdma_add_resource(gpu->pdev, gpu->geo.bar,
				       FGDS_CHUNK_SIZE, offset);
}

static int fgds_setup_p2pdma(struct fgds_gpu *gpu)
{
	gpu->order = fgds_p2pdma_order(gpu);
	gpu->p2p_state = NULL;
	return 0;
}

/*
 * Makes the P2PDMA pages of chunk @idx. Creating them puts devres on the
 * GPU's device (the kernel has no other way to make them), so it is only
 * done while a driver is bound (the caller holds the device lock and checked
 * the provider's generation), and only into P2PDMA state fgds created with
 * its first chunk: all that pci_p2pdma_add_resource() makes (for the first
 * chunk the state and the pool too) goes into one devres group per chunk that
 * fgds releases itself, so nothing of fgds's outlives its provider, and no
 * other driver's P2PDMA state ever holds fgds's pages. Order-0 pages are then
 * claimed from the genpool, so that no other allocator can hand them out;
 * large folios never enter the genpool.
 */
static int fgds_p2pdma_make_chunk(struct fgds_gpu *gpu, u32 idx)
{
	struct fgds_chunk *chunk = &gpu->chunks[idx];
	u64 offset = (u64)idx << FGDS_CHUNK_SHIFT;
	struct pci_dev *pdev = gpu->pdev;
	void *group, *claim;
	int ret;

	if (rcu_access_pointer(pdev->p2pdma) != gpu->p2p_state) {
		pci_err(pdev,
			"fgds: the GPU's driver set up P2PDMA state of its own after fgds chose P2PDMA pages, and fgds adds no pages to it; unbind and bind the GPU's driver, then register again\n");
		return -EBUSY;
	}
	group = devres_open_group(&pdev->dev, NULL, GFP_KERNEL);
	if (!group)
		return -ENOMEM;
	ret = fgds_p2pdma_add_resource(gpu, offset);
	devres_close_group(&pdev->dev, group);
	if (ret) {
		pci_err(pdev,
			"fgds: cannot register P2PDMA pages for BAR %d at %#llx: %d\n",
			gpu->geo.bar, offset, ret);
		goto err_group;
	}
	if (!gpu->order) {
		claim = pci_alloc_p2pmem(pdev, FGDS_CHUNK_SIZE);
		if (claim != phys_to_virt(gpu->geo.start + offset)) {
			pci_err(pdev,
				"fgds: cannot claim BAR %d at %#llx from the P2PDMA pool (another user holds part of it); unload that user and retry\n",
				gpu->geo.bar, offset);
			if (claim)
				pci_free_p2pmem(pdev, claim, FGDS_CHUNK_SIZE);
			ret = -EBUSY;
			goto err_group;
		}
		chunk->claim = claim;
	}
	chunk->group = group;
	gpu->p2p_state = rcu_access_pointer(pdev->p2pdma);
	return 0;

err_group:
	devres_release_group(&pdev->dev, group);
	return ret;
}

/*
 * Drops chunk @idx's P2PDMA pages; the chunks made after it are gone already,
 * so the first one made, which holds the P2PDMA state and its pool, goes
 * last, when every claim from the pool has been given back.
 */
static void fgds_p2pdma_drop_chunk(struct fgds_gpu *gpu, u32 idx)
{
	struct fgds_chunk *chunk = &gpu->chunks[idx];
	struct pci_dev *pdev = gpu->pdev;

	if (chunk->claim)
		pci_free_p2pmem(pdev, chunk->claim, FGDS_CHUNK_SIZE);
	chunk->claim = NULL;
	devres_release_group(&pdev->dev, chunk->group);
	chunk->group = NULL;
}
#else
static int fgds_setup_p2pdma(struct fgds_gpu *gpu)
{
	return -EOPNOTSUPP;
}

static int fgds_p2pdma_make_chunk(struct fgds_gpu *gpu, u32 idx)
{
	return -EOPNOTSUPP;
}

static void fgds_p2pdma_drop_chunk(struct fgds_gpu *gpu, u32 idx)
{
}
#endif

static bool fgds_dma_translated(struct device *dev)
{
	struct iommu_domain *dom = iommu_get_domain_for_dev(dev);

	return dom && dom->type != IOMMU_DOMAIN_IDENTITY;
}

/*
 * Whether DMA between the GPU and @nvme takes a path that delivers it: the
 * kernel's own check where it is built, else the same rules walked by fgds.
 */
static bool fgds_p2p_reachable(struct pci_dev *gpu_pdev, struct pci_dev *nvme)
{
#ifdef CONFIG_PCI_P2PDMA
	return pci_p2pdma_distance(gpu_pdev, &nvme->dev, false) >= 0;
#else
	return fgds_p2p_switch_local(gpu_pdev, nvme) ||
	       fgds_p2p_host_bridge_ok(gpu_pdev, nvme);
#endif
}

/*
 * Why DMA by @pdev would not reach GENERIC pages of this GPU exactly as it
 * reaches P2PDMA pages, or NULL. GENERIC pages look like RAM to the DMA API:
 * it maps them for a DMA master with phys_to_dma(), through an IOMMU if there
 * is one, with no P2P check. P2PDMA pages get the BAR's PCI bus address once
 * the distance check has passed. The two agree when the DMA master's DMA is
 * neither translated nor bounced and it reaches the GPU through a PCIe switch
 * or a host bridge that routes P2P.
 */
static const char *fgds_generic_dev_unsafe(struct fgds_gpu *gpu,
					   struct pci_dev *pdev)
{
	if (fgds_dma_translated(&pdev->dev))
		return "an IOMMU translates the DMA of";
	if (is_swiotlb_force_bounce(&pdev->dev))
		return "swiotlb bounces the DMA of";
	if (!fgds_p2p_reachable(gpu->pdev, pdev))
		return "no PCIe switch or P2P-capable host bridge between the GPU and";
	return NULL;
}

/*
 * Why GENERIC pages of this GPU are unsafe on this machine, naming the
 * device at fault in *culprit (a reference the caller drops), or NULL: the
 * rules of fgds_generic_dev_unsafe() for every NVMe controller present, and
 * neither the GPU's own DMA translated, nor memory encrypted (phys_to_dma()
 * would set the encryption bit), nor the BAR's bus address other than its
 * CPU address. fgds_gpu_dma_dev_check() applies the same rules again to the
 * device that does each of fgds's own reads and writes.
 */
static const char *fgds_generic_unsafe(struct fgds_gpu *gpu,
				       struct pci_dev **culprit)
{
	struct pci_dev *gpu_pdev = gpu->pdev, *pdev = NULL;

	*culprit = NULL;
	if (cc_platform_has(CC_ATTR_MEM_ENCRYPT))
		return "memory encryption is active";
	if (gpu->geo.bus != gpu->geo.start)
		return "the BAR's PCI bus address differs from its CPU address";
	if (fgds_dma_translated(&gpu_pdev->dev))
		return "an IOMMU translates the GPU's DMA";
	for_each_pci_dev(pdev) {
		const char *why;

		/* Any NVM Express controller (class 01h, subclass 08h). */
		if ((pdev->class >> 8) != (PCI_CLASS_STORAGE_EXPRESS >> 8))
			continue;
		why = fgds_generic_dev_unsafe(gpu, pdev);
		if (!why)
			continue;
		*culprit = pdev;
		return why;
	}
	return NULL;
}

/**
 * fgds_gpu_dma_dev_check() - can a DMA master reach this GPU's pages?
 * @gpu: the GPU, its provider set up (a registration's @users held)
 * @pdev: the PCI device that would do the DMA
 *
 * P2PDMA pages: the kernel's distance check (pci_p2pdma_distance()), which
 * the DMA layer applies again when it maps them. GENERIC pages: the rules
 * fgds checked for every NVMe controller when it created them, for this
 * device, which may have come since.
 *
 * Return: NULL, or why not, as a phrase that the device's name completes.
 */
const char *fgds_gpu_dma_dev_check(struct fgds_gpu *gpu, struct pci_dev *pdev)
{
	if (READ_ONCE(gpu->mode) == FGDS_MODE_GENERIC)
		return fgds_generic_dev_unsafe(gpu, pdev);
	if (!fgds_p2p_reachable(gpu->pdev, pdev))
		return "no P2P path (pci_p2pdma_distance()) between the GPU and";
	return NULL;
}

/*
 * Whether fgds may create GENERIC pages; a refusal is logged with the fix.
 * @foreign: they stand in for P2PDMA pages that fgds may not add to the
 * GPU driver's own P2PDMA state.
 */
static bool fgds_generic_allowed(struct fgds_gpu *gpu, bool foreign)
{
	struct pci_dev *culprit;
	const char *why = fgds_generic_unsafe(gpu, &culprit);
	const char *sep = culprit ? " " : "";
	const char *name = culprit ? pci_name(culprit) : "";

	if (!why)
		return true;
	if (foreign)
		pci_err(gpu->pdev,
			"fgds: no pages for BAR %d: the GPU's driver keeps P2PDMA state of its own, to which fgds adds no pages, and GENERIC pages are refused: %s%s%s; use the kernel's dma-buf I/O where it has it, or read through RAM\n",
			gpu->geo.bar, why, sep, name);
	else if (IS_ENABLED(CONFIG_PCI_P2PDMA))
		pci_err(gpu->pdev,
			"fgds: GENERIC pages refused: %s%s%s; load fgds with pages=auto or pages=p2pdma\n",
			why, sep, name);
	else
		pci_err(gpu->pdev,
			"fgds: GENERIC pages refused: %s%s%s; boot with iommu=pt and without swiotlb=force, put the GPU and the drive behind one PCIe switch, or use a kernel with CONFIG_PCI_P2PDMA\n",
			why, sep, name);
	pci_dev_put(culprit);
	return false;
}

/*
 * How many references a P2PDMA page that nobody uses holds: 1 up to 6.12,
 * 0 from 7.x (the "fs/dax: Fix ZONE_DEVICE page reference counts" series).
 * A rule of mm/ that no compile probe sees, and a backport would turn a
 * wrong guess into pages handed back to their pool under DMA, so fgds reads
 * it off the pages themselves: its own, after it created and claimed them
 * and before it takes its references (allocation from the genpool leaves
 * the count alone, drivers/pci/p2pdma.c pci_alloc_p2pmem()).
 */
static unsigned int fgds_own_idle_refs(struct fgds_gpu *gpu, u32 idx)
{
	int refs = folio_ref_count(fgds_unit_folio(gpu,
						   fgds_chunk_unit(gpu, idx)));

	/* Pages fgds has just made: nobody else can hold one. */
	WARN_ON_ONCE(refs != 0 && refs != 1);
	return refs;
}

#ifdef CONFIG_PCI_P2PDMA
/*
 * The same for the exporter's pages: one page of its pool, allocated and
 * freed again for the purpose. -EAGAIN (not a lasting refusal) while the
 * pool has no free page.
 */
static int fgds_exporter_idle_refs(struct fgds_gpu *gpu)
{
	void *p = pci_alloc_p2pmem(gpu->pdev, PAGE_SIZE);
	int refs;

	if (!p) {
		pci_err(gpu->pdev,
			"fgds: the exporter's P2PDMA pool has no free page, so fgds cannot tell how its pages idle; open the node again once some memory is free\n");
		return -EAGAIN;
	}
	refs = page_ref_count(virt_to_page(p));
	pci_free_p2pmem(gpu->pdev, p, PAGE_SIZE);
	if (refs != 0 && refs != 1) {
		pci_err(gpu->pdev,
			"fgds: a free page of the exporter's P2PDMA pool holds %d references, not 0 or 1: unknown rules, refused\n",
			refs);
		return -EOPNOTSUPP;
	}
	gpu->idle_refs = refs;
	return 0;
}
#else
static int fgds_exporter_idle_refs(struct fgds_gpu *gpu)
{
	return -EOPNOTSUPP;
}
#endif

static int fgds_setup_generic(struct fgds_gpu *gpu)
{
	if (!IS_ENABLED(CONFIG_ZONE_DEVICE)) {
		pci_err(gpu->pdev, "fgds: the kernel has no CONFIG_ZONE_DEVICE\n");
		return -EOPNOTSUPP;
	}
	/* BARs are aligned to their size, which is at least FGDS_MIN_BAR_SIZE. */
	gpu->order = IS_ALIGNED(gpu->geo.start | gpu->geo.len, PMD_SIZE) ?
		     PMD_SHIFT - PAGE_SHIFT : 0;
	/* GENERIC pages idle at 1 on every kernel (7.x free_zone_device_folio()). */
	gpu->idle_refs = 1;
	return 0;
}

/* Makes the GENERIC pages of chunk @idx: a pagemap of fgds's own, no devres. */
static int fgds_generic_make_chunk(struct fgds_gpu *gpu, u32 idx)
{
	u64 offset = (u64)idx << FGDS_CHUNK_SHIFT;
	struct dev_pagemap *pgmap;
	void *addr;
	int ret;

	pgmap = kzalloc(sizeof(*pgmap), GFP_KERNEL);
	if (!pgmap)
		return -ENOMEM;
	pgmap->range.start = gpu->geo.start + offset;
	pgmap->range.end = pgmap->range.start + FGDS_CHUNK_SIZE - 1;
	pgmap->nr_range = 1;
	pgmap->type = MEMORY_DEVICE_GENERIC;
	pgmap->vmemmap_shift = gpu->order;
	addr = memremap_pages(pgmap, dev_to_node(&gpu->pdev->dev));
	if (IS_ERR(addr)) {
		ret = PTR_ERR(addr);
		pci_err(gpu->pdev,
			"fgds: memremap_pages of BAR %d at %#llx failed: %d\n",
			gpu->geo.bar, offset, ret);
		kfree(pgmap);
		return ret;
	}
	gpu->chunks[idx].pgmap = pgmap;
	return 0;
}

static void fgds_generic_drop_chunk(struct fgds_gpu *gpu, u32 idx)
{
	struct fgds_chunk *chunk = &gpu->chunks[idx];

	memunmap_pages(chunk->pgmap);
	kfree(chunk->pgmap);
	chunk->pgmap = NULL;
}

static bool fgds_chunk_made(struct fgds_gpu *gpu, u32 idx)
{
	return gpu->chunks[idx].pgmap || gpu->chunks[idx].group;
}

static int fgds_make_chunk(struct fgds_gpu *gpu, u32 idx)
{
	int ret;

	if (gpu->mode == FGDS_MODE_P2PDMA)
		ret = fgds_p2pdma_make_chunk(gpu, idx);
	else
		ret = fgds_generic_make_chunk(gpu, idx);
	if (ret)
		return ret;
	if (gpu->mode == FGDS_MODE_P2PDMA && !gpu->nr_made)
		gpu->idle_refs = fgds_own_idle_refs(gpu, idx);
	fgds_chunk_claim(gpu, idx);
	gpu->made[gpu->nr_made++] = idx;
	return 0;
}

/* Drops every chunk made, the last made first. */
static void fgds_drop_chunks(struct fgds_gpu *gpu)
{
	u32 idx;

	while (gpu->nr_made) {
		idx = gpu->made[--gpu->nr_made];
		fgds_chunk_unclaim(gpu, idx);
		if (gpu->mode == FGDS_MODE_P2PDMA)
			fgds_p2pdma_drop_chunk(gpu, idx);
		else
			fgds_generic_drop_chunk(gpu, idx);
	}
	kvfree(gpu->chunks);
	gpu->chunks = NULL;
	kvfree(gpu->made);
	gpu->made = NULL;
	gpu->p2p_state = NULL;
}

/**
 * fgds_gpu_make_pages() - make fgds's pages under a registration
 * @gpu: the GPU; the PCI device lock and gpu->lock held, and the provider
 *	the one the registration's extents were checked against
 * @ext: the registration's extents, inside the BAR
 * @nr_ext: number of extents
 *
 * In modes 2 and 3, makes the pages of every chunk that @ext covers and that
 * has none yet; they stay until the provider goes. Nothing to do in the
 * exporter's mode.
 *
 * Return: 0, or why a chunk could not be made (logged); the chunks made
 * before the failure stay.
 */
int fgds_gpu_make_pages(struct fgds_gpu *gpu, const struct fgds_extent *ext,
			unsigned int nr_ext)
{
	unsigned int e;
	u32 idx, last;
	int ret;

	lockdep_assert_held(&gpu->lock);
	device_lock_assert(&gpu->pdev->dev);
	if (!fgds_owns_pages(gpu))
		return 0;
	for (e = 0; e < nr_ext; e++) {
		idx = ext[e].bar_pg / FGDS_CHUNK_PAGES;
		last = (ext[e].bar_pg + ext[e].npages - 1) / FGDS_CHUNK_PAGES;
		for (; idx <= last; idx++) {
			if (fgds_chunk_made(gpu, idx))
				continue;
			ret = fgds_make_chunk(gpu, idx);
			if (ret)
				return ret;
		}
	}
	return 0;
}

/*
 * Whether the GPU's driver set up P2PDMA state of its own (a provider
 * without pages over the BAR, as vfio-pci and other exporters of BAR
 * dma-bufs do on 7.x): fgds's own P2PDMA state is gone with its provider,
 * so any found here is another driver's.
 */
static bool fgds_foreign_p2pdma(struct fgds_gpu *gpu)
{
#ifdef CONFIG_PCI_P2PDMA
	return rcu_access_pointer(gpu->pdev->p2pdma);
#else
	return false;
#endif
}

/*
 * What modes 2 and 3 share: the BAR's memory type, and the table of its
 * chunks, none made yet.
 */
static int fgds_setup_chunks(struct fgds_gpu *gpu)
{
	u32 n = gpu->geo.len >> FGDS_CHUNK_SHIFT;
	int ret;

	ret = fgds_reserve_wc(gpu);
	if (ret)
		return ret;
	gpu->chunks = kvcalloc(n, sizeof(*gpu->chunks), GFP_KERNEL);
	gpu->made = kvcalloc(n, sizeof(*gpu->made), GFP_KERNEL);
	if (!gpu->chunks || !gpu->made) {
		kvfree(gpu->chunks);
		gpu->chunks = NULL;
		kvfree(gpu->made);
		gpu->made = NULL;
		fgds_unreserve_wc(gpu);
		return -ENOMEM;
	}
	gpu->nr_made = 0;
	return 0;
}

/*
 * Modes 2 and 3 of the top of this file, as pages= allows: P2PDMA pages
 * wherever the kernel has them and the GPU's driver keeps no P2PDMA state
 * of its own (unless pages=generic), GENERIC pages otherwise where fgds
 * vouches for the topology. *why says why, for the log.
 */
static int fgds_setup_own_pages(struct fgds_gpu *gpu, enum fgds_mode *mode,
				const char **why)
{
	int pages = READ_ONCE(fgds_pages);
	bool foreign = fgds_foreign_p2pdma(gpu);
	int ret;

	if (pages == FGDS_PAGES_P2PDMA ||
	    (pages == FGDS_PAGES_AUTO && IS_ENABLED(CONFIG_PCI_P2PDMA) &&
	     !foreign)) {
		if (!IS_ENABLED(CONFIG_PCI_P2PDMA)) {
			pci_err(gpu->pdev,
				"fgds: pages=p2pdma, but the kernel has no CONFIG_PCI_P2PDMA; load fgds with pages=auto\n");
			return -EOPNOTSUPP;
		}
		if (foreign) {
			pci_err(gpu->pdev,
				"fgds: pages=p2pdma, but the GPU's driver keeps P2PDMA state of its own with no pages over BAR %d: fgds adds no pages to another driver's P2PDMA state; load fgds with pages=auto, or use the kernel's dma-buf I/O where it has it\n",
				gpu->geo.bar);
			return -EOPNOTSUPP;
		}
		*mode = FGDS_MODE_P2PDMA;
		*why = pages == FGDS_PAGES_P2PDMA ? "pages=p2pdma" :
		       "the kernel has CONFIG_PCI_P2PDMA";
		ret = fgds_setup_p2pdma(gpu);
		return ret ?: fgds_setup_chunks(gpu);
	}
	if (!fgds_generic_allowed(gpu, foreign))
		return -EOPNOTSUPP;
	*mode = FGDS_MODE_GENERIC;
	if (pages == FGDS_PAGES_GENERIC)
		*why = "pages=generic";
	else if (foreign)
		*why = "the GPU's driver has its own P2PDMA state; P2P path to every NVMe checked";
	else
		*why = "no CONFIG_PCI_P2PDMA, P2P path to every NVMe checked";
	ret = fgds_setup_generic(gpu);
	return ret ?: fgds_setup_chunks(gpu);
}

/**
 * fgds_gpu_pick_bar() - the BAR fgds uses on a PCI device
 * @pdev: the device
 *
 * Return: the index of the largest assigned prefetchable memory BAR of at
 * least FGDS_MIN_BAR_SIZE, or -1.
 */
int fgds_gpu_pick_bar(struct pci_dev *pdev)
{
	resource_size_t best = 0;
	int bar, pick = -1;

	for (bar = 0; bar < PCI_STD_NUM_BARS; bar++) {
		unsigned long flags = pci_resource_flags(pdev, bar);
		resource_size_t len = pci_resource_len(pdev, bar);

		if ((flags & (IORESOURCE_MEM | IORESOURCE_PREFETCH)) !=
		    (IORESOURCE_MEM | IORESOURCE_PREFETCH) ||
		    (flags & IORESOURCE_UNSET) || !pci_resource_start(pdev, bar))
			continue;
		if (len >= FGDS_MIN_BAR_SIZE && len > best) {
			best = len;
			pick = bar;
		}
	}
	return pick;
}

/*
 * Reads the BAR's place again (gpu->lock and the PCI device lock held): its
 * driver may have resized it since the node was created.
 */
static int fgds_gpu_read_geometry(struct fgds_gpu *gpu)
{
	struct pci_dev *pdev = gpu->pdev;
	struct fgds_geometry geo;

	device_lock_assert(&pdev->dev);
	geo.bar = fgds_gpu_pick_bar(pdev);
	if (geo.bar < 0) {
		pci_err(pdev, "fgds: no assigned prefetchable memory BAR of 64 MiB or more any more; check the BAR sizes (lspci -vv)\n");
		return -ENODEV;
	}
	geo.start = pci_resource_start(pdev, geo.bar);
	geo.bus = pci_bus_address(pdev, geo.bar);
	geo.len = pci_resource_len(pdev, geo.bar);
	if (geo.bar != gpu->geo.bar || geo.start != gpu->geo.start ||
	    geo.len != gpu->geo.len)
		pci_info(pdev, "fgds: BAR %d is now at %pa, %pa bytes (was BAR %d at %pa, %pa bytes)\n",
			 geo.bar, &geo.start, &geo.len, gpu->geo.bar,
			 &gpu->geo.start, &gpu->geo.len);
	gpu->geo = geo;
	return 0;
}

/**
 * fgds_gpu_setup_pages() - choose and set up the GPU's page provider
 * @gpu: the GPU; gpu->lock and the PCI device's device_lock held
 *
 * Return: 0 when struct pages exist over the BAR and fgds may map them,
 * -ENODEV without a bound driver or a usable BAR, else the reason the
 * provider was refused (logged; -EOPNOTSUPP and -EBUSY are remembered until
 * the driver unbinds, and sysfs "mode" then reads "refused").
 */
int fgds_gpu_setup_pages(struct fgds_gpu *gpu)
{
	enum fgds_mode mode = FGDS_MODE_NONE;
	const char *why = "the exporter registered them";
	int type, ret;

	lockdep_assert_held(&gpu->lock);
	if (gpu->mode != FGDS_MODE_NONE)
		return 0;
	if (gpu->refused)
		return gpu->refused;
	if (!gpu->pdev->dev.driver) {
		pci_info(gpu->pdev, "fgds: no driver bound to the GPU; bind its driver first\n");
		return -ENODEV;
	}
	ret = fgds_gpu_read_geometry(gpu);
	if (ret)
		return ret;

	type = fgds_bar_pgmap_type(gpu);
	if (type == MEMORY_DEVICE_PCI_P2PDMA) {
		mode = FGDS_MODE_EXPORTER_P2PDMA;
		ret = fgds_exporter_idle_refs(gpu);
	} else if (type >= 0) {
		pci_err(gpu->pdev,
			"fgds: BAR %d already has struct pages of type %d from another driver; unload it\n",
			gpu->geo.bar, type);
		ret = -EBUSY;
	} else {
		ret = fgds_setup_own_pages(gpu, &mode, &why);
	}
	/* A refusal (logged once) stands until the GPU's driver unbinds. */
	if (ret == -EOPNOTSUPP || ret == -EBUSY)
		WRITE_ONCE(gpu->refused, ret);
	if (ret)
		return ret;

	WRITE_ONCE(gpu->mode, mode);
	if (fgds_owns_pages(gpu))
		pci_info(gpu->pdev, "fgds: %s pages over BAR %d (%pa bytes, %lu KiB folios), made %llu MiB at a time under registrations: %s\n",
			 fgds_mode_name(mode), gpu->geo.bar, &gpu->geo.len,
			 PAGE_SIZE << gpu->order >> 10, FGDS_CHUNK_SIZE >> 20,
			 why);
	else
		pci_info(gpu->pdev, "fgds: %s pages over BAR %d (%pa bytes): %s\n",
			 fgds_mode_name(mode), gpu->geo.bar, &gpu->geo.len,
			 why);
	return 0;
}

/**
 * fgds_gpu_drop_pages() - drop the GPU's page provider
 * @gpu: the GPU; gpu->lock held; fgds holds no page for any registration
 *	any more (fgds_gpu_teardown() waited for that)
 */
void fgds_gpu_drop_pages(struct fgds_gpu *gpu)
{
	lockdep_assert_held(&gpu->lock);
	if (WARN_ON_ONCE(gpu->nr_held))
		return;
	if (fgds_owns_pages(gpu)) {
		pci_info(gpu->pdev, "fgds: %s pages released (%u MiB of the BAR had them)\n",
			 fgds_mode_name(gpu->mode),
			 gpu->nr_made << (FGDS_CHUNK_SHIFT - 20));
		fgds_drop_chunks(gpu);
		fgds_unreserve_wc(gpu);
	} else if (gpu->mode != FGDS_MODE_NONE) {
		pci_info(gpu->pdev, "fgds: %s pages released\n",
			 fgds_mode_name(gpu->mode));
	}
	gpu->order = 0;
	WRITE_ONCE(gpu->gate_diskseq, 0);
	WRITE_ONCE(gpu->mode, FGDS_MODE_NONE);
}

static unsigned int fgds_idle_refs(struct fgds_gpu *gpu)
{
	return gpu->idle_refs;
}

/**
 * fgds_gpu_check_range() - check that fgds may map a run of BAR pages
 * @gpu: the GPU, with a provider set up
 * @bar_pg: first page, counted from the start of the BAR
 * @n: number of pages
 *
 * The caller has checked that the run lies inside the BAR. In the exporter's
 * P2PDMA mode the run must also lie inside the exporter's P2PDMA pagemaps.
 *
 * Return: 0 or -EINVAL.
 */
int fgds_gpu_check_range(struct fgds_gpu *gpu, pgoff_t bar_pg, pgoff_t n)
{
	unsigned long pfn = fgds_bar_pfn(gpu) + bar_pg;
	unsigned long end = pfn + n;
	struct dev_pagemap *pgmap;
	unsigned long last;
	bool ok;

	if (gpu->mode != FGDS_MODE_EXPORTER_P2PDMA)
		return 0;
	while (pfn < end) {
		pgmap = fgds_get_dev_pagemap(pfn);
		ok = pgmap && pgmap->type == MEMORY_DEVICE_PCI_P2PDMA &&
		     pgmap->nr_range == 1;
		last = ok ? PHYS_PFN(pgmap->range.end) : 0;
		if (pgmap)
			put_dev_pagemap(pgmap);
		if (!ok) {
			dev_err(&gpu->dev,
				"buffer page %#lx of the BAR is not a P2PDMA page of the exporter\n",
				pfn - fgds_bar_pfn(gpu));
			return -EINVAL;
		}
		pfn = last + 1;
	}
	return 0;
}

/*
 * Exporter's pages: counts one registration more (@get) or less on each page
 * of a run, taking fgds's reference on a page whose count leaves zero and
 * giving it back when it returns there; neither ->mapping nor ->index is
 * fgds's to touch. The xarray is walked once along the run rather than from
 * its root per page, its lock let go every XA_CHECK_SCHED pages.
 *
 * Return: pages counted from @first; fewer than @n only when getting, with
 * *@err set (-ENOMEM).
 */
static pgoff_t fgds_holds_count_run(struct fgds_gpu *gpu, pgoff_t first,
				    pgoff_t n, bool get, int *err)
{
	XA_STATE(xas, &gpu->holds, first);
	unsigned long cnt, new;
	struct folio *folio;
	pgoff_t done = 0;
	void *entry;

	*err = 0;
	while (done < n) {
		xas_set(&xas, first + done);
		xas_lock(&xas);
		entry = xas_load(&xas);
		for (;;) {
			cnt = entry ? xa_to_value(entry) : 0;
			if (WARN_ON_ONCE(!get && !cnt))
				goto next;
			new = get ? cnt + 1 : cnt - 1;
			xas_store(&xas, new ? xa_mk_value(new) : NULL);
			if (xas_error(&xas))
				break;
			folio = page_folio(fgds_gpu_page(gpu, first + done));
			if (!cnt) {
				folio_ref_inc(folio);
				gpu->nr_held++;
			} else if (!new) {
				/* Never folio_put(): a P2PDMA page would go back to its pool. */
				folio_ref_dec(folio);
				gpu->nr_held--;
			}
next:
			if (++done == n || !(done % XA_CHECK_SCHED))
				break;
			entry = xas_next(&xas);
		}
		xas_unlock(&xas);
		if (xas_nomem(&xas, GFP_KERNEL))
			continue;
		*err = xas_error(&xas);
		if (*err)
			break;
		cond_resched();
	}
	return done;
}

/* Putting never allocates, so never fails. */
static void fgds_holds_put_run(struct fgds_gpu *gpu, pgoff_t first, pgoff_t n)
{
	int err;

	fgds_holds_count_run(gpu, first, n, false, &err);
}

static void fgds_holds_put_locked(struct fgds_gpu *gpu,
				  const struct fgds_extent *ext,
				  unsigned int nr_ext)
{
	unsigned int e;

	if (fgds_owns_pages(gpu)) {
		gpu->nr_held--;
		return;
	}
	for (e = 0; e < nr_ext; e++)
		fgds_holds_put_run(gpu, ext[e].bar_pg, ext[e].npages);
}

/**
 * fgds_holds_get() - take fgds's reference on the pages of a registration
 * @gpu: the GPU, with a provider set up
 * @ext: the registration's extents
 * @nr_ext: number of extents
 *
 * In modes 2 and 3 fgds holds every page already: the registration is only
 * counted, so that the provider is not torn down under it.
 *
 * Return: 0 or -ENOMEM; on error nothing is held.
 */
int fgds_holds_get(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		   unsigned int nr_ext)
{
	unsigned int e;
	pgoff_t done;
	int ret = 0;

	mutex_lock(&gpu->holds_lock);
	if (fgds_owns_pages(gpu)) {
		gpu->nr_held++;
		mutex_unlock(&gpu->holds_lock);
		return 0;
	}
	for (e = 0; e < nr_ext; e++) {
		done = fgds_holds_count_run(gpu, ext[e].bar_pg, ext[e].npages,
					    true, &ret);
		if (ret) {
			fgds_holds_put_run(gpu, ext[e].bar_pg, done);
			fgds_holds_put_locked(gpu, ext, e);
			break;
		}
	}
	mutex_unlock(&gpu->holds_lock);
	return ret;
}

/**
 * fgds_pages_quiet() - are the pages of a registration free of I/O?
 * @gpu: the GPU
 * @ext: the registration's extents
 * @nr_ext: number of extents
 * @cursor: if not NULL, the buffer page to start from; on return, the first
 *	busy page (or the buffer's length when all are quiet)
 *
 * A folio is quiet when its only references are its idle count, fgds's own
 * and one per PTE mapping one of its pages. Reading the refcount and the
 * mapcount is not atomic, but every transition (PTE insertion takes the
 * reference before the mapcount, zapping drops the mapcount before the
 * reference) errs towards "not quiet". A compound folio only partly covered
 * by the registration counts as a whole: pins of I/O into its other pages
 * make it look busy, never quiet too early. Takes no lock: the caller holds
 * the registration's pages, so the provider stays.
 *
 * Return: true when no folio of the registration is pinned by I/O.
 */
bool fgds_pages_quiet(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		      unsigned int nr_ext, pgoff_t *cursor)
{
	int idle = fgds_idle_refs(gpu) + 1;
	pgoff_t from = cursor ? *cursor : 0, unit, last, bar_pg;
	struct folio *folio;
	unsigned int e;

	for (e = 0; e < nr_ext; e++) {
		if (from >= ext[e].pgoff + ext[e].npages)
			continue;
		bar_pg = ext[e].bar_pg + max(from, ext[e].pgoff) - ext[e].pgoff;
		unit = bar_pg >> gpu->order;
		last = (ext[e].bar_pg + ext[e].npages - 1) >> gpu->order;
		for (; unit <= last; unit++) {
			folio = fgds_unit_folio(gpu, unit);
			if (folio_ref_count(folio) -
			    fgds_folio_mapcount(folio) <= idle)
				continue;
			if (cursor)
				*cursor = ext[e].pgoff +
					  max(unit << gpu->order,
					      ext[e].bar_pg) - ext[e].bar_pg;
			return false;
		}
	}
	if (cursor && nr_ext)
		*cursor = ext[nr_ext - 1].pgoff + ext[nr_ext - 1].npages;
	return true;
}

/**
 * fgds_buf_quiet() - is a registration free of I/O (or holding nothing)?
 * @buf: the registration
 * @cursor: as for fgds_pages_quiet()
 *
 * Return: true when no call of fgds's can reach @buf's pages through
 * @users, and @buf holds no page reference or its pages are quiet.
 */
bool fgds_buf_quiet(struct fgds_buf *buf, pgoff_t *cursor)
{
	struct fgds_gpu *gpu = buf->gpu;
	bool quiet;

	if (!fgds_buf_users_quiet(buf))
		return false;
	mutex_lock(&gpu->holds_lock);
	quiet = !buf->holding ||
		fgds_pages_quiet(gpu, buf->ext, buf->nr_ext, cursor);
	mutex_unlock(&gpu->holds_lock);
	return quiet;
}

/**
 * fgds_buf_bar_pg() - the BAR page of a page of a registration
 * @buf: the registration
 * @pgoff: page of the buffer, counted from its start
 *
 * Return: the BAR page, or the registration's first one for a @pgoff past
 * its end.
 */
pgoff_t fgds_buf_bar_pg(const struct fgds_buf *buf, pgoff_t pgoff)
{
	const struct fgds_extent *e = fgds_buf_extent(buf, pgoff);

	if (e)
		return e->bar_pg + pgoff - e->pgoff;
	return buf->nr_ext ? buf->ext[0].bar_pg : 0;
}

/**
 * fgds_buf_reap() - give back the page references of a registration
 * @buf: a registration whose pages are quiet and can get no new PTE or pin
 *	(revoked, or without mappings and registry entry)
 *
 */
void fgds_buf_reap(struct fgds_buf *buf)
{
	struct fgds_gpu *gpu = buf->gpu;

	mutex_lock(&gpu->holds_lock);
	if (buf->holding) {
		fgds_holds_put_locked(gpu, buf->ext, buf->nr_ext);
		buf->holding = false;
	}
	mutex_unlock(&gpu->holds_lock);
}

static ssize_t bar_size_show(struct device *dev, struct device_attribute *attr,
			     char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);
	resource_size_t len;

	mutex_lock(&gpu->lock);
	len = gpu->geo.len;
	mutex_unlock(&gpu->lock);
	return sysfs_emit(buf, "%llu\n", (unsigned long long)len);
}
static DEVICE_ATTR_RO(bar_size);

static ssize_t mode_show(struct device *dev, struct device_attribute *attr,
			 char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);

	return sysfs_emit(buf, "%s\n", READ_ONCE(gpu->refused) ? "refused" :
			  fgds_mode_name(READ_ONCE(gpu->mode)));
}
static DEVICE_ATTR_RO(mode);

static ssize_t buffers_show(struct device *dev, struct device_attribute *attr,
			    char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);
	unsigned long n;

	mutex_lock(&gpu->bufs_lock);
	n = gpu->nr_bufs;
	mutex_unlock(&gpu->bufs_lock);
	return sysfs_emit(buf, "%lu\n", n);
}
static DEVICE_ATTR_RO(buffers);

static ssize_t bytes_show(struct device *dev, struct device_attribute *attr,
			  char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);
	u64 n;

	mutex_lock(&gpu->bufs_lock);
	n = gpu->nr_bytes;
	mutex_unlock(&gpu->bufs_lock);
	return sysfs_emit(buf, "%llu\n", n);
}
static DEVICE_ATTR_RO(bytes);

static ssize_t bar_show(struct device *dev, struct device_attribute *attr,
			char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);
	int bar;

	mutex_lock(&gpu->lock);
	bar = gpu->geo.bar;
	mutex_unlock(&gpu->lock);
	return sysfs_emit(buf, "%d\n", bar);
}
static DEVICE_ATTR_RO(bar);

static ssize_t held_show(struct device *dev, struct device_attribute *attr,
			 char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);
	unsigned long n;

	mutex_lock(&gpu->holds_lock);
	n = gpu->nr_held;
	mutex_unlock(&gpu->holds_lock);
	return sysfs_emit(buf, "%lu\n", n);
}
static DEVICE_ATTR_RO(held);

static ssize_t pages_made_show(struct device *dev,
			       struct device_attribute *attr, char *buf)
{
	struct fgds_gpu *gpu = dev_get_drvdata(dev);
	u64 n;

	mutex_lock(&gpu->lock);
	n = (u64)gpu->nr_made << FGDS_CHUNK_SHIFT;
	mutex_unlock(&gpu->lock);
	return sysfs_emit(buf, "%llu\n", n);
}
static DEVICE_ATTR_RO(pages_made);

static struct attribute *fgds_gpu_attrs[] = {
	&dev_attr_bar_size.attr,
	&dev_attr_mode.attr,
	&dev_attr_buffers.attr,
	&dev_attr_bytes.attr,
	&dev_attr_bar.attr,
	&dev_attr_held.attr,
	&dev_attr_pages_made.attr,
	NULL,
};

static const struct attribute_group fgds_gpu_group = {
	.attrs = fgds_gpu_attrs,
};

const struct attribute_group *fgds_gpu_groups[] = {
	&fgds_gpu_group,
	NULL,
};

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * fgds internals: one struct fgds_gpu per GPU node, one struct fgds_file per
 * open file, one struct fgds_buf per registration.
 */
#ifndef _FGDS_DRV_H
#define _FGDS_DRV_H

#include <linux/cdev.h>
#include <linux/device.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/rwsem.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>

/* Smallest prefetchable BAR that makes a PCI device a GPU for fgds. */
#define FGDS_MIN_BAR_SIZE	(64ULL << 20)

/**
 * enum fgds_mode - where the struct pages over a GPU's BAR come from
 * @FGDS_MODE_NONE: not set up yet (set up by the first registration while
 *	the GPU has a driver bound, torn down when it unbinds)
 * @FGDS_MODE_EXPORTER_P2PDMA: the GPU's driver registered P2PDMA pages for
 *	its BAR (pci_p2pdma_add_resource()); fgds maps those
 * @FGDS_MODE_P2PDMA: fgds registered P2PDMA pages for the whole BAR and
 *	claimed the whole range from the P2PDMA genpool
 * @FGDS_MODE_GENERIC: MEMORY_DEVICE_GENERIC pages created by fgds; only
 *	where DMA reaches them exactly as it would reach P2PDMA pages
 */
enum fgds_mode {
	FGDS_MODE_NONE,
	FGDS_MODE_EXPORTER_P2PDMA,
	FGDS_MODE_P2PDMA,
	FGDS_MODE_GENERIC,
};

/**
 * enum fgds_pages - the pages= module parameter: which pages fgds creates
 *	over a BAR that has none of the exporter's
 * @FGDS_PAGES_AUTO: GENERIC pages where DMA reaches them exactly as it
 *	would reach P2PDMA pages (no IOMMU translation, no bus offset, no
 *	encryption or bouncing, the P2P distance check passes for every NVMe
 *	controller), else P2PDMA pages where the kernel has them
 * @FGDS_PAGES_P2PDMA: P2PDMA pages only
 * @FGDS_PAGES_GENERIC: GENERIC pages only
 */
enum fgds_pages {
	FGDS_PAGES_AUTO,
	FGDS_PAGES_P2PDMA,
	FGDS_PAGES_GENERIC,
};

/**
 * struct fgds_gpu - one GPU, one node /dev/fgds_DDDD_BB_DD_F
 * @dev: the class device; its refcount keeps this structure alive
 * @cdev: the character device, parented to @dev
 * @pdev: the GPU (reference held)
 * @bar: index of the BAR used (the largest prefetchable memory BAR)
 * @bar_start: CPU physical address of the BAR
 * @bar_bus: PCI bus address of the BAR
 * @bar_len: length of the BAR
 * @list: entry in the global GPU list
 * @lock: protects the fields below it
 * @dead: the GPU is being removed; nothing new may start
 * @mode: current page provider
 * @refused: why the provider was refused (-EOPNOTSUPP, -EBUSY), until unbind
 * @gen: provider generation, bumped at each teardown
 * @bufs: live (not yet released) registrations on this GPU
 * @nr_bufs: registrations counted in sysfs "buffers"
 * @nr_bytes: bytes counted in sysfs "bytes" and against max_bytes_per_gpu
 * @pgmap: GENERIC mode: the pagemap fgds created
 * @order: pages per folio of the provider, as a power of two (GENERIC pages
 *	are 2 MiB folios; all others single pages)
 * @memtype_wc: fgds holds a write-combine memory type reservation on the BAR
 * @p2p_claim: P2PDMA mode: kernel address of the whole-BAR genpool claim
 * @p2p_group: P2PDMA mode: devres group on @pdev holding the P2PDMA resource
 *	if fgds created the device's P2PDMA state itself, else NULL
 * @zombies: released buffers whose pages are still pinned by I/O; each
 *	keeps its dma-buf pinned and mapped until they are quiet (or the GPU's
 *	driver unbinds)
 * @holds_lock: protects @holds, @nr_held and every buffer's @holding; taken
 *	after @lock and after dmabuf->resv
 * @holds: exporter's P2PDMA mode: BAR page index -> number of registrations
 *	holding that page
 * @nr_held: exporter's P2PDMA mode: pages on which fgds holds its own
 *	reference; other modes: registrations not yet quiet (fgds holds every
 *	page for as long as the provider exists)
 * @reaper: retries giving back the page references of revoked buffers and
 *	of @zombies
 */
struct fgds_gpu {
	struct device dev;
	struct cdev cdev;
	struct pci_dev *pdev;
	int bar;
	resource_size_t bar_start;
	pci_bus_addr_t bar_bus;
	resource_size_t bar_len;
	struct list_head list;

	struct mutex lock; /* see the kernel-doc above */
	bool dead;
	enum fgds_mode mode;
	int refused;
	unsigned long gen;
	struct list_head bufs;
	unsigned long nr_bufs;
	u64 nr_bytes;
	struct dev_pagemap *pgmap;
	unsigned int order;
	bool memtype_wc;
	void *p2p_claim;
	void *p2p_group;
	struct list_head zombies;

	struct mutex holds_lock; /* see the kernel-doc above */
	struct xarray holds;
	unsigned long nr_held;
	struct delayed_work reaper;
};

/**
 * struct fgds_file - one open file of a node
 * @gpu: the node's GPU (device reference held)
 * @mapping: the address_space every mapping made through this file uses
 *	(fgds_mapping, shared by all files)
 * @lock: protects @bufs and @nr
 * @bufs: registry, id -> struct fgds_buf; idx = id << PAGE_SHIFT
 * @nr: number of entries in @bufs
 */
struct fgds_file {
	struct fgds_gpu *gpu;
	struct address_space *mapping;
	struct mutex lock; /* see the kernel-doc above */
	struct xarray bufs;
	unsigned int nr;
};

/**
 * struct fgds_extent - a run of the buffer that is contiguous in the BAR
 * @pgoff: first page of the run, counted from the start of the buffer
 * @bar_pg: first page of the run, counted from the start of the BAR
 * @npages: length of the run in pages
 */
struct fgds_extent {
	pgoff_t pgoff;
	pgoff_t bar_pg;
	pgoff_t npages;
};

/**
 * struct fgds_buf - one registration
 * @ref: held by the registry and by each VMA
 * @gpu: the GPU (device reference held)
 * @mapping: address_space of the file it was registered on
 * @vm_pgoff: where its VMAs sit in @mapping (unique, so revocation zaps
 *	exactly this buffer's mappings)
 * @size: registered size in bytes
 * @npages: @size in pages
 * @dmabuf: the dma-buf (reference held)
 * @attach: dynamic attachment, as the GPU's own PCI device
 * @sgt: the exporter's mapping while pinned and mapped
 * @ext: where the buffer lies in the BAR
 * @nr_ext: entries in @ext
 * @gen: provider generation the page holds were taken against
 * @lock: write-held to revoke; read-held by faults while inserting pages
 * @revoked: no new page may be mapped
 * @pinned: dma_buf_pin() succeeded and is not yet undone
 * @holding: the pages of @ext are counted in the GPU's holds
 * @gpu_node: entry in the GPU's @bufs or @zombies
 * @listed: @gpu_node is on the GPU's @bufs
 */
struct fgds_buf {
	struct kref ref;
	struct fgds_gpu *gpu;
	struct address_space *mapping;
	pgoff_t vm_pgoff;
	u64 size;
	pgoff_t npages;
	struct dma_buf *dmabuf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	struct fgds_extent *ext;
	unsigned int nr_ext;
	unsigned long gen;
	struct rw_semaphore lock;
	bool revoked;
	bool pinned;
	bool holding;
	struct list_head gpu_node;
	bool listed;
};

/* module parameters */
extern unsigned int fgds_max_buffers_per_file;
extern unsigned long long fgds_max_bytes_per_gpu;
extern unsigned int fgds_revoke_timeout_ms;
extern int fgds_pages;

extern struct address_space *fgds_mapping;
extern const struct file_operations fgds_fops;
extern const struct attribute_group *fgds_gpu_groups[];

/* gpu.c */
const char *fgds_mode_name(enum fgds_mode mode);
int fgds_gpu_setup_pages(struct fgds_gpu *gpu);
void fgds_gpu_teardown_pages(struct fgds_gpu *gpu);
int fgds_gpu_check_range(struct fgds_gpu *gpu, pgoff_t bar_pg, pgoff_t n);
struct page *fgds_gpu_page(struct fgds_gpu *gpu, pgoff_t bar_pg);
int fgds_holds_get(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		   unsigned int nr_ext);
bool fgds_pages_quiet(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		      unsigned int nr_ext);
void fgds_holds_put(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		    unsigned int nr_ext);
void fgds_gpu_revoke_all(struct fgds_gpu *gpu);
void fgds_gpu_kick_reaper(struct fgds_gpu *gpu);
void fgds_reaper_fn(struct work_struct *work);
bool fgds_buf_reap(struct fgds_buf *buf);
bool fgds_buf_quiet(struct fgds_buf *buf);

/* buf.c */
void fgds_buf_revoke(struct fgds_buf *buf);
void fgds_buf_put(struct fgds_buf *buf);
void fgds_buf_drop_dmabuf(struct fgds_buf *buf);
void fgds_buf_free(struct fgds_buf *buf);

#endif /* _FGDS_DRV_H */

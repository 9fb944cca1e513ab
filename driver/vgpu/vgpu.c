// SPDX-License-Identifier: GPL-2.0
/*
 * vgpu: the fgds test rig's fake GPU.
 *
 * Binds QEMU's ivshmem-plain device and exports ranges of its BAR2 ("VRAM")
 * as dma-bufs, the way a GPU driver exports VRAM buffers: importers get DMA
 * addresses only, userspace can mmap a buffer write-combined, and a buffer
 * can be revoked (as when a GPU evicts VRAM or goes away) to test that
 * importers stop touching it.
 */

#define pr_fmt(fmt) KBUILD_MODNAME ": " fmt

#include <linux/bitops.h>
#include <linux/cdev.h>
#include <linux/delay.h>
#include <linux/device.h>
#include <linux/dma-buf.h>
#include <linux/dma-mapping.h>
#include <linux/dma-resv.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/genalloc.h>
#include <linux/idr.h>
#include <linux/io.h>
#include <linux/jiffies.h>
#include <linux/memremap.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mutex.h>
#include <linux/pci.h>
#include <linux/pci-p2pdma.h>
#include <linux/scatterlist.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/string.h>
#include <linux/sysfs.h>
#include <linux/uaccess.h>
#include <linux/wait.h>
#include <linux/workqueue.h>

#include <uapi/linux/vgpu.h>

#include "fgds_compat.h"
#include "fgds_p2p.h"

#define VGPU_BAR		2
#define VGPU_MAX_DEVICES	64
#define VGPU_PCI_DEVICE_IVSHMEM	0x1110

/* Largest page-aligned length a scatterlist entry can describe. */
#define VGPU_MAX_SEG		ALIGN_DOWN(UINT_MAX, PAGE_SIZE)

/* How long vgpu waits between complaints about importers. */
#define VGPU_REMOVE_WAIT	(10 * HZ)

/* How often vgpu looks whether a released buffer's pages are let go. */
#define VGPU_RECLAIM_DELAY	(HZ / 20)

/* VGPU_ALLOC_SKEW: where the buffer's first 2 MiB lie, past the range start. */
#define VGPU_SKEW_HEAD		PAGE_SIZE
#define VGPU_SKEW_ALIGN		SZ_2M

/**
 * DOC: design
 *
 * Memory: BAR2 of the ivshmem device. In ``plain`` mode vgpu keeps its own
 * genalloc pool over the BAR's physical range; the BAR has no struct pages
 * and the device no P2PDMA state, like VRAM under amdgpu or NVIDIA's driver.
 * ``provider`` mode is ``plain`` with the P2PDMA state and provider that
 * vfio-pci sets up on 7.x (pcim_p2pdma_init(), no pages): its importers'
 * tables come from dma_buf_phys_vec_to_sgt(). In ``p2pdma`` mode vgpu registers the BAR with
 * pci_p2pdma_add_resource() (not published unless publish=1, so no other
 * driver picks it up through pci_p2pmem_find() and userspace cannot take it
 * from p2pmem/allocate) and allocates from the P2PDMA pool, so buffers
 * have P2PDMA struct pages owned by vgpu that an importer such as fgds can
 * reuse. Either way a buffer is one contiguous BAR range.
 *
 * Memory type: at probe vgpu reserves the whole BAR as write-combined
 * (arch_io_reserve_memtype_wc() and arch_phys_wc_add(), as GPU drivers do),
 * so every later mapping of the range, by vgpu or by an importer, gets a
 * consistent WC (or UC) type instead of write-back.
 *
 * Mappings for importers: DMA addresses only, never pages. The importer
 * must set allow_peer2peer and be revocable. For vgpu's own PCI device the
 * address is the BAR's bus address. For other devices the P2PDMA rules
 * apply where the kernel has CONFIG_PCI_P2PDMA (7.x: the provider helpers;
 * 6.x: pci_p2pdma_distance() and the switch/ACS check); otherwise the
 * range is mapped with dma_map_resource(), as amdgpu does.
 *
 * Revocation waits, under the reservation lock, for every fence in the
 * buffer's reservation object, as vfio-pci does: an importer that still has
 * DMA in flight when it is told to let go adds a fence there and signals it
 * once that DMA is done. Only then does vgpu treat the memory as its own
 * again (a buffer's ``fill`` stands for its next user).
 *
 * Locking: &vgpu_device.lock protects the buffer list and the removed flag.
 * Each buffer's revoked flag, pin count and mapping list are protected by
 * its dma-buf's reservation lock, which the dma-buf core holds around
 * pin/unpin/map/unmap and which vgpu takes around revocation and CPU page
 * faults. Lock order: &vgpu_device.lock is never held while taking a
 * reservation lock.
 *
 * Lifetime: a buffer holds a reference on its &vgpu_device (whose embedded
 * class device frees it), so buffers may outlive the PCI device; they are
 * revoked when the device goes, and removal waits until importers have
 * unmapped them. In p2pdma mode the P2PDMA pool dies with the driver
 * binding, so removal also waits until no page of any buffer is referenced
 * any more and gives every range back; the dma-bufs live on as empty,
 * revoked shells until userspace closes them. A P2PDMA range whose pages
 * are still referenced when its dma-buf is released (an importer's I/O in
 * flight) goes back to the pool only once they are let go.
 */

enum vgpu_mode {
	VGPU_MODE_PLAIN,
	VGPU_MODE_P2PDMA,
	VGPU_MODE_PROVIDER,
};

static const char * const vgpu_mode_names[] = {
	[VGPU_MODE_PLAIN] = "plain",
	[VGPU_MODE_P2PDMA] = "p2pdma",
	[VGPU_MODE_PROVIDER] = "provider",
};

/* How an importing device reaches the BAR. */
enum vgpu_route {
	VGPU_ROUTE_SELF,	/* vgpu's own device: BAR bus address */
	VGPU_ROUTE_BUS_ADDR,	/* behind the same switch: bus address */
	VGPU_ROUTE_RESOURCE,	/* dma_map_resource() */
	VGPU_ROUTE_PROVIDER,	/* 7.x: dma_buf_phys_vec_to_sgt() */
};

/* Distinct importing devices vgpu keeps count of, per device. */
#define VGPU_MAX_IMPORTERS	8

/**
 * struct vgpu_importer - a device that has mappings of vgpu's buffers
 * @name: its dev_name(); empty for a free slot
 * @maps: how many tables it holds now
 */
struct vgpu_importer {
	char name[32];
	unsigned int maps;
};

/**
 * struct vgpu_device - one bound ivshmem device
 * @dev: class device /sys/class/vgpu/vgpuN; its release frees this struct
 * @cdev: /dev/vgpuN
 * @pdev: the PCI device (referenced until @dev is released)
 * @id: N in vgpuN
 * @id_freed: removal already gave @id back, for a rebound device to reuse
 * @mode: memory mode chosen at probe
 * @bar_phys: CPU physical address of BAR2
 * @bar_bus: PCI bus address of BAR2
 * @bar_size: length of BAR2
 * @pool: plain mode: allocator over [@bar_phys, @bar_phys + @bar_size)
 * @provider: 7.x with CONFIG_PCI_P2PDMA: P2PDMA provider of BAR2
 * @importers_lock: protects @importers
 * @importers: the devices that hold mappings now (sysfs ``importers``)
 * @lock: protects @buffers, @nr_buffers, @nr_p2p_ranges and @removed
 * @buffers: live buffers (&vgpu_buffer.node)
 * @nr_buffers: number of entries in @buffers
 * @nr_p2p_ranges: p2pdma mode: ranges not yet back in the P2PDMA pool
 * @removed: the PCI device is gone; no new buffers
 * @zombies: p2pdma mode: released buffers whose pages are still referenced
 * @reclaim: gives the ranges of @zombies back once their pages are let go
 * @wq: woken when a buffer is unmapped by an importer, or a buffer or range
 *	is released
 * @last_revoke: the latest revocation: the buffer's BAR2 offset, how long
 *	the importers' invalidation callbacks took and how long the wait for
 *	their fences took, in ns (under @lock)
 */
struct vgpu_device {
	struct device dev;
	struct cdev cdev;
	struct pci_dev *pdev;
	int id;
	bool id_freed;
	enum vgpu_mode mode;
	phys_addr_t bar_phys;
	pci_bus_addr_t bar_bus;
	resource_size_t bar_size;
	struct gen_pool *pool;
	struct p2pdma_provider *provider;
	spinlock_t importers_lock;	/* protects @importers */
	struct vgpu_importer importers[VGPU_MAX_IMPORTERS];
	struct mutex lock;	/* see above */
	struct list_head buffers;
	unsigned int nr_buffers;
	unsigned int nr_p2p_ranges;
	bool removed;
	struct list_head zombies;
	struct delayed_work reclaim;
	wait_queue_head_t wq;
	struct {
		u64 bar_offset;
		u64 invalidate_ns;
		u64 fence_ns;
	} last_revoke;
};

/**
 * struct vgpu_buffer - one exported BAR range
 * @vgpu: owning device (referenced)
 * @dmabuf: the dma-buf; it owns this struct
 * @node: entry in &vgpu_device.buffers, or in &vgpu_device.zombies once
 *	released with pages still referenced
 * @bar_offset: start of the range in BAR2
 * @size: length of the buffer (the dma-buf's size)
 * @range_size: length of the range in BAR2 (more than @size for a skewed
 *	buffer)
 * @segs: where the buffer lies in BAR2, in buffer order: (offset, length)
 * @nr_segs: entries in @segs
 * @readonly: exported read-only
 * @p2p_addr: p2pdma mode: address returned by pci_alloc_p2pmem(), NULL
 *	once the range is back in the pool (under &vgpu_device.lock)
 * @p2p_idle_refs: p2pdma mode: page reference count of an unused page
 * @remove_seen: device removal has taken care of this buffer (under lock)
 * @warn_at: zombie: when to complain next that its pages are still held
 * @revoked: no new mappings, CPU faults get SIGBUS (under resv)
 * @pins: importer pins (under resv)
 * @maps: live importer mappings, &vgpu_mapping.node (under resv)
 * @nr_maps: number of entries in @maps (written under resv)
 */
struct vgpu_buffer {
	struct vgpu_device *vgpu;
	struct dma_buf *dmabuf;
	struct list_head node;
	u64 bar_offset;
	u64 size;
	u64 range_size;
	struct {
		u64 off;
		u64 len;
	} segs[2];
	unsigned int nr_segs;
	bool readonly;
	void *p2p_addr;
	int p2p_idle_refs;
	bool remove_seen;
	unsigned long warn_at;
	bool revoked;
	unsigned int pins;
	struct list_head maps;
	unsigned int nr_maps;
};

/**
 * struct vgpu_mapping - one sg_table handed to an importer
 * @node: entry in &vgpu_buffer.maps
 * @sgt: the table given to the importer
 * @table: storage for @sgt unless a 7.x helper allocated it
 * @route: how @sgt was made, so that unmap undoes exactly that
 */
struct vgpu_mapping {
	struct list_head node;
	struct sg_table *sgt;
	struct sg_table table;
	enum vgpu_route route;
};

static char *mode = "plain";
module_param(mode, charp, 0444);
MODULE_PARM_DESC(mode, "BAR2 memory: \"plain\" (no struct pages, no P2PDMA state; default), \"provider\" (no struct pages, a P2PDMA provider as vfio-pci has on 7.x) or \"p2pdma\" (P2PDMA pages owned by vgpu); the last two need CONFIG_PCI_P2PDMA");

static char refuse_importer[32];
module_param_string(refuse_importer, refuse_importer, sizeof(refuse_importer),
		    0644);
MODULE_PARM_DESC(refuse_importer, "Refuse attachments by the device of this name (e.g. 0000:02:00.0), as an exporter refuses a device whose path it does not take; empty for none (default)");

static bool publish;
module_param(publish, bool, 0444);
MODULE_PARM_DESC(publish, "mode=p2pdma: also publish the P2PDMA memory, so that userspace can take it from p2pmem/allocate in sysfs (the benchmark's p2pmem mode; default off)");

static unsigned int revoke_timeout_ms = 10000;
module_param(revoke_timeout_ms, uint, 0644);
MODULE_PARM_DESC(revoke_timeout_ms, "How long a write to sysfs revoke waits for importers to unmap the buffer once their fences signalled (default 10000)");

static ulong bar_bytes;
module_param(bar_bytes, ulong, 0644);
MODULE_PARM_DESC(bar_bytes, "Resize BAR2 to this many bytes (a power of two) when binding, as GPU drivers resize their BARs at probe; 0 keeps it (default)");

static enum vgpu_mode vgpu_mode;
static struct workqueue_struct *vgpu_wq;
static struct class *vgpu_class;
static dev_t vgpu_devt;
static DEFINE_IDA(vgpu_ida);

static struct vgpu_device *to_vgpu(struct device *dev)
{
	return container_of(dev, struct vgpu_device, dev);
}

/* --- BAR memory --- */

/**
 * vgpu_range_alloc() - take a free contiguous range of BAR2 for @buf
 * @vgpu: the device, its lock held
 * @buf: buffer whose @size is set; @bar_offset (and @p2p_addr) are filled in
 *
 * Return: 0, or -ENOMEM if no free range of that size exists.
 */
static int vgpu_range_alloc(struct vgpu_device *vgpu, struct vgpu_buffer *buf)
{
	unsigned long addr;
	void *p2p;
	u64 i;

	lockdep_assert_held(&vgpu->lock);

	if (vgpu->mode != VGPU_MODE_P2PDMA) {
		struct genpool_data_align align = { .align = VGPU_SKEW_ALIGN };

		if (buf->range_size != buf->size)
			addr = gen_pool_alloc_algo(vgpu->pool, buf->range_size,
						   gen_pool_first_fit_align,
						   &align);
		else
			addr = gen_pool_alloc(vgpu->pool, buf->range_size);
		if (!addr)
			return -ENOMEM;
		buf->bar_offset = addr - vgpu->bar_phys;
		return 0;
	}

	p2p = pci_alloc_p2pmem(vgpu->pdev, buf->range_size);
	if (!p2p)
		return -ENOMEM;
	buf->p2p_addr = p2p;
	buf->bar_offset = pci_p2pmem_virt_to_bus(vgpu->pdev, p2p) -
			  vgpu->bar_bus;
	vgpu->nr_p2p_ranges++;
	/*
	 * P2PDMA pages idle at refcount 1 up to 6.12 and at 0 from 7.x. Note
	 * what a page fresh from the pool has, so that vgpu can tell later
	 * whether someone still holds one.
	 */
	buf->p2p_idle_refs = page_ref_count(virt_to_page(p2p));
	for (i = 0; i < buf->range_size; i += PAGE_SIZE) {
		struct page *page = virt_to_page(p2p + i);

		WARN_ONCE(page_ref_count(page) != buf->p2p_idle_refs,
			  "vgpu%d: free P2PDMA page at BAR2 offset %#llx has refcount %d, others %d: someone kept a reference to a released buffer\n",
			  vgpu->id, buf->bar_offset + i, page_ref_count(page),
			  buf->p2p_idle_refs);
		/* The pages are vgpu's: an importer must not claim them. */
		WARN_ONCE(READ_ONCE(page->mapping),
			  "vgpu%d: free P2PDMA page at BAR2 offset %#llx has a ->mapping: an importer wrote it\n",
			  vgpu->id, buf->bar_offset + i);
	}
	return 0;
}

/*
 * p2pdma mode: true if no page of @buf is referenced beyond the idle count,
 * i.e. nobody maps it or does I/O to it through struct pages. Else *@busy is
 * the offset of a referenced page in @buf.
 */
static bool vgpu_p2p_idle(struct vgpu_buffer *buf, u64 *busy)
{
	u64 i;

	for (i = 0; i < buf->range_size; i += PAGE_SIZE) {
		if (page_ref_count(virt_to_page(buf->p2p_addr + i)) !=
		    buf->p2p_idle_refs) {
			*busy = i;
			return false;
		}
	}
	return true;
}

/**
 * vgpu_range_free() - give @buf's range back to the device's pool
 * @vgpu: the device, its lock held
 * @buf: the buffer
 *
 * In p2pdma mode the caller has checked vgpu_p2p_idle(): a P2PDMA page
 * freed while referenced would be handed out again while still in use, and
 * freed a second time when its last reference drops. Does nothing if
 * removal already gave the range back.
 */
static void vgpu_range_free(struct vgpu_device *vgpu, struct vgpu_buffer *buf)
{
	lockdep_assert_held(&vgpu->lock);

	if (vgpu->mode != VGPU_MODE_P2PDMA) {
		gen_pool_free(vgpu->pool, vgpu->bar_phys + buf->bar_offset,
			      buf->range_size);
		return;
	}
	if (!buf->p2p_addr)
		return;
	pci_free_p2pmem(vgpu->pdev, buf->p2p_addr, buf->range_size);
	buf->p2p_addr = NULL;
	vgpu->nr_p2p_ranges--;
}

/* --- DMA mappings for importers --- */

/*
 * With a provider (7.x, modes provider and p2pdma) its helpers pick bus
 * address or IOMMU mapping themselves, but only for the PCI device itself
 * (pci_p2pdma_map_type() does not walk up from a child device as
 * pci_p2pdma_distance() does). Without one (6.x, or mode plain), a bus
 * address for a switch-local pair, as the DMA layer does for P2PDMA pages,
 * and dma_map_resource() through the host bridge otherwise, as amdgpu does.
 */
static int vgpu_p2p_pick(struct vgpu_device *vgpu, struct device *dev,
			 enum vgpu_route *route)
{
	if (vgpu->provider) {
		if (!dev_is_pci(dev)) {
			dev_warn_ratelimited(&vgpu->dev, "%s: attach with the PCI device itself, not a child of it\n",
					     dev_name(dev));
			return -EINVAL;
		}
		*route = VGPU_ROUTE_PROVIDER;
		return 0;
	}
	/* pci_p2pdma_distance() found a PCI device at or above @dev. */
	while (dev && !dev_is_pci(dev))
		dev = dev->parent;
	if (WARN_ON_ONCE(!dev))
		return -EINVAL;
	if (fgds_p2p_switch_local(vgpu->pdev, to_pci_dev(dev)))
		*route = VGPU_ROUTE_BUS_ADDR;
	else
		*route = VGPU_ROUTE_RESOURCE;
	return 0;
}

/* Whether refuse_importer names @dev (it is set from sysfs at any time). */
static bool vgpu_refused(struct device *dev)
{
	bool refused;

	kernel_param_lock(THIS_MODULE);
	refused = refuse_importer[0] &&
		  sysfs_streq(refuse_importer, dev_name(dev));
	kernel_param_unlock(THIS_MODULE);
	return refused;
}

/* Counts @dev's tables up (@delta 1) or down (-1) in vgpu->importers. */
static void vgpu_importer_count(struct vgpu_device *vgpu, struct device *dev,
				int delta)
{
	struct vgpu_importer *imp, *free = NULL;

	spin_lock(&vgpu->importers_lock);
	for (imp = vgpu->importers;
	     imp < vgpu->importers + VGPU_MAX_IMPORTERS; imp++) {
		if (!imp->name[0]) {
			free = free ?: imp;
			continue;
		}
		if (!strcmp(imp->name, dev_name(dev)))
			goto found;
	}
	imp = free;
	if (!imp || delta < 0)
		goto out;
	strscpy(imp->name, dev_name(dev), sizeof(imp->name));
found:
	imp->maps += delta;
	if (!imp->maps)
		imp->name[0] = '\0';
out:
	spin_unlock(&vgpu->importers_lock);
}

/* The P2PDMA rules, for a device other than vgpu's own. */
static int vgpu_p2p_route(struct vgpu_device *vgpu, struct device *dev,
			  enum vgpu_route *route)
{
	/* Logs why a pair is refused. */
	if (pci_p2pdma_distance(vgpu->pdev, dev, true) < 0) {
		dev_warn_ratelimited(&vgpu->dev, "%s cannot reach BAR2 peer-to-peer (see the messages above); put it behind the same PCIe switch as %s\n",
				     dev_name(dev), pci_name(vgpu->pdev));
		return -EINVAL;
	}
	return vgpu_p2p_pick(vgpu, dev, route);
}

/**
 * vgpu_route() - decide how importing device @dev reaches the BAR
 * @vgpu: the exporting device
 * @dev: the importer's device (&dma_buf_attachment.dev)
 * @route: the answer
 *
 * Return: 0, or -EINVAL if the P2PDMA rules say @dev cannot reach the BAR.
 */
static int vgpu_route(struct vgpu_device *vgpu, struct device *dev,
		      enum vgpu_route *route)
{
	if (vgpu_refused(dev)) {
		dev_info_ratelimited(&vgpu->dev, "%s refused: refuse_importer names it\n",
				     dev_name(dev));
		return -EINVAL;
	}
	if (dev == &vgpu->pdev->dev) {
		*route = VGPU_ROUTE_SELF;
		return 0;
	}
	if (!IS_ENABLED(CONFIG_PCI_P2PDMA)) {
		*route = VGPU_ROUTE_RESOURCE;
		return 0;
	}
	return vgpu_p2p_route(vgpu, dev, route);
}

static void vgpu_unmap_resource(struct device *dev, struct sg_table *sgt,
				unsigned int nents, enum dma_data_direction dir)
{
	struct scatterlist *sg;
	unsigned int i;

	for_each_sg(sgt->sgl, sg, nents, i)
		dma_unmap_resource(dev, sg_dma_address(sg), sg_dma_len(sg),
				   dir, DMA_ATTR_SKIP_CPU_SYNC);
}

/**
 * vgpu_fill_sgt() - build a DMA-address-only table for @buf
 * @buf: the buffer
 * @map: mapping whose @route is set; @table is filled in
 * @dev: importing device
 * @dir: DMA direction
 *
 * The table's entries have no pages (page_link is NULL), only DMA addresses
 * and lengths, each at most VGPU_MAX_SEG and page aligned.
 *
 * Return: 0, -ENOMEM, or -EIO if dma_map_resource() failed.
 */
static int vgpu_fill_sgt(struct vgpu_buffer *buf, struct vgpu_mapping *map,
			 struct device *dev, enum dma_data_direction dir)
{
	struct vgpu_device *vgpu = buf->vgpu;
	unsigned int nents = 0, n, i;
	struct scatterlist *sg;
	u64 off = 0;
	int ret;

	for (n = 0; n < buf->nr_segs; n++)
		nents += DIV_ROUND_UP(buf->segs[n].len, VGPU_MAX_SEG);
	ret = sg_alloc_table(&map->table, nents, GFP_KERNEL);
	if (ret)
		return ret;

	n = 0;
	for_each_sg(map->table.sgl, sg, nents, i) {
		u64 bar = buf->segs[n].off + off;
		u64 len = min_t(u64, buf->segs[n].len - off, VGPU_MAX_SEG);
		dma_addr_t addr;

		if (map->route == VGPU_ROUTE_RESOURCE) {
			addr = dma_map_resource(dev, vgpu->bar_phys + bar, len,
						dir, DMA_ATTR_SKIP_CPU_SYNC);
			if (dma_mapping_error(dev, addr)) {
				dev_warn_ratelimited(&vgpu->dev, "cannot DMA-map BAR2 range %#llx+%#llx for %s\n",
						     bar, len, dev_name(dev));
				vgpu_unmap_resource(dev, &map->table, i, dir);
				sg_free_table(&map->table);
				return -EIO;
			}
		} else {
			addr = vgpu->bar_bus + bar;
		}
		sg_dma_address(sg) = addr;
		sg_dma_len(sg) = len;
		off += len;
		if (off == buf->segs[n].len) {
			n++;
			off = 0;
		}
	}
	map->sgt = &map->table;
	return 0;
}

/**
 * vgpu_map_dma_buf() - &dma_buf_ops.map_dma_buf
 * @attach: the importer's attachment
 * @dir: DMA direction
 *
 * Called with the reservation lock held.
 *
 * Return: a table of DMA addresses for @attach->dev, or ERR_PTR(-ENODEV) if
 * the buffer is revoked, -EINVAL if @attach->dev cannot reach the BAR, -EIO
 * if DMA-mapping failed, -ENOMEM.
 */
static struct sg_table *vgpu_map_dma_buf(struct dma_buf_attachment *attach,
					 enum dma_data_direction dir)
{
	struct vgpu_buffer *buf = attach->dmabuf->priv;
	struct vgpu_mapping *map;
	int ret;

	dma_resv_assert_held(attach->dmabuf->resv);

	if (buf->revoked)
		return ERR_PTR(-ENODEV);

	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!map)
		return ERR_PTR(-ENOMEM);

	ret = vgpu_route(buf->vgpu, attach->dev, &map->route);
	if (ret)
		goto err_free;

	if (map->route == VGPU_ROUTE_PROVIDER) {
#if FGDS_HAVE_P2PDMA_PROVIDER
		struct phys_vec vec[ARRAY_SIZE(buf->segs)];
		unsigned int n;

		for (n = 0; n < buf->nr_segs; n++) {
			vec[n].paddr = buf->vgpu->bar_phys + buf->segs[n].off;
			vec[n].len = buf->segs[n].len;
		}
		map->sgt = dma_buf_phys_vec_to_sgt(attach, buf->vgpu->provider,
						   vec, buf->nr_segs, buf->size,
						   dir);
		ret = PTR_ERR_OR_ZERO(map->sgt);
		if (ret)
			dev_warn_ratelimited(&buf->vgpu->dev, "cannot DMA-map BAR2 range %#llx+%#llx for %s: %d\n",
					     buf->bar_offset, buf->size,
					     dev_name(attach->dev), ret);
#else
		ret = -EINVAL;
#endif
	} else {
		ret = vgpu_fill_sgt(buf, map, attach->dev, dir);
	}
	if (ret)
		goto err_free;

	list_add(&map->node, &buf->maps);
	WRITE_ONCE(buf->nr_maps, buf->nr_maps + 1);
	vgpu_importer_count(buf->vgpu, attach->dev, 1);
	return map->sgt;

err_free:
	kfree(map);
	return ERR_PTR(ret);
}

/**
 * vgpu_unmap_dma_buf() - &dma_buf_ops.unmap_dma_buf
 * @attach: the importer's attachment
 * @sgt: a table returned by vgpu_map_dma_buf() for @attach
 * @dir: DMA direction it was mapped with
 *
 * Called with the reservation lock held. Undoes exactly what the map did
 * and wakes a revocation waiting for importers to let go.
 */
static void vgpu_unmap_dma_buf(struct dma_buf_attachment *attach,
			       struct sg_table *sgt,
			       enum dma_data_direction dir)
{
	struct vgpu_buffer *buf = attach->dmabuf->priv;
	struct vgpu_mapping *map;

	dma_resv_assert_held(attach->dmabuf->resv);

	list_for_each_entry(map, &buf->maps, node)
		if (map->sgt == sgt)
			goto found;
	WARN_ONCE(1, "vgpu%d: unmap of a table vgpu did not hand out\n",
		  buf->vgpu->id);
	return;

found:
	switch (map->route) {
	case VGPU_ROUTE_PROVIDER:
#if FGDS_HAVE_P2PDMA_PROVIDER
		/*
		 * dma_buf_phys_vec_to_sgt() zeroes orig_nents as a marker and
		 * dma_buf_free_sgt() frees the table with sg_free_table(),
		 * which frees orig_nents entries: the scatterlist leaks (7.2,
		 * 7.3; kernel-patches/dma-buf-free-sgt-leak/, docs/upstream.md).
		 * Its entries are its nents, as sg_alloc_table() made them.
		 */
		sgt->orig_nents = sgt->nents;
		dma_buf_free_sgt(attach, sgt, dir);
#endif
		break;
	case VGPU_ROUTE_RESOURCE:
		vgpu_unmap_resource(attach->dev, sgt, sgt->nents, dir);
		fallthrough;
	case VGPU_ROUTE_SELF:
	case VGPU_ROUTE_BUS_ADDR:
		sg_free_table(sgt);
		break;
	}
	list_del(&map->node);
	kfree(map);
	WRITE_ONCE(buf->nr_maps, buf->nr_maps - 1);
	vgpu_importer_count(buf->vgpu, attach->dev, -1);
	wake_up_all(&buf->vgpu->wq);
}

/* --- dma-buf exporter --- */

static int vgpu_dmabuf_attach(struct dma_buf *dmabuf,
			      struct dma_buf_attachment *attach)
{
	struct vgpu_buffer *buf = dmabuf->priv;
	enum vgpu_route route;

	if (!attach->peer2peer) {
		dev_dbg(&buf->vgpu->dev, "%s: importer without allow_peer2peer refused: vgpu memory is PCI BAR memory without struct pages\n",
			dev_name(attach->dev));
		return -EOPNOTSUPP;
	}
	if (!fgds_dma_buf_attach_revocable(attach)) {
		dev_dbg(&buf->vgpu->dev, "%s: importer refused: it cannot be told to unmap (no invalidation callback)\n",
			dev_name(attach->dev));
		return -EOPNOTSUPP;
	}
	if (READ_ONCE(buf->revoked))
		return -ENODEV;
	/* Refuse a device that cannot reach the BAR now rather than at map. */
	return vgpu_route(buf->vgpu, attach->dev, &route);
}

/* VRAM here never moves: pin and unpin only count. */
static int vgpu_dmabuf_pin(struct dma_buf_attachment *attach)
{
	struct vgpu_buffer *buf = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);

	if (buf->revoked)
		return -ENODEV;
	WRITE_ONCE(buf->pins, buf->pins + 1);
	return 0;
}

static void vgpu_dmabuf_unpin(struct dma_buf_attachment *attach)
{
	struct vgpu_buffer *buf = attach->dmabuf->priv;

	dma_resv_assert_held(attach->dmabuf->resv);

	if (WARN_ON_ONCE(!buf->pins))
		return;
	WRITE_ONCE(buf->pins, buf->pins - 1);
}

static void vgpu_dmabuf_release(struct dma_buf *dmabuf)
{
	struct vgpu_buffer *buf = dmabuf->priv;
	struct vgpu_device *vgpu = buf->vgpu;

	u64 busy;

	/* The core detached every importer before the last reference went. */
	WARN_ON_ONCE(buf->pins || buf->nr_maps);

	mutex_lock(&vgpu->lock);
	list_del(&buf->node);
	vgpu->nr_buffers--;
	if (vgpu->mode == VGPU_MODE_P2PDMA && buf->p2p_addr &&
	    !vgpu_p2p_idle(buf, &busy)) {
		/*
		 * An importer still holds pages of the buffer (I/O it started
		 * may be in flight). Handing them out again now could let that
		 * I/O land in the next buffer: wait until they are let go.
		 */
		dev_warn(&vgpu->dev, "buffer %#llx released while its P2PDMA page at offset %#llx is still referenced (refcount %d, idle %d); its range goes back to the pool once the importer lets go\n",
			 buf->bar_offset, busy,
			 page_ref_count(virt_to_page(buf->p2p_addr + busy)),
			 buf->p2p_idle_refs);
		buf->warn_at = jiffies + VGPU_REMOVE_WAIT;
		list_add_tail(&buf->node, &vgpu->zombies);
		if (queue_delayed_work(vgpu_wq, &vgpu->reclaim,
				       VGPU_RECLAIM_DELAY))
			get_device(&vgpu->dev);
		mutex_unlock(&vgpu->lock);
		return;
	}
	vgpu_range_free(vgpu, buf);
	mutex_unlock(&vgpu->lock);
	wake_up_all(&vgpu->wq);

	kfree(buf);
	put_device(&vgpu->dev);
}

/*
 * p2pdma mode: give the ranges of released buffers back to the pool once no
 * page of theirs is referenced any more. A queued run holds a reference on
 * the device; each zombie holds its own.
 */
static void vgpu_reclaim_work(struct work_struct *work)
{
	struct vgpu_device *vgpu = container_of(to_delayed_work(work),
						struct vgpu_device, reclaim);
	struct vgpu_buffer *buf, *tmp;
	LIST_HEAD(done);
	u64 busy;

	mutex_lock(&vgpu->lock);
	list_for_each_entry_safe(buf, tmp, &vgpu->zombies, node) {
		if (vgpu_p2p_idle(buf, &busy)) {
			vgpu_range_free(vgpu, buf);
			list_move(&buf->node, &done);
		} else if (time_after(jiffies, buf->warn_at)) {
			dev_warn(&vgpu->dev, "released buffer %#llx: P2PDMA page at offset %#llx still referenced (refcount %d, idle %d)\n",
				 buf->bar_offset, busy,
				 page_ref_count(virt_to_page(buf->p2p_addr + busy)),
				 buf->p2p_idle_refs);
			buf->warn_at = jiffies + VGPU_REMOVE_WAIT;
		}
	}
	if (!list_empty(&vgpu->zombies) &&
	    queue_delayed_work(vgpu_wq, &vgpu->reclaim, VGPU_RECLAIM_DELAY))
		get_device(&vgpu->dev);
	mutex_unlock(&vgpu->lock);
	wake_up_all(&vgpu->wq);

	list_for_each_entry_safe(buf, tmp, &done, node) {
		kfree(buf);
		put_device(&vgpu->dev);
	}
	/* The queued run's reference; may be the last one. */
	put_device(&vgpu->dev);
}

/* The page frame of byte @off of @buf (inside it). */
static unsigned long vgpu_buf_pfn(struct vgpu_buffer *buf, u64 off)
{
	unsigned int n;

	for (n = 0; n < buf->nr_segs - 1 && off >= buf->segs[n].len; n++)
		off -= buf->segs[n].len;
	return PHYS_PFN(buf->vgpu->bar_phys + buf->segs[n].off + off);
}

static vm_fault_t vgpu_vm_fault(struct vm_fault *vmf)
{
	struct vm_area_struct *vma = vmf->vma;
	struct vgpu_buffer *buf = vma->vm_private_data;
	u64 base = (u64)vma->vm_pgoff << PAGE_SHIFT;
	unsigned long addr;
	vm_fault_t ret;

	/*
	 * The reservation lock orders the fault against revocation, which
	 * sets revoked and zaps the mappings under the same lock: no PTE
	 * appears after a revocation.
	 */
	dma_resv_lock(buf->dmabuf->resv, NULL);
	if (buf->revoked) {
		ret = VM_FAULT_SIGBUS;
		goto out;
	}
	ret = vmf_insert_pfn(vma, vmf->address,
			     vgpu_buf_pfn(buf, base + vmf->address -
					  vma->vm_start));
	if (ret != VM_FAULT_NOPAGE)
		goto out;
	/* Map the rest of the VMA now; one fault per page is slow under TCG. */
	for (addr = vma->vm_start; addr < vma->vm_end; addr += PAGE_SIZE) {
		if (vmf_insert_pfn(vma, addr,
				   vgpu_buf_pfn(buf, base + addr -
						vma->vm_start)) !=
		    VM_FAULT_NOPAGE)
			break;
	}
out:
	dma_resv_unlock(buf->dmabuf->resv);
	return ret;
}

static const struct vm_operations_struct vgpu_vm_ops = {
	.fault = vgpu_vm_fault,
};

static int vgpu_dmabuf_mmap(struct dma_buf *dmabuf, struct vm_area_struct *vma)
{
	struct vgpu_buffer *buf = dmabuf->priv;
	unsigned long npages = buf->size >> PAGE_SHIFT;

	if (!(vma->vm_flags & VM_MAYSHARE)) {
		dev_dbg(&buf->vgpu->dev, "mmap of buffer %#llx refused: only MAP_SHARED is supported\n",
			buf->bar_offset);
		return -EINVAL;
	}
	if (vma->vm_pgoff >= npages || vma_pages(vma) > npages - vma->vm_pgoff)
		return -EINVAL;
	if (READ_ONCE(buf->revoked))
		return -ENODEV;

	fgds_vm_flags_set(vma, VM_PFNMAP | VM_IO | VM_DONTEXPAND | VM_DONTDUMP);
	vma->vm_page_prot = pgprot_writecombine(vma->vm_page_prot);
	vma->vm_ops = &vgpu_vm_ops;
	vma->vm_private_data = buf;
	return 0;
}

static const struct dma_buf_ops vgpu_dmabuf_ops = {
	.attach = vgpu_dmabuf_attach,
	.pin = vgpu_dmabuf_pin,
	.unpin = vgpu_dmabuf_unpin,
	.map_dma_buf = vgpu_map_dma_buf,
	.unmap_dma_buf = vgpu_unmap_dma_buf,
	.release = vgpu_dmabuf_release,
	.mmap = vgpu_dmabuf_mmap,
};

/**
 * vgpu_revoke() - take a buffer away from its importers and CPU mappings
 * @buf: the buffer; the caller holds a reference on its dma-buf file
 *
 * Marks @buf revoked (later maps fail with -ENODEV, CPU faults get SIGBUS),
 * tells every importer to drop its mappings, waits for the fences in the
 * reservation object and zaps every CPU mapping of the dma-buf.
 * Idempotent. Importers may still hold mappings on return: see
 * vgpu_wait_unmapped().
 */
static void vgpu_revoke(struct vgpu_buffer *buf)
{
	struct dma_buf *dmabuf = buf->dmabuf;
	struct vgpu_device *vgpu = buf->vgpu;
	ktime_t start, invalidated, quiet;

	dma_resv_lock(dmabuf->resv, NULL);
	WRITE_ONCE(buf->revoked, true);
	unmap_mapping_range(dmabuf->file->f_mapping, 0, 0, 1);
	start = ktime_get();
	fgds_dma_buf_invalidate_mappings(dmabuf);
	invalidated = ktime_get();
	/* As vfio-pci: the memory is ours again once every fence signalled. */
	dma_resv_wait_timeout(dmabuf->resv, DMA_RESV_USAGE_BOOKKEEP, false,
			      MAX_SCHEDULE_TIMEOUT);
	quiet = ktime_get();
	dma_resv_unlock(dmabuf->resv);

	mutex_lock(&vgpu->lock);
	vgpu->last_revoke.bar_offset = buf->bar_offset;
	vgpu->last_revoke.invalidate_ns = ktime_to_ns(ktime_sub(invalidated,
								start));
	vgpu->last_revoke.fence_ns = ktime_to_ns(ktime_sub(quiet, invalidated));
	mutex_unlock(&vgpu->lock);
}

/* Wait up to @timeout jiffies until no importer maps @buf; true if none. */
static bool vgpu_wait_unmapped(struct vgpu_buffer *buf, unsigned long timeout)
{
	return wait_event_timeout(buf->vgpu->wq, !READ_ONCE(buf->nr_maps),
				  timeout);
}

/*
 * Reference the dma-buf of a buffer on @vgpu's list: the one at @bar_offset
 * if @for_remove is false, else the first one removal has not seen yet. A
 * buffer whose file count already dropped to zero is being released and is
 * skipped; holding @lock keeps its struct file alive meanwhile, because
 * release needs @lock to take it off the list.
 */
static struct vgpu_buffer *vgpu_get_buffer(struct vgpu_device *vgpu,
					   bool for_remove, u64 bar_offset)
{
	struct vgpu_buffer *buf, *found = NULL;

	mutex_lock(&vgpu->lock);
	list_for_each_entry(buf, &vgpu->buffers, node) {
		if (for_remove) {
			if (buf->remove_seen)
				continue;
			buf->remove_seen = true;
		} else if (buf->bar_offset != bar_offset) {
			continue;
		}
		if (fgds_get_file_active(&buf->dmabuf->file)) {
			found = buf;
			break;
		}
	}
	mutex_unlock(&vgpu->lock);
	return found;
}

/* --- /dev/vgpuN --- */

static int vgpu_ioctl_alloc(struct vgpu_device *vgpu,
			    struct vgpu_alloc __user *uarg)
{
	DEFINE_DMA_BUF_EXPORT_INFO(exp_info);
	struct vgpu_alloc arg;
	struct vgpu_buffer *buf;
	struct dma_buf *dmabuf;
	int fd, ret;

	if (copy_from_user(&arg, uarg, sizeof(arg)))
		return -EFAULT;
	if (arg.flags & ~(VGPU_ALLOC_RDONLY | VGPU_ALLOC_SKEW)) {
		dev_dbg(&vgpu->dev, "VGPU_IOCTL_ALLOC: flags %#x: only VGPU_ALLOC_RDONLY and VGPU_ALLOC_SKEW are defined\n",
			arg.flags);
		return -EINVAL;
	}
	if ((arg.flags & VGPU_ALLOC_SKEW) &&
	    (vgpu->mode == VGPU_MODE_P2PDMA || arg.size < 2 * SZ_2M ||
	     !IS_ALIGNED(arg.size, SZ_2M))) {
		dev_dbg(&vgpu->dev, "VGPU_IOCTL_ALLOC: VGPU_ALLOC_SKEW needs mode=plain or provider and a size of 4 MiB or more, a multiple of 2 MiB\n");
		return -EINVAL;
	}
	if (!arg.size || !PAGE_ALIGNED(arg.size)) {
		dev_dbg(&vgpu->dev, "VGPU_IOCTL_ALLOC: size %llu is not a non-zero multiple of the page size %lu\n",
			arg.size, PAGE_SIZE);
		return -EINVAL;
	}
	if (arg.size > vgpu->bar_size) {
		dev_dbg(&vgpu->dev, "VGPU_IOCTL_ALLOC: size %llu is larger than BAR2 (%pa bytes)\n",
			arg.size, &vgpu->bar_size);
		return -EINVAL;
	}

	buf = kzalloc(sizeof(*buf), GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	buf->vgpu = vgpu;
	buf->size = arg.size;
	buf->range_size = arg.size;
	if (arg.flags & VGPU_ALLOC_SKEW)
		buf->range_size += VGPU_SKEW_ALIGN;
	buf->readonly = arg.flags & VGPU_ALLOC_RDONLY;
	INIT_LIST_HEAD(&buf->maps);

	mutex_lock(&vgpu->lock);
	if (vgpu->removed) {
		ret = -ENODEV;
		goto err_unlock;
	}
	ret = vgpu_range_alloc(vgpu, buf);
	if (ret) {
		dev_warn_ratelimited(&vgpu->dev, "VGPU_IOCTL_ALLOC: no free contiguous range of %llu bytes in BAR2 (%u buffers live); release buffers first\n",
				     buf->range_size, vgpu->nr_buffers);
		goto err_unlock;
	}
	if (arg.flags & VGPU_ALLOC_SKEW) {
		/*
		 * The first 2 MiB one page into the range, the rest from 4 MiB
		 * on: two runs whose offsets from a 2 MiB boundary differ.
		 */
		buf->segs[0].off = buf->bar_offset + VGPU_SKEW_HEAD;
		buf->segs[0].len = VGPU_SKEW_ALIGN;
		buf->segs[1].off = buf->bar_offset + 2 * VGPU_SKEW_ALIGN;
		buf->segs[1].len = buf->size - VGPU_SKEW_ALIGN;
		buf->nr_segs = 2;
	} else {
		buf->segs[0].off = buf->bar_offset;
		buf->segs[0].len = buf->size;
		buf->nr_segs = 1;
	}

	exp_info.ops = &vgpu_dmabuf_ops;
	exp_info.size = buf->size;
	exp_info.flags = buf->readonly ? O_RDONLY : O_RDWR;
	exp_info.priv = buf;
	dmabuf = dma_buf_export(&exp_info);
	if (IS_ERR(dmabuf)) {
		ret = PTR_ERR(dmabuf);
		goto err_free_range;
	}
	/* From here on the dma-buf owns buf; its release undoes the rest. */
	buf->dmabuf = dmabuf;
	get_device(&vgpu->dev);
	list_add_tail(&buf->node, &vgpu->buffers);
	vgpu->nr_buffers++;
	mutex_unlock(&vgpu->lock);

	/*
	 * dma_buf_fd() in two steps, so that a failing copy_to_user() does not
	 * leave a descriptor behind that userspace does not know about.
	 */
	fd = get_unused_fd_flags(O_CLOEXEC);
	if (fd < 0) {
		ret = fd;
		goto err_put;
	}
	arg.fd = fd;
	arg.bar_offset = buf->bar_offset;
	if (copy_to_user(uarg, &arg, sizeof(arg))) {
		put_unused_fd(fd);
		ret = -EFAULT;
		goto err_put;
	}
	fd_install(fd, dmabuf->file);
	return 0;

err_put:
	dma_buf_put(dmabuf);
	return ret;

err_free_range:
	vgpu_range_free(vgpu, buf);
err_unlock:
	mutex_unlock(&vgpu->lock);
	kfree(buf);
	return ret;
}

static long vgpu_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct vgpu_device *vgpu = file->private_data;

	switch (cmd) {
	case VGPU_IOCTL_ALLOC:
		return vgpu_ioctl_alloc(vgpu, (struct vgpu_alloc __user *)arg);
	default:
		return -ENOTTY;
	}
}

static int vgpu_open(struct inode *inode, struct file *file)
{
	file->private_data = container_of(inode->i_cdev, struct vgpu_device,
					  cdev);
	return nonseekable_open(inode, file);
}

static const struct file_operations vgpu_fops = {
	.owner = THIS_MODULE,
	.open = vgpu_open,
	.unlocked_ioctl = vgpu_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

/* --- sysfs --- */

static ssize_t mode_show(struct device *dev, struct device_attribute *attr,
			 char *page)
{
	return sysfs_emit(page, "%s\n", vgpu_mode_names[to_vgpu(dev)->mode]);
}
static DEVICE_ATTR_RO(mode);

static ssize_t buffers_show(struct device *dev, struct device_attribute *attr,
			    char *page)
{
	struct vgpu_device *vgpu = to_vgpu(dev);
	struct vgpu_buffer *buf;
	int len = 0;

	mutex_lock(&vgpu->lock);
	list_for_each_entry(buf, &vgpu->buffers, node) {
		/* Longest line: 2 * 20 + 10 + 1 digits, 3 blanks, newline. */
		if (len > (int)PAGE_SIZE - 64) {
			len += sysfs_emit_at(page, len, "...\n");
			break;
		}
		len += sysfs_emit_at(page, len, "%llu %llu %u %d\n",
				     buf->bar_offset, buf->size,
				     READ_ONCE(buf->pins),
				     READ_ONCE(buf->revoked));
	}
	mutex_unlock(&vgpu->lock);
	return len;
}
static DEVICE_ATTR_RO(buffers);

/* One line per device holding mappings now: its name and how many. */
static ssize_t importers_show(struct device *dev,
			      struct device_attribute *attr, char *page)
{
	struct vgpu_device *vgpu = to_vgpu(dev);
	struct vgpu_importer *imp;
	int len = 0;

	spin_lock(&vgpu->importers_lock);
	for (imp = vgpu->importers;
	     imp < vgpu->importers + VGPU_MAX_IMPORTERS; imp++)
		if (imp->name[0])
			len += sysfs_emit_at(page, len, "%s %u\n", imp->name,
					     imp->maps);
	spin_unlock(&vgpu->importers_lock);
	return len;
}
static DEVICE_ATTR_RO(importers);

static ssize_t revoke_store(struct device *dev, struct device_attribute *attr,
			    const char *page, size_t count)
{
	struct vgpu_device *vgpu = to_vgpu(dev);
	struct vgpu_buffer *buf;
	u64 bar_offset;
	int ret;

	ret = kstrtou64(page, 0, &bar_offset);
	if (ret)
		return ret;

	buf = vgpu_get_buffer(vgpu, false, bar_offset);
	if (!buf) {
		dev_dbg(&vgpu->dev, "revoke: no live buffer at BAR2 offset %#llx (see buffers)\n",
			bar_offset);
		return -ENOENT;
	}
	vgpu_revoke(buf);
	ret = count;
	if (!vgpu_wait_unmapped(buf, msecs_to_jiffies(revoke_timeout_ms))) {
		dev_warn(&vgpu->dev, "revoked buffer %#llx, but importers still map it after %u ms\n",
			 bar_offset, revoke_timeout_ms);
		ret = -ETIMEDOUT;
	}
	dma_buf_put(buf->dmabuf);
	return ret;
}
static DEVICE_ATTR_WO(revoke);

static ssize_t last_revoke_show(struct device *dev,
				struct device_attribute *attr, char *page)
{
	struct vgpu_device *vgpu = to_vgpu(dev);
	ssize_t len;

	mutex_lock(&vgpu->lock);
	len = sysfs_emit(page, "%llu %llu %llu\n",
			 vgpu->last_revoke.bar_offset,
			 vgpu->last_revoke.invalidate_ns,
			 vgpu->last_revoke.fence_ns);
	mutex_unlock(&vgpu->lock);
	return len;
}
static DEVICE_ATTR_RO(last_revoke);

/* The rig's data pattern (tests/pattern/src/lib.rs): word at byte @offset. */
static u64 vgpu_pattern_word(u64 seed, u64 offset)
{
	u64 z = (offset / 8) ^ rol64(seed, 32);

	z += 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/*
 * Writes the rig's pattern into a range of BAR2, as the GPU would when the
 * memory goes to its next user after a revocation.
 */
static ssize_t fill_store(struct device *dev, struct device_attribute *attr,
			  const char *page, size_t count)
{
	struct vgpu_device *vgpu = to_vgpu(dev);
	u64 off, len, seed, i;
	void __iomem *va;

	if (sscanf(page, "%llu %llu %llu", &off, &len, &seed) != 3 ||
	    !IS_ALIGNED(off | len, 8) || !len || off > vgpu->bar_size ||
	    len > vgpu->bar_size - off) {
		dev_dbg(&vgpu->dev, "fill: write \"<offset> <length> <seed>\", 8-byte aligned, inside BAR2\n");
		return -EINVAL;
	}
	va = ioremap_wc(vgpu->bar_phys + off, len);
	if (!va)
		return -ENOMEM;
	for (i = 0; i < len; i += 8) {
		writeq(vgpu_pattern_word(seed, i), va + i);
		if (!(i & (SZ_1M - 1)))
			cond_resched();
	}
	iounmap(va);
	return count;
}
static DEVICE_ATTR_WO(fill);

static struct attribute *vgpu_attrs[] = {
	&dev_attr_mode.attr,
	&dev_attr_buffers.attr,
	&dev_attr_importers.attr,
	&dev_attr_revoke.attr,
	&dev_attr_last_revoke.attr,
	&dev_attr_fill.attr,
	NULL
};
ATTRIBUTE_GROUPS(vgpu);

/* --- PCI driver --- */

static void vgpu_dev_release(struct device *dev)
{
	struct vgpu_device *vgpu = to_vgpu(dev);

	WARN_ON_ONCE(!list_empty(&vgpu->zombies));
	if (vgpu->pool)
		gen_pool_destroy(vgpu->pool);
	if (!vgpu->id_freed)
		ida_free(&vgpu_ida, vgpu->id);
	pci_dev_put(vgpu->pdev);
	mutex_destroy(&vgpu->lock);
	kfree(vgpu);
}

/* Lives in devres of the PCI device, which may outlast a failed probe's vgpu. */
struct vgpu_memtype {
	phys_addr_t start;
	resource_size_t size;
	int wc_cookie;
};

static void vgpu_memtype_release(void *data)
{
	struct vgpu_memtype *mt = data;

	arch_phys_wc_del(mt->wc_cookie);
	arch_io_free_memtype_wc(mt->start, mt->size);
}

/*
 * Settle BAR2's memory type as write-combined before anybody maps it, so
 * that later mappings (vgpu's mmap, P2PDMA or ZONE_DEVICE pages of the
 * fgds driver) all get WC or UC, never write-back. Released by devres
 * after remove().
 */
static int vgpu_setup_memtype(struct pci_dev *pdev)
{
	struct vgpu_memtype *mt;
	int ret;

	mt = devm_kzalloc(&pdev->dev, sizeof(*mt), GFP_KERNEL);
	if (!mt)
		return -ENOMEM;
	mt->start = pci_resource_start(pdev, VGPU_BAR);
	mt->size = pci_resource_len(pdev, VGPU_BAR);

	ret = arch_io_reserve_memtype_wc(mt->start, mt->size);
	if (ret) {
		pci_err(pdev, "BAR2 is already mapped with a conflicting memory type: load vgpu before any driver maps BAR2 (%d)\n",
			ret);
		return ret;
	}
	mt->wc_cookie = arch_phys_wc_add(mt->start, mt->size);
	return devm_add_action_or_reset(&pdev->dev, vgpu_memtype_release, mt);
}

static int vgpu_setup_plain(struct vgpu_device *vgpu)
{
	struct pci_dev *pdev = vgpu->pdev;
	int nid = dev_to_node(&pdev->dev);
	int ret;

	vgpu->pool = gen_pool_create(PAGE_SHIFT, nid);
	if (!vgpu->pool)
		return -ENOMEM;
	/* Keys are CPU physical addresses, never 0 for an assigned BAR. */
	ret = gen_pool_add(vgpu->pool, vgpu->bar_phys, vgpu->bar_size, nid);
	if (ret)
		return ret;
	if (vgpu->mode != VGPU_MODE_PROVIDER)
		return 0;

#if FGDS_HAVE_P2PDMA_PROVIDER
	ret = pcim_p2pdma_init(pdev);
	if (ret) {
		pci_err(pdev, "cannot set up the P2PDMA provider of BAR2 (%d)\n",
			ret);
		return ret;
	}
	vgpu->provider = pcim_p2pdma_provider(pdev, VGPU_BAR);
	if (!vgpu->provider)
		return -EINVAL;
	return 0;
#else
	pci_err(pdev, "mode=provider needs a kernel with P2PDMA providers (7.x with CONFIG_PCI_P2PDMA); load vgpu with mode=plain\n");
	return -EOPNOTSUPP;
#endif
}

static int vgpu_setup_p2pdma(struct vgpu_device *vgpu)
{
	struct pci_dev *pdev = vgpu->pdev;
	unsigned long align = memremap_compat_align();
	int ret;

	if (!IS_ENABLED(CONFIG_PCI_P2PDMA)) {
		pci_err(pdev, "mode=p2pdma needs a kernel built with CONFIG_PCI_P2PDMA=y; load vgpu with mode=plain\n");
		return -EOPNOTSUPP;
	}
	if (!IS_ALIGNED(vgpu->bar_phys | vgpu->bar_size, align)) {
		pci_err(pdev, "mode=p2pdma needs BAR2 (%pa+%pa) aligned to %#lx for struct pages; use a larger ivshmem memdev\n",
			&vgpu->bar_phys, &vgpu->bar_size, align);
		return -EINVAL;
	}

	/* Not published unless asked: then only vgpu allocates from the pool. */
	ret = pci_p2pdma_add_resource(pdev, VGPU_BAR, 0, 0);
	if (ret) {
		pci_err(pdev, "cannot register BAR2 as P2PDMA memory (%d)\n",
			ret);
		return ret;
	}
	if (publish)
		pci_p2pmem_publish(pdev, true);

#if FGDS_HAVE_P2PDMA_PROVIDER
	vgpu->provider = pcim_p2pdma_provider(pdev, VGPU_BAR);
	if (!vgpu->provider)
		return -EINVAL;
#endif
	return 0;
}

/*
 * Gives BAR2 a new size (bar_bytes), as a GPU driver resizes its BAR at
 * probe: the PCI core assigns the BAR again, possibly elsewhere. ivshmem has
 * no Resizable BAR capability, so the device keeps decoding its whole memory;
 * only the kernel's view, and so every importer's, changes. Before the device
 * is enabled, with memory decoding off.
 */
static int vgpu_resize_bar(struct pci_dev *pdev, resource_size_t size)
{
	struct resource *res = &pdev->resource[VGPU_BAR];
	u16 cmd;
	int ret;

	if (!is_power_of_2(size) || size < SZ_2M) {
		pci_err(pdev, "bar_bytes=%pa: not a power of two of 2 MiB or more\n",
			&size);
		return -EINVAL;
	}
	pci_read_config_word(pdev, PCI_COMMAND, &cmd);
	pci_write_config_word(pdev, PCI_COMMAND, cmd & ~PCI_COMMAND_MEMORY);
	pci_release_resource(pdev, VGPU_BAR);
	res->start = 0;
	res->end = size - 1;
	ret = pci_assign_resource(pdev, VGPU_BAR);
	pci_write_config_word(pdev, PCI_COMMAND, cmd);
	if (ret)
		pci_err(pdev, "cannot assign BAR2 with %pa bytes: %d\n", &size,
			ret);
	else
		pci_info(pdev, "BAR2 resized to %pR\n", res);
	return ret;
}

static int vgpu_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	resource_size_t want = READ_ONCE(bar_bytes);
	struct vgpu_device *vgpu;
	int ret;

	if (want && want != pci_resource_len(pdev, VGPU_BAR)) {
		ret = vgpu_resize_bar(pdev, want);
		if (ret)
			return ret;
	}
	ret = pcim_enable_device(pdev);
	if (ret)
		return ret;

	if (!(pci_resource_flags(pdev, VGPU_BAR) & IORESOURCE_MEM) ||
	    pci_resource_len(pdev, VGPU_BAR) < PAGE_SIZE ||
	    !PAGE_ALIGNED(pci_resource_start(pdev, VGPU_BAR)) ||
	    !PAGE_ALIGNED(pci_resource_len(pdev, VGPU_BAR))) {
		pci_err(pdev, "BAR2 is not a page-aligned memory BAR; is this an ivshmem-plain device with a memdev?\n");
		return -ENODEV;
	}

	ret = fgds_pcim_request_region(pdev, VGPU_BAR, KBUILD_MODNAME);
	if (ret) {
		pci_err(pdev, "BAR2 is claimed by another driver (%d)\n", ret);
		return ret;
	}

	ret = vgpu_setup_memtype(pdev);
	if (ret)
		return ret;

	vgpu = kzalloc(sizeof(*vgpu), GFP_KERNEL);
	if (!vgpu)
		return -ENOMEM;
	vgpu->id = ida_alloc_max(&vgpu_ida, VGPU_MAX_DEVICES - 1, GFP_KERNEL);
	if (vgpu->id < 0) {
		ret = vgpu->id;
		kfree(vgpu);
		return ret;
	}
	vgpu->pdev = pci_dev_get(pdev);
	vgpu->mode = vgpu_mode;
	vgpu->bar_phys = pci_resource_start(pdev, VGPU_BAR);
	vgpu->bar_bus = pci_bus_address(pdev, VGPU_BAR);
	vgpu->bar_size = pci_resource_len(pdev, VGPU_BAR);
	mutex_init(&vgpu->lock);
	spin_lock_init(&vgpu->importers_lock);
	INIT_LIST_HEAD(&vgpu->buffers);
	INIT_LIST_HEAD(&vgpu->zombies);
	INIT_DELAYED_WORK(&vgpu->reclaim, vgpu_reclaim_work);
	init_waitqueue_head(&vgpu->wq);

	/* From here on vgpu_dev_release() frees vgpu. */
	device_initialize(&vgpu->dev);
	vgpu->dev.class = vgpu_class;
	vgpu->dev.parent = &pdev->dev;
	vgpu->dev.devt = MKDEV(MAJOR(vgpu_devt), MINOR(vgpu_devt) + vgpu->id);
	vgpu->dev.groups = vgpu_groups;
	vgpu->dev.release = vgpu_dev_release;
	ret = dev_set_name(&vgpu->dev, "vgpu%d", vgpu->id);
	if (ret)
		goto err_put;

	if (vgpu->mode == VGPU_MODE_P2PDMA)
		ret = vgpu_setup_p2pdma(vgpu);
	else
		ret = vgpu_setup_plain(vgpu);
	if (ret)
		goto err_put;

	cdev_init(&vgpu->cdev, &vgpu_fops);
	vgpu->cdev.owner = THIS_MODULE;
	ret = cdev_device_add(&vgpu->cdev, &vgpu->dev);
	if (ret)
		goto err_put;

	pci_set_drvdata(pdev, vgpu);
	pci_info(pdev, "%s: BAR2 %pa+%pa as VRAM, mode %s\n",
		 dev_name(&vgpu->dev), &vgpu->bar_phys, &vgpu->bar_size,
		 vgpu_mode_names[vgpu->mode]);
	return 0;

err_put:
	put_device(&vgpu->dev);
	return ret;
}

/*
 * p2pdma mode, device removal: once @buf is revoked and unmapped, wait until
 * nobody holds its pages any more (I/O an importer started before the
 * revocation may still be in flight) and give the range back to the P2PDMA
 * pool now, which devres destroys after remove(). The dma-buf itself may
 * live on as an empty, revoked shell until userspace closes it.
 */
static void vgpu_p2p_reclaim(struct vgpu_buffer *buf)
{
	struct vgpu_device *vgpu = buf->vgpu;
	unsigned long warn_at = jiffies + VGPU_REMOVE_WAIT;
	u64 busy;

	while (!vgpu_p2p_idle(buf, &busy)) {
		if (time_after(jiffies, warn_at)) {
			dev_warn(&vgpu->dev, "removal waits for the P2PDMA page at offset %#llx of buffer %#llx to be let go (refcount %d, idle %d)\n",
				 busy, buf->bar_offset,
				 page_ref_count(virt_to_page(buf->p2p_addr + busy)),
				 buf->p2p_idle_refs);
			warn_at = jiffies + VGPU_REMOVE_WAIT;
		}
		msleep(20);
	}
	mutex_lock(&vgpu->lock);
	vgpu_range_free(vgpu, buf);
	mutex_unlock(&vgpu->lock);
	wake_up_all(&vgpu->wq);
}

static void vgpu_remove(struct pci_dev *pdev)
{
	struct vgpu_device *vgpu = pci_get_drvdata(pdev);
	struct vgpu_buffer *buf;

	/* No new opens, and no sysfs revoke running any more. */
	cdev_device_del(&vgpu->cdev, &vgpu->dev);
	/*
	 * Name and minor are free again: a device bound next is vgpuN again
	 * even while buffers of this instance live on.
	 */
	ida_free(&vgpu_ida, vgpu->id);
	vgpu->id_freed = true;

	mutex_lock(&vgpu->lock);
	vgpu->removed = true;
	mutex_unlock(&vgpu->lock);

	/*
	 * The BAR goes away with the device: revoke every buffer and wait
	 * until importers have unmapped it, as pcim_p2pdma_provider() requires
	 * of its users before remove() returns.
	 */
	while ((buf = vgpu_get_buffer(vgpu, true, 0))) {
		vgpu_revoke(buf);
		while (!vgpu_wait_unmapped(buf, VGPU_REMOVE_WAIT))
			dev_warn(&vgpu->dev, "removal waits for importers to unmap buffer %#llx\n",
				 buf->bar_offset);
		if (vgpu->mode == VGPU_MODE_P2PDMA)
			vgpu_p2p_reclaim(buf);
		dma_buf_put(buf->dmabuf);
	}

	/*
	 * All P2PDMA memory must be back in its pool before devres destroys
	 * the pool after this function returns. Buffers skipped above were
	 * already being released; their release, or the reclaim work for
	 * those whose pages were still held, gives their range back.
	 */
	if (vgpu->mode == VGPU_MODE_P2PDMA) {
		while (!wait_event_timeout(vgpu->wq,
					   !READ_ONCE(vgpu->nr_p2p_ranges),
					   VGPU_REMOVE_WAIT))
			dev_warn(&vgpu->dev, "removal waits for %u P2PDMA ranges of released buffers to be let go\n",
				 READ_ONCE(vgpu->nr_p2p_ranges));
	}

	put_device(&vgpu->dev);
}

static const struct pci_device_id vgpu_pci_ids[] = {
	{ PCI_DEVICE(PCI_VENDOR_ID_REDHAT_QUMRANET, VGPU_PCI_DEVICE_IVSHMEM) },
	{ }
};
MODULE_DEVICE_TABLE(pci, vgpu_pci_ids);

static struct pci_driver vgpu_pci_driver = {
	.name = KBUILD_MODNAME,
	.id_table = vgpu_pci_ids,
	.probe = vgpu_probe,
	.remove = vgpu_remove,
};

static int __init vgpu_init(void)
{
	int ret;

	ret = sysfs_match_string(vgpu_mode_names, mode);
	if (ret < 0) {
		pr_err("unknown mode=%s; use plain, provider or p2pdma\n", mode);
		return ret;
	}
	vgpu_mode = ret;

	vgpu_wq = alloc_workqueue("vgpu", WQ_UNBOUND, 0);
	if (!vgpu_wq)
		return -ENOMEM;

	vgpu_class = fgds_class_create("vgpu");
	if (IS_ERR(vgpu_class)) {
		ret = PTR_ERR(vgpu_class);
		goto err_wq;
	}

	ret = alloc_chrdev_region(&vgpu_devt, 0, VGPU_MAX_DEVICES, "vgpu");
	if (ret)
		goto err_class;

	ret = pci_register_driver(&vgpu_pci_driver);
	if (ret)
		goto err_chrdev;
	return 0;

err_chrdev:
	unregister_chrdev_region(vgpu_devt, VGPU_MAX_DEVICES);
err_class:
	class_destroy(vgpu_class);
err_wq:
	destroy_workqueue(vgpu_wq);
	return ret;
}
module_init(vgpu_init);

static void __exit vgpu_exit(void)
{
	pci_unregister_driver(&vgpu_pci_driver);
	unregister_chrdev_region(vgpu_devt, VGPU_MAX_DEVICES);
	class_destroy(vgpu_class);
	/* Removal waited for every zombie; this waits for the work's tail. */
	destroy_workqueue(vgpu_wq);
}
module_exit(vgpu_exit);

MODULE_DESCRIPTION("fgds test rig: fake GPU exporting ivshmem BAR2 as dma-bufs");
MODULE_LICENSE("GPL");
FGDS_IMPORT_NS_DMA_BUF();

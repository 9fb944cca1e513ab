/* SPDX-License-Identifier: GPL-2.0 */
/*
 * fgds internals: one struct fgds_gpu per GPU node, one struct fgds_file per
 * open file, one struct fgds_buf per registration.
 */
#ifndef _FGDS_DRV_H
#define _FGDS_DRV_H

#include <linux/bits.h>
#include <linux/bvec.h>
#include <linux/cdev.h>
#include <linux/delay.h>
#include <linux/device.h>
#include <linux/dma-direction.h>
#include <linux/dma-fence.h>
#include <linux/fs.h>
#include <linux/kref.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/percpu-refcount.h>
#include <linux/pci.h>
#include <linux/refcount.h>
#include <linux/rwsem.h>
#include <linux/sched.h>
#include <linux/spinlock.h>
#include <linux/wait.h>
#include <linux/workqueue.h>
#include <linux/xarray.h>

#include <uapi/linux/fgds.h>

#include "fgds_config.h"

/*
 * A registration's id is packed into vm_pgoff above bit 31 (FGDS_VM_SHIFT),
 * which needs a 64-bit pgoff_t, and BARs are reserved write-combined through
 * x86 PAT (arch_io_reserve_memtype_wc()).
 */
#if !defined(CONFIG_64BIT) || !defined(CONFIG_X86)
#error "fgds supports x86-64 only"
#endif

struct fgds_io;
struct dentry;
struct io_uring_cmd;

/* Smallest prefetchable BAR that makes a PCI device a GPU for fgds. */
#define FGDS_MIN_BAR_SIZE	(64ULL << 20)

/*
 * fgds makes its own struct pages over a BAR (P2PDMA and GENERIC modes) in
 * chunks of this size, each when a registration first covers part of it:
 * their memmap (1/64 of the memory with 4 KiB pages) and set-up time follow
 * what was registered, not the BAR (256 GiB on an H200). BARs are powers of
 * two of at least FGDS_MIN_BAR_SIZE, so they hold whole chunks.
 */
#define FGDS_CHUNK_SHIFT	26
#define FGDS_CHUNK_SIZE		BIT_ULL(FGDS_CHUNK_SHIFT)
#define FGDS_CHUNK_PAGES	(FGDS_CHUNK_SIZE >> PAGE_SHIFT)

/*
 * Each registration's mappings sit at their own place in fgds's address_space:
 * vm_pgoff = id << FGDS_VM_SHIFT, id < FGDS_VM_IDS. So a buffer spans at most
 * 2^31 pages (8 TiB), and every byte offset of the space fits a loff_t.
 */
#define FGDS_VM_SHIFT		31
#define FGDS_VM_IDS		BIT(19)
#define FGDS_MAX_BUF_PAGES	BIT(FGDS_VM_SHIFT)

/**
 * enum fgds_mode - where the struct pages over a GPU's BAR come from
 * @FGDS_MODE_NONE: not set up (set up when the node is opened, or by the
 *	next registration, while the GPU has a driver bound; torn down when it
 *	unbinds)
 * @FGDS_MODE_EXPORTER_P2PDMA: the GPU's driver registered P2PDMA pages for
 *	its BAR (pci_p2pdma_add_resource()); fgds maps those
 * @FGDS_MODE_P2PDMA: fgds registers P2PDMA pages for the BAR, a chunk at a
 *	time, and claims each chunk from the P2PDMA genpool
 * @FGDS_MODE_GENERIC: MEMORY_DEVICE_GENERIC pages created by fgds; only on
 *	kernels without CONFIG_PCI_P2PDMA (or with pages=generic), and only
 *	where fgds vouched for the topology
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
 * @FGDS_PAGES_AUTO: P2PDMA pages where the kernel has CONFIG_PCI_P2PDMA,
 *	else GENERIC pages where fgds can vouch for the topology
 * @FGDS_PAGES_P2PDMA: P2PDMA pages only
 * @FGDS_PAGES_GENERIC: GENERIC pages only (same topology rules)
 */
enum fgds_pages {
	FGDS_PAGES_AUTO,
	FGDS_PAGES_P2PDMA,
	FGDS_PAGES_GENERIC,
};

/**
 * struct fgds_geometry - where a GPU's BAR is, as read at provider setup
 * @bar: index of the BAR used (the largest prefetchable memory BAR)
 * @start: CPU physical address of the BAR
 * @bus: PCI bus address of the BAR
 * @len: length of the BAR
 */
struct fgds_geometry {
	int bar;
	resource_size_t start;
	pci_bus_addr_t bus;
	resource_size_t len;
};

/**
 * struct fgds_chunk - fgds's own pages over one FGDS_CHUNK_SIZE of the BAR
 * @pgmap: GENERIC mode: the pagemap fgds created
 * @group: P2PDMA mode: the devres group on the GPU's device that holds what
 *	pci_p2pdma_add_resource() made for the chunk
 * @claim: P2PDMA mode, order-0 pages: the chunk's claim from the genpool
 */
struct fgds_chunk {
	struct dev_pagemap *pgmap;
	void *group;
	void *claim;
};

/**
 * struct fgds_gpu - one GPU, one node /dev/fgds_DDDD_BB_DD_F
 * @dev: the class device; its refcount keeps this structure alive
 * @cdev: the character device, parented to @dev
 * @pdev: the GPU (reference held)
 * @list: entry in the global GPU list (under fgds_lock)
 * @lock: protects the fields below it, up to @holds_lock, except those under
 *	@bufs_lock; held while the provider is set up or dropped, which
 *	creates and removes sysfs files (the kernfs lock)
 * @bufs_lock: protects @bufs, @nr_bufs, @nr_bytes and @user_pages; taken
 *	when a registration's last reference goes, which can be in munmap()
 *	under the mmap lock, so never held while anything takes the kernfs
 *	lock (a readdir of sysfs faults on user memory under it)
 * @geo: the BAR, re-read under the PCI device lock at each provider setup
 *	(GPU drivers resize BARs at probe)
 * @dead: the GPU is being removed; nothing new may start
 * @tearing: a teardown is under way: no provider may be set up and no
 *	registration published until it ends
 * @mode: current page provider
 * @refused: why the provider was refused (-EOPNOTSUPP, -EBUSY), until unbind
 * @gen: provider generation, bumped at each teardown
 * @bufs: published registrations not yet released
 * @nr_bufs: registrations counted in sysfs "buffers"
 * @nr_bytes: bytes counted in sysfs "bytes" and against max_bytes_per_gpu
 * @user_pages: uid -> pages that user has registered on this GPU, against
 *	max_bytes_per_user
 * @chunks: P2PDMA and GENERIC modes: one entry per FGDS_CHUNK_SIZE of the
 *	BAR, its pages made when a registration first needs them
 * @made: indexes of the chunks made, in the order they were made (P2PDMA
 *	state lives in the first one's devres group: torn down last)
 * @nr_made: entries of @made
 * @order: pages per folio of the provider, as a power of two (GENERIC pages
 *	are 2 MiB folios; all others single pages)
 * @idle_refs: references a page of the provider holds when nobody uses it,
 *	read off the pages at setup (gpu.c, fgds_own_idle_refs())
 * @gate_diskseq: the disk (its diskseq, never reused) whose DMA device the
 *	gate last found able to reach this provider's pages; 0 for none
 *	(gate.c; cleared when the provider goes)
 * @memtype_wc: fgds holds a write-combine memory type reservation on the BAR
 * @p2p_state: P2PDMA mode: the device's P2PDMA state, which fgds created
 *	with its first chunk; a later chunk is only added to it
 * @holds_lock: protects @holds, @nr_held and every buffer's @holding
 * @holds: exporter's P2PDMA mode: BAR page index -> number of registrations
 *	holding that page
 * @nr_held: exporter's P2PDMA mode: pages on which fgds holds its own
 *	reference; other modes: registrations still holding (fgds holds every
 *	page for as long as the provider exists)
 * @pending_lock: protects @pending and every buffer's @pending_node; never
 *	held while sleeping (the fence-signalling path takes it)
 * @pending: buffers whose pages are still referenced by I/O (or a pipe)
 *	after a revocation or a release; @quiesce releases them once quiet
 * @quiesce: polls @pending, signals the revocation fences of buffers whose
 *	pages went quiet and hands them to their cleanup work
 * @quiet_wq: woken whenever a buffer lets go of its pages
 */
struct fgds_gpu {
	struct device dev;
	struct cdev cdev;
	struct pci_dev *pdev;
	struct list_head list;

	struct mutex lock; /* see the kernel-doc above */
	struct fgds_geometry geo;
	bool dead;
	bool tearing;
	enum fgds_mode mode;
	int refused;
	unsigned long gen;
	struct mutex bufs_lock; /* see the kernel-doc above */
	struct list_head bufs;
	unsigned long nr_bufs;
	u64 nr_bytes;
	struct xarray user_pages;
	struct fgds_chunk *chunks;
	u32 *made;
	u32 nr_made;
	unsigned int order;
	unsigned int idle_refs;
	u64 gate_diskseq;
	bool memtype_wc;
	void *p2p_state;

	struct mutex holds_lock; /* see the kernel-doc above */
	struct xarray holds;
	unsigned long nr_held;

	spinlock_t pending_lock; /* see the kernel-doc above */
	struct list_head pending;
	struct delayed_work quiesce;
	wait_queue_head_t quiet_wq;
};

/**
 * struct fgds_file - one open file of a node
 * @gpu: the node's GPU (device reference held)
 * @mapping: the address_space every mapping made through this file uses
 *	(fgds_mapping, shared by all files)
 * @lock: serialises changes to @bufs and @nr
 * @bufs: registry, id -> struct fgds_buf; idx = id << PAGE_SHIFT. Looked up
 *	under RCU (fgds_file_buf_get()): a registration is freed a grace period
 *	after its last reference went
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
 * struct fgds_dma_map - a registration's dma-buf as mapped for the device
 *	that does the DMA of fgds's own reads and writes
 * @next: the next (older) one
 * @pdev: that device (an NVMe controller), which the exporter judged
 *	(reference held: the attachment names it until it is detached)
 * @attach: dynamic attachment as @pdev
 * @sgt: the exporter's mapping for @pdev while pinned and mapped
 * @pinned: dma_buf_pin() of @attach succeeded and is not yet undone
 */
struct fgds_dma_map {
	struct fgds_dma_map *next;
	struct pci_dev *pdev;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	bool pinned;
};

/**
 * struct fgds_fence - a registration's revocation fence
 * @base: the fence, added to the dma-buf's reservation object (usage
 *	WRITE) when a revocation finds the pages still referenced; signalled
 *	once they are quiet
 * @lock: the fence's lock (kernels whose fences have no lock of their own)
 * @free_work: frees the fence and drops its module reference, from fgds's
 *	own workqueue
 */
struct fgds_fence {
	struct dma_fence base;
	spinlock_t lock; /* the fence's */
	struct work_struct free_work;
};

/**
 * struct fgds_buf - one registration
 * @ref: held by the registry entry, by each VMA, and while on the GPU's
 *	pending list unreleased; at zero the buffer is released
 * @gpu: the GPU (device reference held)
 * @mapping: address_space of its mappings; NULL once released (no mapping is
 *	left to zap). Written under dmabuf->resv.
 * @vm_id: its place in @mapping (vm_pgoff = vm_id << FGDS_VM_SHIFT)
 * @size: registered size in bytes
 * @npages: @size in pages
 * @readonly: the dma-buf was opened read-only: no writable mapping
 * @owned: the pages are fgds's (P2PDMA or GENERIC mode): fgds may set their
 *	->index when it maps them
 * @wp_notify: GENERIC pages: its mappings have a page_mkwrite handler, which
 *	makes GUP refuse long-term writable pins of them
 * @pmd_ok: 2 MiB folios, and every extent at the same offset from a folio
 *	boundary: a suitably aligned mapping can map whole folios with PMDs
 * @dmabuf: the dma-buf (reference held)
 * @attach: dynamic attachment, as the GPU's own PCI device: where the buffer
 *	lies in the BAR (a stock kernel gives an importer nothing else to find
 *	a dma-buf's pages by)
 * @sgt: the exporter's mapping while pinned and mapped
 * @dma_maps: attachments as the devices that did fgds's own reads and writes
 *	(rw.c), newest first; added under dmabuf->resv, published with a
 *	release store, freed with @buf
 * @ext: where the buffer lies in the BAR
 * @nr_ext: entries in @ext
 * @user: the registering user, charged @size in locked_vm unless it had
 *	CAP_IPC_LOCK (@charged)
 * @uid: the registering user's uid, counted in the GPU's @user_pages
 * @owner: comm and tgid of the registering process, for log lines
 * @fence: preallocated revocation fence, NULL once handed to the dma-buf
 *	core or freed
 * @fence_live: @fence was added to the reservation object (the pointer
 *	stays valid, a reference held, until the cleanup replaces it there)
 * @lock: write-held to revoke; read-held by faults while inserting pages
 * @revoked: no new page may be mapped (under @lock and dmabuf->resv)
 * @released: @ref reached zero (under dmabuf->resv)
 * @pinned: dma_buf_pin() succeeded and is not yet undone
 * @charged: @size is charged to @user's locked_vm
 * @holding: the pages of @ext are counted in the GPU's holds
 * @gpu_node: entry in the GPU's @bufs (under gpu->lock)
 * @listed: @gpu_node is on the GPU's @bufs
 * @pending_node: entry in the GPU's @pending (under gpu->pending_lock)
 * @pending: on the GPU's @pending, or its cleanup queued (under
 *	dmabuf->resv); it then holds a module reference
 * @pending_ref: @pending holds a reference in @ref (it was not released
 *	when it went on the list)
 * @pending_since: when it went on @pending, for the log
 * @quiet_upto: pages of the buffer, from its start, found quiet by the
 *	quiesce work (they stay quiet: no new pin can appear)
 * @quiet: the quiesce work found all its pages quiet and handed it to its
 *	cleanup (under gpu->pending_lock): a revocation from now on needs no
 *	fence
 * @cleanup: gives the dma-buf back once the pages are quiet (may sleep on
 *	the reservation lock, so it never runs in @quiesce)
 * @users: every call of FGDS_IOCTL_READ/WRITE and FGDS_URING_CMD_READ/WRITE
 *	(rw.c) holds a live reference while it can reach the pages; killed by a
 *	revocation that finds @in_use and @released false (a released one has
 *	no users left: each held a reference in @ref)
 * @in_use: @users was used (written under @lock held for reading, with
 *	@revoked false); until then a revocation leaves it alone
 * @users_dead: @users was killed (under @lock)
 * @users_done: @users reached zero after it was killed: no call or request
 *	can reach the pages any more (set by its release, last)
 * @rcu: frees it a grace period after fgds_buf_free(), for lookups that
 *	found it in a registry under RCU
 */
struct fgds_buf {
	struct kref ref;
	struct fgds_gpu *gpu;
	struct address_space *mapping;
	int vm_id;
	u64 size;
	pgoff_t npages;
	bool readonly;
	bool owned;
	bool wp_notify;
	bool pmd_ok;
	struct dma_buf *dmabuf;
	struct dma_buf_attachment *attach;
	struct sg_table *sgt;
	struct fgds_dma_map *dma_maps;
	struct fgds_extent *ext;
	unsigned int nr_ext;
	struct user_struct *user;
	kuid_t uid;
	char owner[TASK_COMM_LEN + 16];
	struct fgds_fence *fence;
	bool fence_live;
	struct rw_semaphore lock;
	bool revoked;
	bool released;
	bool pinned;
	bool charged;
	bool holding;
	struct list_head gpu_node;
	bool listed;
	struct list_head pending_node;
	bool pending;
	bool pending_ref;
	unsigned long pending_since;
	pgoff_t quiet_upto;
	bool quiet;
	struct work_struct cleanup;
	struct percpu_ref users;
	bool in_use;
	bool users_dead;
	bool users_done;
	struct rcu_head rcu;
};

/*
 * How DMA uses a registration's memory: a dma-buf opened read-only is only
 * ever read (written to files), never written.
 */
static inline enum dma_data_direction
fgds_buf_dma_dir(const struct fgds_buf *buf)
{
	return buf->readonly ? DMA_TO_DEVICE : DMA_BIDIRECTIONAL;
}

static inline pgoff_t fgds_buf_vm_pgoff(const struct fgds_buf *buf)
{
	return (pgoff_t)buf->vm_id << FGDS_VM_SHIFT;
}

/* module parameters */
extern unsigned int fgds_max_buffers_per_file;
extern unsigned long long fgds_max_bytes_per_gpu;
extern unsigned long long fgds_max_bytes_per_user;
extern unsigned int fgds_revoke_timeout_ms;

#ifdef CONFIG_FAULT_INJECTION
extern unsigned int fgds_race_window_us;

/*
 * Widens a window that a race needs, where a test asked for it (race_window_us),
 * on kernels built for fault injection only.
 */
static inline void fgds_race_window(void)
{
	unsigned int us = READ_ONCE(fgds_race_window_us);

	if (us)
		usleep_range(us, us + us / 4 + 1);
}

extern unsigned int fgds_lookup_window_us;

/*
 * The same for a lookup of a registration, under RCU: it spins, never sleeps
 * (lookup_window_us, at most 20 ms).
 */
static inline void fgds_lookup_window(void)
{
	unsigned int us = min(READ_ONCE(fgds_lookup_window_us), 20000U);

	if (us) {
		mdelay(us / 1000);
		udelay(us % 1000);
	}
}

extern unsigned int fgds_issue_window_us;

/*
 * The same after a file's method queued an io_uring command's I/O on a
 * worker: it sleeps, then reads @kiocb's file as ext4's direct reads do on
 * their way out (issue_window_us, at most 20 ms), so that a test can land
 * the I/O's completion while the method is still using the kiocb.
 */
static inline void fgds_issue_window(struct kiocb *kiocb)
{
	unsigned int us = min(READ_ONCE(fgds_issue_window_us), 20000U);

	if (us) {
		usleep_range(us, us + us / 4 + 1);
		(void)READ_ONCE(kiocb->ki_filp);
	}
}
#else
static inline void fgds_race_window(void)
{
}

static inline void fgds_lookup_window(void)
{
}

static inline void fgds_issue_window(struct kiocb *kiocb)
{
}
#endif
extern int fgds_pages;

extern struct address_space *fgds_mapping;
extern struct workqueue_struct *fgds_wq;
extern struct workqueue_struct *fgds_signal_wq;
extern struct workqueue_struct *fgds_io_wq;
extern const struct file_operations fgds_fops;
extern const struct attribute_group *fgds_gpu_groups[];

/* gpu.c */
const char *fgds_mode_name(enum fgds_mode mode);
int fgds_gpu_setup_pages(struct fgds_gpu *gpu);
int fgds_gpu_make_pages(struct fgds_gpu *gpu, const struct fgds_extent *ext,
			unsigned int nr_ext);
void fgds_gpu_drop_pages(struct fgds_gpu *gpu);
int fgds_gpu_pick_bar(struct pci_dev *pdev);
int fgds_gpu_check_range(struct fgds_gpu *gpu, pgoff_t bar_pg, pgoff_t n);
const char *fgds_gpu_dma_dev_check(struct fgds_gpu *gpu, struct pci_dev *pdev);
struct page *fgds_gpu_page(struct fgds_gpu *gpu, pgoff_t bar_pg);
int fgds_holds_get(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		   unsigned int nr_ext);
bool fgds_pages_quiet(struct fgds_gpu *gpu, const struct fgds_extent *ext,
		      unsigned int nr_ext, pgoff_t *cursor);
bool fgds_buf_quiet(struct fgds_buf *buf, pgoff_t *cursor);
pgoff_t fgds_buf_bar_pg(const struct fgds_buf *buf, pgoff_t pgoff);
void fgds_buf_reap(struct fgds_buf *buf);

/* revoke.c */
int fgds_fence_prepare(struct fgds_buf *buf);
void fgds_fence_discard(struct fgds_buf *buf);
void fgds_buf_revoke_locked(struct fgds_buf *buf);
void fgds_buf_revoke(struct fgds_buf *buf);
void fgds_buf_unmap_locked(struct fgds_buf *buf);
void fgds_buf_let_go(struct fgds_buf *buf);
void fgds_gpu_teardown(struct fgds_gpu *gpu);
void fgds_quiesce_fn(struct work_struct *work);
void fgds_cleanup_fn(struct work_struct *work);

/* Segments on the stack; a registration is usually one run of the BAR. */
#define FGDS_IO_FAST_SEGS	8

/**
 * struct fgds_io_req - one of fgds's own reads or writes (rw.c)
 * @kiocb: the file I/O; ->ki_filp holds a reference on the file
 * @buf: the registration (a reference and a live @users reference held)
 * @cmd: the io_uring command it serves, if any
 * @ret: the I/O's result, once ended (io_uring commands)
 * @write: from the registration to the file
 * @pos: where in the file the I/O starts
 * @len: bytes to move
 * @nr: entries in @bv
 * @bv: the registration's bytes as segments: @fast, or an array of its own
 * @fast: segments of a request that needs few
 * @cred: (io_uring commands) the submitter's credentials, while its I/O is
 *	issued again from fgds_io_wq
 * @reissue: (io_uring commands) that issue's work
 * @issuing: (io_uring commands) while an I/O is queued, two: the file's
 *	method that queued it and its ->ki_complete(); whichever lets go last
 *	hands the command to task work, which frees @kiocb and the file
 * @ended: (io_uring commands) that issue ended at once, its write ended
 *	with it
 * @prepared: (io_uring commands) fgds_io_prepare() succeeded: the request
 *	holds what it took
 * @arg: (io_uring commands) the command, copied from its submission queue
 *	entry when it was first issued
 * @file: (io_uring commands) the file @arg names, taken when the command was
 *	first issued, until its preparation on fgds_io_wq takes it over
 */
struct fgds_io_req {
	struct kiocb kiocb;
	struct fgds_buf *buf;
	struct io_uring_cmd *cmd;
	long ret;
	bool write;
	loff_t pos;
	size_t len;
	unsigned int nr;
	struct bio_vec *bv;
	struct bio_vec fast[FGDS_IO_FAST_SEGS];
	const struct cred *cred;
	struct work_struct reissue;
	refcount_t issuing;
	bool ended;
	bool prepared;
	struct fgds_io arg;
	struct file *file;
};

/* rw.c */
int fgds_buf_users_init(struct fgds_buf *buf);
void fgds_buf_users_exit(struct fgds_buf *buf);
int fgds_buf_users_get(struct fgds_buf *buf);
void fgds_buf_users_put(struct fgds_buf *buf);
void fgds_buf_users_kill(struct fgds_buf *buf);
bool fgds_buf_users_quiet(struct fgds_buf *buf);
int fgds_io_prepare(struct fgds_io_req *req, struct fgds_file *f,
		    const struct fgds_io *arg, struct file *file, bool write,
		    bool nowait, struct iov_iter *iter);
void fgds_io_rewind(struct fgds_io_req *req, struct iov_iter *iter);
ssize_t fgds_io_issue(struct fgds_io_req *req, struct iov_iter *iter);
void fgds_io_release(struct fgds_io_req *req);
ssize_t fgds_io(struct fgds_file *f, const struct fgds_io *arg, bool write);
long fgds_ioctl_io(struct fgds_file *f, void __user *uarg, bool write);

/* gate.c */
int fgds_io_gate(struct fgds_gpu *gpu, struct file *file, int fd, bool write,
		 struct pci_dev **dma_dev);
long fgds_ioctl_check_file(struct fgds_file *f, void __user *uarg);

/* uring.c */
int fgds_uring_cmd(struct io_uring_cmd *cmd, unsigned int issue_flags);
void fgds_uring_debugfs_init(struct dentry *dir);

/* buf.c */
const struct fgds_extent *fgds_buf_extent(const struct fgds_buf *buf,
					  pgoff_t pgoff);
struct fgds_buf *fgds_file_buf_get(struct fgds_file *f, unsigned long id);
void fgds_buf_put(struct fgds_buf *buf);
void fgds_buf_free(struct fgds_buf *buf);
bool fgds_buf_dma_mapped(struct fgds_buf *buf, struct pci_dev *pdev);
void fgds_dma_map_drop(struct fgds_buf *buf, struct fgds_dma_map *m);
void fgds_gpu_forget_dma_dev(struct fgds_gpu *gpu, struct pci_dev *pdev);
int fgds_buf_dma_attach(struct fgds_buf *buf, struct pci_dev *pdev);

#endif /* _FGDS_DRV_H */

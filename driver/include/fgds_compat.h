/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel differences for the fgds driver and the rig's vgpu exporter.
 * Supported: Linux 6.1, 6.12, 7.2 and 7.3 (Debian). Every difference between
 * those kernels lives here, nowhere else. What a compile probe can see is
 * decided by the FGDS_HAVE_* macros of fgds_config.h, which the build
 * generates from driver/configure/probes/ (conftest.mk), so that a kernel
 * with backports builds right; only changes of behaviour that no probe sees
 * compare version numbers.
 */
#ifndef _FGDS_COMPAT_H
#define _FGDS_COMPAT_H

#include <linux/version.h>
#include <linux/module.h>

#include "fgds_config.h"

/* --- dma-buf exporter side (vgpu) --- */

/*
 * vgpu also uses FGDS_IMPORT_NS_DMA_BUF(), fgds_class_create() and
 * fgds_vm_flags_set() from the importer side below.
 */
#include <linux/dma-buf.h>
#include <linux/fs.h>
#include <linux/pci.h>

/*
 * Exporter-side invalidation: dma_buf_move_notify() up to 6.12, renamed
 * dma_buf_invalidate_mappings() in 7.x, which also added
 * dma_buf_attach_revocable(). Up to 6.12 every importer with ops has
 * move_notify (dma_buf_dynamic_attach() refuses it otherwise), so every
 * dynamic importer is revocable. Same boundary as FGDS_ATTACH_OPS_INVALIDATE().
 */
#ifdef FGDS_HAVE_DMA_BUF_INVALIDATE_MAPPINGS
static inline void fgds_dma_buf_invalidate_mappings(struct dma_buf *dmabuf)
{
	dma_buf_invalidate_mappings(dmabuf);
}

static inline bool
fgds_dma_buf_attach_revocable(struct dma_buf_attachment *attach)
{
	return dma_buf_attach_revocable(attach);
}
#else
static inline void fgds_dma_buf_invalidate_mappings(struct dma_buf *dmabuf)
{
	dma_buf_move_notify(dmabuf);
}

static inline bool
fgds_dma_buf_attach_revocable(struct dma_buf_attachment *attach)
{
	return attach->importer_ops && attach->importer_ops->move_notify;
}
#endif

/*
 * Take a reference on a file whose count may already have dropped to zero
 * (the caller keeps the struct file itself from being freed). 6.7 added
 * get_file_active(); before it, get_file_rcu() did the same on a plain
 * struct file pointer.
 */
#ifdef FGDS_HAVE_GET_FILE_ACTIVE
static inline struct file *fgds_get_file_active(struct file **f)
{
	return get_file_active(f);
}
#else
static inline struct file *fgds_get_file_active(struct file **f)
{
	return get_file_rcu(*f) ? *f : NULL;
}
#endif

/*
 * Managed request of one BAR: pcim_request_region() is public from 6.12
 * (boundary between supported kernels); before, pci_request_region() on a
 * device enabled with pcim_enable_device() is released by devres.
 */
#ifdef FGDS_HAVE_PCIM_REQUEST_REGION
static inline int fgds_pcim_request_region(struct pci_dev *pdev, int bar,
					   const char *name)
{
	return pcim_request_region(pdev, bar, name);
}
#else
static inline int fgds_pcim_request_region(struct pci_dev *pdev, int bar,
					   const char *name)
{
	return pci_request_region(pdev, bar, name);
}
#endif

/*
 * P2PDMA providers without struct pages (struct p2pdma_provider,
 * pcim_p2pdma_provider(), pci_p2pdma_map_type() on a provider) and the
 * dma-buf MMIO helpers dma_buf_phys_vec_to_sgt()/dma_buf_free_sgt() came
 * with vfio-pci's dma-buf export in 6.19. Older kernels with
 * CONFIG_PCI_P2PDMA only have pci_p2pdma_distance().
 */
#if IS_ENABLED(CONFIG_PCI_P2PDMA) && defined(FGDS_HAVE_P2PDMA_PROVIDER_API)
#define FGDS_HAVE_P2PDMA_PROVIDER 1
#include <linux/dma-buf-mapping.h>
#include <linux/pci-p2pdma.h>
#else
#define FGDS_HAVE_P2PDMA_PROVIDER 0
#endif

/* --- end of exporter side --- */

/* --- dma-buf importer and ZONE_DEVICE side (fgds) --- */

/*
 * Where a boundary below is not the exact upstream release of a change, it is
 * placed between the kernels this tree supports (6.12 behaves one way, 7.2
 * and 7.3 the other, each checked in Debian's linux-source); kernels in
 * between are not supported.
 */
#include <linux/device.h>
#include <linux/dma-buf.h>
#include <linux/memremap.h>
#include <linux/mm.h>

/* Symbol namespaces became string literals in 6.13. */
#ifdef FGDS_HAVE_MODULE_IMPORT_NS_STRING
#define FGDS_IMPORT_NS_DMA_BUF() MODULE_IMPORT_NS("DMA_BUF")
#else
#define FGDS_IMPORT_NS_DMA_BUF() MODULE_IMPORT_NS(DMA_BUF)
#endif

/* class_create() lost its owner argument in 6.4. */
#ifdef FGDS_HAVE_CLASS_CREATE_NAME
#define fgds_class_create(name) class_create(name)
#else
#define fgds_class_create(name) class_create(THIS_MODULE, name)
#endif

/* vm_flags became read-only behind helpers in 6.3. */
#ifndef FGDS_HAVE_VM_FLAGS_SET
static inline void fgds_vm_flags_set(struct vm_area_struct *vma,
				     unsigned long flags)
{
	vma->vm_flags |= flags;
}

static inline void fgds_vm_flags_clear(struct vm_area_struct *vma,
				       unsigned long flags)
{
	vma->vm_flags &= ~flags;
}
#else
#define fgds_vm_flags_set(vma, flags) vm_flags_set(vma, flags)
#define fgds_vm_flags_clear(vma, flags) vm_flags_clear(vma, flags)
#endif

/*
 * GUP refuses long-term writable pins (FOLL_LONGTERM | FOLL_WRITE) of a
 * shared mapping that needs dirty tracking, such as one whose vm_ops have
 * page_mkwrite, since 6.5 ("mm/gup: disallow FOLL_LONGTERM GUP-nonfast
 * writing to file-backed mappings"; boundary between 6.1 and 6.12). Before,
 * fgds's page_mkwrite would only cost faults. A change of behaviour inside
 * mm/gup.c, which no compile probe sees.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 5, 0)
#define FGDS_WRITENOTIFY_REFUSES_LONGTERM 1
#else
#define FGDS_WRITENOTIFY_REFUSES_LONGTERM 0
#endif

/*
 * The importer's invalidation callback: move_notify up to 6.12 (where
 * dma_buf_dynamic_attach() refuses importer ops without it), renamed
 * invalidate_mappings in 7.x.
 */
#ifdef FGDS_HAVE_ATTACH_OPS_INVALIDATE_MAPPINGS
#define FGDS_ATTACH_OPS_INVALIDATE(fn) .invalidate_mappings = (fn)
#else
#define FGDS_ATTACH_OPS_INVALIDATE(fn) .move_notify = (fn)
#endif

/* get_dev_pagemap() lost its second (cached pgmap) argument in 7.x. */
static inline struct dev_pagemap *fgds_get_dev_pagemap(unsigned long pfn)
{
#ifdef FGDS_HAVE_GET_DEV_PAGEMAP_PFN
	return get_dev_pagemap(pfn);
#else
	return get_dev_pagemap(pfn, NULL);
#endif
}

/*
 * PTEs mapping the pages of a folio. folio_mapcount() is an inline over the
 * folio's own large mapcount from 6.9; before (6.1) it is not exported, and
 * page_mapcount() of a PTE-mapped page of a compound folio counts that page's
 * PTEs.
 */
static inline int fgds_folio_mapcount(struct folio *folio)
{
#ifdef FGDS_HAVE_FOLIO_LARGE_MAPCOUNT
	return folio_mapcount(folio);
#else
	long i, n = folio_nr_pages(folio);
	int sum = 0;

	for (i = 0; i < n; i++)
		sum += page_mapcount(folio_page(folio, i));
	return sum;
#endif
}

/*
 * folio->mapping of a folio fgds holds. From 6.5 GUP-fast refuses an order-0
 * page without a mapping (gup_fast_folio_allowed(): it cannot rule out
 * secretmem); 6.1 only refuses a secretmem mapping, and its
 * page_add_file_rmap() wants the folio locked once a compound folio has a
 * mapping, so there fgds leaves it NULL. The folio rmap functions that
 * replaced page_add_file_rmap() (6.9) tell the two apart.
 */
static inline void fgds_folio_set_mapping(struct folio *folio,
					  struct address_space *mapping)
{
#ifdef FGDS_HAVE_FOLIO_ADD_FILE_RMAP_PTES
	WRITE_ONCE(folio->mapping, mapping);
#endif
}

/* folio->index of a folio fgds holds: only where it sets ->mapping. */
static inline void fgds_folio_set_index(struct folio *folio, pgoff_t index)
{
#ifdef FGDS_HAVE_FOLIO_ADD_FILE_RMAP_PTES
	WRITE_ONCE(folio->index, index);
#endif
}

/*
 * PMD mappings of 2 MiB GENERIC folios, as device-dax makes them: 7.x maps a
 * folio with vmf_insert_folio_pmd() and a single page with
 * vmf_insert_page_mkwrite(), in a VMA without VM_MIXEDMAP (the huge PMDs of a
 * VM_MIXEDMAP VMA are zapped and split as special ones, without dropping
 * their folio references: mm/huge_memory.c, vma_is_special_huge()). GUP then
 * pins a 2 MiB folio in one step. Up to 6.12 a PMD of ZONE_DEVICE pages is a
 * devmap PMD, which GUP pins page by page: there fgds maps PTEs only.
 */
#if defined(FGDS_HAVE_VMF_INSERT_FOLIO_PMD) && \
	defined(CONFIG_TRANSPARENT_HUGEPAGE)
#define FGDS_FOLIO_PMD 1
#endif

/* --- end of importer side --- */

/* --- file I/O and io_uring commands (fgds) --- */

#include <linux/uio.h>

/*
 * The bytes of an io_uring command: the SQE's command area. 6.6 passes the
 * whole SQE to the driver (->sqe, in linux/io_uring/cmd.h from 6.7); 6.1 only
 * the command area (->cmd, linux/io_uring.h).
 */
#ifdef FGDS_HAVE_IO_URING_CMD_H
#include <linux/io_uring/cmd.h>

static inline const void *fgds_uring_cmd_bytes(const struct io_uring_cmd *cmd)
{
	return cmd->sqe->cmd;
}
#else
#include <linux/io_uring.h>

static inline const void *fgds_uring_cmd_bytes(const struct io_uring_cmd *cmd)
{
	return cmd->cmd;
}
#endif

/*
 * Completing an io_uring command from its task work. 7.x hands the callback
 * the request (io_uring_cmd_from_tw()) and no issue flags, which are then
 * IO_URING_CMD_TASK_WORK_ISSUE_FLAGS; 6.12 hands it the command and the
 * flags. FGDS_DEFINE_URING_TW(name, fn) defines the callback @name of the
 * kernel's type, which calls fn(cmd, issue_flags, dead): @dead is true when
 * the task work runs because the submitting task or its ring is going away
 * (7.x: the token's @cancel; 6.12: IO_URING_F_TASK_DEAD), and nothing new
 * may be started for it then. io_uring_cmd_done() lost its res2 argument in
 * 7.x (io_uring_cmd_done32() has it).
 */
#ifdef FGDS_HAVE_IO_URING_CMD_FROM_TW
#define FGDS_URING_TW_PROTO(name)					\
	void name(struct io_tw_req tw_req, io_tw_token_t tw)
#define FGDS_DEFINE_URING_TW(name, fn)					\
static void name(struct io_tw_req tw_req, io_tw_token_t tw)		\
{									\
	fn(io_uring_cmd_from_tw(tw_req), IO_URING_CMD_TASK_WORK_ISSUE_FLAGS, \
	   tw.cancel);							\
}
#else
#define FGDS_URING_TW_PROTO(name)					\
	void name(struct io_uring_cmd *cmd, unsigned int issue_flags)
#define FGDS_DEFINE_URING_TW(name, fn)					\
static void name(struct io_uring_cmd *cmd, unsigned int issue_flags)	\
{									\
	fn(cmd, issue_flags, issue_flags & IO_URING_F_TASK_DEAD);	\
}
#endif

#ifdef FGDS_HAVE_IO_URING_CMD_DONE32
static inline void fgds_uring_cmd_done(struct io_uring_cmd *cmd, long ret,
				       unsigned int issue_flags)
{
	io_uring_cmd_done(cmd, ret, issue_flags);
}
#else
static inline void fgds_uring_cmd_done(struct io_uring_cmd *cmd, long ret,
				       unsigned int issue_flags)
{
	io_uring_cmd_done(cmd, ret, 0, issue_flags);
}
#endif

/*
 * Whether io_uring posts a positive result that ->uring_cmd() returns. 6.1
 * does not: io_uring_cmd() hands it back to io_issue_sqe(), which takes any
 * value but 0 or an errno for "not completed", and the request never
 * completes. 6.12 posts it. A behaviour change no probe sees: compared by
 * version, between the supported 6.1 and 6.12. fgds offers
 * FGDS_URING_CMD_READ/WRITE only where it holds.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 12, 0)
#define FGDS_URING_CMD_RESULTS 1
#endif

/*
 * A synchronous write through a file's ->write_iter(). vfs_iocb_iter_write()
 * takes the file system's freeze protection itself from 6.8 ("fs: move
 * kiocb_start_write() into vfs_iocb_iter_write()"); before, its callers took
 * it. A behaviour change no probe sees: compared by version, between the
 * supported 6.1 and 6.12.
 */
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 8, 0)
static inline ssize_t fgds_iocb_iter_write(struct file *file,
					   struct kiocb *iocb,
					   struct iov_iter *iter)
{
	return vfs_iocb_iter_write(file, iocb, iter);
}
#else
static inline ssize_t fgds_iocb_iter_write(struct file *file,
					   struct kiocb *iocb,
					   struct iov_iter *iter)
{
	ssize_t ret;

	file_start_write(file);
	ret = vfs_iocb_iter_write(file, iocb, iter);
	file_end_write(file);
	return ret;
}
#endif

/* --- end of file I/O --- */

#endif /* _FGDS_COMPAT_H */

// SPDX-License-Identifier: GPL-2.0
/*
 * fgds: GPU-NVMe direct I/O through POSIX and io_uring.
 *
 * One character device /dev/fgds_DDDD_BB_DD_F (class "fgds") per GPU: a PCI
 * device of display class (VGA or 3D), or named in the devices= parameter,
 * with a prefetchable memory BAR of at least 64 MiB. fgds never binds the
 * GPU: its own driver (the dma-buf exporter) keeps it. Nodes follow the PCI
 * bus through a bus notifier: a GPU added gets a node (when it is announced,
 * or when its driver binds if its BARs were not assigned yet), a GPU removed
 * loses it (after every registration on it has been revoked), and the page
 * provider is dropped when the GPU's driver unbinds.
 */

#include <linux/debugfs.h>
#include <linux/fs.h>
#include <linux/fs_context.h>
#include <linux/idr.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mount.h>
#include <linux/pagemap.h>
#include <linux/pci.h>
#include <linux/pseudo_fs.h>
#include <linux/slab.h>
#include <linux/string.h>

#include "fgds_compat.h"
#include "fgds_drv.h"

#define FGDS_MAX_MINORS		512

static char *devices = "";
module_param(devices, charp, 0444);
MODULE_PARM_DESC(devices,
		 "Comma-separated PCI addresses (DDDD:BB:DD.F) of further devices to treat as GPUs, besides display-class devices");

unsigned int fgds_max_buffers_per_file = 1024;
module_param_named(max_buffers_per_file, fgds_max_buffers_per_file, uint, 0644);
MODULE_PARM_DESC(max_buffers_per_file,
		 "Registrations per open file; past it REG_BUFFER fails with EMFILE (default 1024)");

unsigned long long fgds_max_bytes_per_gpu = 1ULL << 40;
module_param_named(max_bytes_per_gpu, fgds_max_bytes_per_gpu, ullong, 0644);
MODULE_PARM_DESC(max_bytes_per_gpu,
		 "Bytes registered per GPU, over all open files; past it REG_BUFFER fails with ENOSPC (default 1 TiB)");

unsigned long long fgds_max_bytes_per_user = 1ULL << 39;
module_param_named(max_bytes_per_user, fgds_max_bytes_per_user, ullong, 0644);
MODULE_PARM_DESC(max_bytes_per_user,
		 "Bytes one user (uid) may have registered per GPU; past it REG_BUFFER fails with ENOSPC (default 512 GiB, half of max_bytes_per_gpu's default)");

unsigned int fgds_revoke_timeout_ms = 10000;
module_param_named(revoke_timeout_ms, fgds_revoke_timeout_ms, uint, 0644);
MODULE_PARM_DESC(revoke_timeout_ms,
		 "After how long a GPU teardown waiting for I/O logs who still holds its pages (default 10000); it keeps waiting: memory is never given back under a pin");

#ifdef CONFIG_FAULT_INJECTION
unsigned int fgds_race_window_us;
module_param_named(race_window_us, fgds_race_window_us, uint, 0644);
MODULE_PARM_DESC(race_window_us,
		 "Kernels with fault injection only: how long UNREG of a registration waits after giving up the reservation lock, before it frees the registration, so that tests can race an invalidation into that window (default 0)");

unsigned int fgds_lookup_window_us;
module_param_named(lookup_window_us, fgds_lookup_window_us, uint, 0644);
MODULE_PARM_DESC(lookup_window_us,
		 "Kernels with fault injection only: how long a lookup of a registration by its token spins between finding it and taking a reference (only where it found one), so that tests can race UNREG and the registration's free into that window (default 0, at most 20000)");

unsigned int fgds_issue_window_us;
module_param_named(issue_window_us, fgds_issue_window_us, uint, 0644);
MODULE_PARM_DESC(issue_window_us,
		 "Kernels with fault injection only: how long an io_uring command issued on a worker keeps using its kiocb after the file's method queued its I/O, as ext4's reads do, so that tests can land the I/O's completion in that window (default 0, at most 20000)");
#endif

static const char * const fgds_pages_names[] = {
	[FGDS_PAGES_AUTO] = "auto",
	[FGDS_PAGES_P2PDMA] = "p2pdma",
	[FGDS_PAGES_GENERIC] = "generic",
};

int fgds_pages = FGDS_PAGES_AUTO;

static int fgds_pages_set(const char *val, const struct kernel_param *kp)
{
	int i = sysfs_match_string(fgds_pages_names, val);

	if (i < 0) {
		pr_err("fgds: pages=%s: expected auto, p2pdma or generic\n", val);
		return -EINVAL;
	}
	*(int *)kp->arg = i;
	return 0;
}

static int fgds_pages_get(char *buf, const struct kernel_param *kp)
{
	return scnprintf(buf, PAGE_SIZE, "%s\n",
			 fgds_pages_names[*(int *)kp->arg]);
}

static const struct kernel_param_ops fgds_pages_ops = {
	.set = fgds_pages_set,
	.get = fgds_pages_get,
};

module_param_cb(pages, &fgds_pages_ops, &fgds_pages, 0444);
MODULE_PARM_DESC(pages,
		 "Pages fgds creates over a BAR: auto (P2PDMA where the kernel has CONFIG_PCI_P2PDMA, else GENERIC where the topology allows; default), p2pdma or generic");

/*
 * Signals revocation fences and cleans up after them (revoke.c): a rescuer,
 * because fences must be signalled without allocating memory.
 */
struct workqueue_struct *fgds_wq;
struct workqueue_struct *fgds_signal_wq;
struct workqueue_struct *fgds_io_wq;

static dev_t fgds_devt;
/* Counters for the rig's tests (uring.c); none where debugfs is off. */
static struct dentry *fgds_debugfs;
static struct class *fgds_class;
static DEFINE_IDA(fgds_minors);
/* Protects fgds_gpus; taken before any gpu->lock. */
static DEFINE_MUTEX(fgds_lock);

/*
 * The address_space of every open file of every node, and the ->mapping of
 * every folio fgds holds (see the top of gpu.c), as device-dax does it: an
 * inode of a private pseudo filesystem whose mapping marks pages dirty
 * without writeback.
 */
#define FGDS_FS_MAGIC	0x66676473	/* "fgds" */

static struct vfsmount *fgds_mnt;
static struct inode *fgds_inode;
struct address_space *fgds_mapping;

static const struct address_space_operations fgds_aops = {
	.dirty_folio = noop_dirty_folio,
};

static int fgds_init_fs_context(struct fs_context *fc)
{
	return init_pseudo(fc, FGDS_FS_MAGIC) ? 0 : -ENOMEM;
}

static struct file_system_type fgds_fs_type = {
	.name = "fgds",
	.init_fs_context = fgds_init_fs_context,
	.kill_sb = kill_anon_super,
};

static int fgds_mapping_init(void)
{
	int ret;

	fgds_mnt = kern_mount(&fgds_fs_type);
	if (IS_ERR(fgds_mnt))
		return PTR_ERR(fgds_mnt);
	fgds_inode = alloc_anon_inode(fgds_mnt->mnt_sb);
	if (IS_ERR(fgds_inode)) {
		ret = PTR_ERR(fgds_inode);
		kern_unmount(fgds_mnt);
		return ret;
	}
	fgds_inode->i_mapping->a_ops = &fgds_aops;
	fgds_mapping = fgds_inode->i_mapping;
	return 0;
}

static void fgds_mapping_exit(void)
{
	iput(fgds_inode);
	kern_unmount(fgds_mnt);
}

static LIST_HEAD(fgds_gpus);

static bool fgds_named(struct pci_dev *pdev)
{
	const char *name = pci_name(pdev);
	const char *p = devices;
	size_t len;

	while (p && *p) {
		len = strcspn(p, ",");
		if (len == strlen(name) && !strncasecmp(p, name, len))
			return true;
		/* "BB:DD.F" for domain 0 */
		if (len + 5 == strlen(name) && !pci_domain_nr(pdev->bus) &&
		    !strncasecmp(p, name + 5, len))
			return true;
		p += len;
		p += *p == ',';
	}
	return false;
}

static bool fgds_is_display(struct pci_dev *pdev)
{
	unsigned int class = pdev->class >> 8;

	return class == PCI_CLASS_DISPLAY_VGA || class == PCI_CLASS_DISPLAY_3D;
}

static struct fgds_gpu *fgds_find(struct pci_dev *pdev)
{
	struct fgds_gpu *gpu;

	lockdep_assert_held(&fgds_lock);
	list_for_each_entry(gpu, &fgds_gpus, list)
		if (gpu->pdev == pdev)
			return gpu;
	return NULL;
}

static void fgds_gpu_release(struct device *dev)
{
	struct fgds_gpu *gpu = container_of(dev, struct fgds_gpu, dev);

	WARN_ON_ONCE(gpu->nr_held || !list_empty(&gpu->pending));
	xa_destroy(&gpu->holds);
	xa_destroy(&gpu->user_pages);
	mutex_destroy(&gpu->holds_lock);
	mutex_destroy(&gpu->bufs_lock);
	mutex_destroy(&gpu->lock);
	ida_free(&fgds_minors, MINOR(dev->devt));
	pci_dev_put(gpu->pdev);
	kfree(gpu);
}

/*
 * Creates the GPU's node if it has none. A hot-added device is announced
 * (BUS_NOTIFY_ADD_DEVICE) before its BARs are assigned, so this runs again when
 * a driver binds; @quiet says the BARs may still be unassigned.
 */
static void fgds_gpu_add(struct pci_dev *pdev, bool quiet)
{
	bool named = fgds_named(pdev);
	struct fgds_gpu *gpu;
	int bar, minor, ret;

	if (!named && !fgds_is_display(pdev))
		return;
	bar = fgds_gpu_pick_bar(pdev);
	if (bar < 0) {
		if (named && !quiet)
			pci_warn(pdev, "fgds: named in devices= but has no prefetchable memory BAR of 64 MiB or more\n");
		return;
	}

	mutex_lock(&fgds_lock);
	if (fgds_find(pdev))
		goto out;
	minor = ida_alloc_max(&fgds_minors, FGDS_MAX_MINORS - 1, GFP_KERNEL);
	if (minor < 0) {
		pci_err(pdev, "fgds: no minor number left (%d)\n", minor);
		goto out;
	}
	gpu = kzalloc(sizeof(*gpu), GFP_KERNEL);
	if (!gpu) {
		ida_free(&fgds_minors, minor);
		goto out;
	}
	gpu->pdev = pci_dev_get(pdev);
	gpu->geo.bar = bar;
	gpu->geo.start = pci_resource_start(pdev, bar);
	gpu->geo.bus = pci_bus_address(pdev, bar);
	gpu->geo.len = pci_resource_len(pdev, bar);
	mutex_init(&gpu->lock);
	mutex_init(&gpu->bufs_lock);
	INIT_LIST_HEAD(&gpu->bufs);
	xa_init(&gpu->user_pages);
	mutex_init(&gpu->holds_lock);
	xa_init(&gpu->holds);
	spin_lock_init(&gpu->pending_lock);
	INIT_LIST_HEAD(&gpu->pending);
	INIT_DELAYED_WORK(&gpu->quiesce, fgds_quiesce_fn);
	init_waitqueue_head(&gpu->quiet_wq);

	device_initialize(&gpu->dev);
	gpu->dev.class = fgds_class;
	gpu->dev.parent = &pdev->dev;
	gpu->dev.devt = MKDEV(MAJOR(fgds_devt), minor);
	gpu->dev.groups = fgds_gpu_groups;
	gpu->dev.release = fgds_gpu_release;
	dev_set_drvdata(&gpu->dev, gpu);
	ret = dev_set_name(&gpu->dev, "fgds_%04x_%02x_%02x_%x",
			   pci_domain_nr(pdev->bus), pdev->bus->number,
			   PCI_SLOT(pdev->devfn), PCI_FUNC(pdev->devfn));
	if (ret)
		goto err_put;
	cdev_init(&gpu->cdev, &fgds_fops);
	gpu->cdev.owner = THIS_MODULE;
	ret = cdev_device_add(&gpu->cdev, &gpu->dev);
	if (ret)
		goto err_put;

	list_add_tail(&gpu->list, &fgds_gpus);
	pci_info(pdev, "fgds: /dev/%s over BAR %d (%pa bytes)\n",
		 dev_name(&gpu->dev), bar, &gpu->geo.len);
out:
	mutex_unlock(&fgds_lock);
	return;

err_put:
	pci_err(pdev, "fgds: cannot create the device node: %d\n", ret);
	put_device(&gpu->dev);
	mutex_unlock(&fgds_lock);
}

/*
 * Takes the GPU's node away once every registration on it is revoked and its
 * pages are let go. The GPU is off the global list already: no fgds lock is
 * held while teardown waits for I/O.
 */
static void fgds_gpu_remove(struct fgds_gpu *gpu)
{
	mutex_lock(&gpu->lock);
	WRITE_ONCE(gpu->dead, true);
	mutex_unlock(&gpu->lock);
	fgds_gpu_teardown(gpu);
	if (cancel_delayed_work_sync(&gpu->quiesce))
		put_device(&gpu->dev);
	cdev_device_del(&gpu->cdev, &gpu->dev);
	pci_info(gpu->pdev, "fgds: /dev/%s removed\n", dev_name(&gpu->dev));
	put_device(&gpu->dev);
}

/* The GPU of @pdev, referenced, or NULL; @unlist takes it off the list. */
static struct fgds_gpu *fgds_get(struct pci_dev *pdev, bool unlist)
{
	struct fgds_gpu *gpu;

	mutex_lock(&fgds_lock);
	gpu = fgds_find(pdev);
	if (gpu && unlist)
		list_del(&gpu->list);
	else if (gpu)
		get_device(&gpu->dev);
	mutex_unlock(&fgds_lock);
	return gpu;
}

/*
 * A storage device's driver is gone: every GPU drops the mappings its
 * registrations had for it (fgds_gpu_forget_dma_dev()), each GPU referenced
 * and fgds_lock let go first, since that waits for locks.
 */
static void fgds_forget_dma_dev(struct pci_dev *pdev)
{
	struct fgds_gpu *gpu, **gpus;
	unsigned int n = 0, i;

	if ((pdev->class >> 16) != PCI_BASE_CLASS_STORAGE)
		return;
	mutex_lock(&fgds_lock);
	list_for_each_entry(gpu, &fgds_gpus, list)
		n++;
	gpus = kmalloc_array(n, sizeof(*gpus), GFP_KERNEL);
	if (!gpus) {
		mutex_unlock(&fgds_lock);
		pci_warn(pdev, "fgds: out of memory: mappings made for this device stay until their registrations go\n");
		return;
	}
	n = 0;
	list_for_each_entry(gpu, &fgds_gpus, list) {
		get_device(&gpu->dev);
		gpus[n++] = gpu;
	}
	mutex_unlock(&fgds_lock);
	for (i = 0; i < n; i++) {
		fgds_gpu_forget_dma_dev(gpus[i], pdev);
		put_device(&gpus[i]->dev);
	}
	kfree(gpus);
}

static int fgds_pci_notify(struct notifier_block *nb, unsigned long action,
			   void *data)
{
	struct pci_dev *pdev = to_pci_dev(data);
	struct fgds_gpu *gpu;

	switch (action) {
	case BUS_NOTIFY_ADD_DEVICE:
		fgds_gpu_add(pdev, true);
		break;
	case BUS_NOTIFY_BOUND_DRIVER:
		fgds_gpu_add(pdev, false);
		break;
	case BUS_NOTIFY_UNBIND_DRIVER:
		/*
		 * Before the driver's remove() and its devres release. Waits
		 * for I/O into the GPU's memory with only this device's lock
		 * held (by the driver core).
		 */
		gpu = fgds_get(pdev, false);
		if (gpu) {
			fgds_gpu_teardown(gpu);
			put_device(&gpu->dev);
		}
		break;
	case BUS_NOTIFY_UNBOUND_DRIVER:
		fgds_forget_dma_dev(pdev);
		break;
	case BUS_NOTIFY_DEL_DEVICE:
		gpu = fgds_get(pdev, true);
		if (gpu)
			fgds_gpu_remove(gpu);
		break;
	}
	return NOTIFY_DONE;
}

static struct notifier_block fgds_pci_nb = {
	.notifier_call = fgds_pci_notify,
};

static int __init fgds_init(void)
{
	struct pci_dev *pdev = NULL;
	int ret;

	fgds_wq = alloc_workqueue("fgds", WQ_UNBOUND | WQ_MEM_RECLAIM, 0);
	if (!fgds_wq)
		return -ENOMEM;
	/*
	 * The quiesce work alone, which signals revocation fences: nothing on
	 * this queue ever waits for the reservation lock or for memory, so an
	 * exporter waiting for a fence under that lock cannot hold it up.
	 */
	fgds_signal_wq = alloc_workqueue("fgds_signal",
					 WQ_UNBOUND | WQ_MEM_RECLAIM | WQ_HIGHPRI,
					 0);
	if (!fgds_signal_wq) {
		ret = -ENOMEM;
		goto err_wq;
	}
	/* io_uring commands' I/O issued again, waiting, out of task work. */
	fgds_io_wq = alloc_workqueue("fgds_io", WQ_UNBOUND, 0);
	if (!fgds_io_wq) {
		ret = -ENOMEM;
		goto err_signal_wq;
	}
	ret = fgds_mapping_init();
	if (ret)
		goto err_io_wq;
	ret = alloc_chrdev_region(&fgds_devt, 0, FGDS_MAX_MINORS, "fgds");
	if (ret)
		goto err_mapping;
	fgds_class = fgds_class_create("fgds");
	if (IS_ERR(fgds_class)) {
		ret = PTR_ERR(fgds_class);
		goto err_region;
	}
	ret = bus_register_notifier(&pci_bus_type, &fgds_pci_nb);
	if (ret)
		goto err_class;
	fgds_debugfs = debugfs_create_dir("fgds", NULL);
	fgds_uring_debugfs_init(fgds_debugfs);
	for_each_pci_dev(pdev)
		fgds_gpu_add(pdev, false);
	return 0;

err_class:
	class_destroy(fgds_class);
err_region:
	unregister_chrdev_region(fgds_devt, FGDS_MAX_MINORS);
err_mapping:
	fgds_mapping_exit();
err_io_wq:
	destroy_workqueue(fgds_io_wq);
err_signal_wq:
	destroy_workqueue(fgds_signal_wq);
err_wq:
	destroy_workqueue(fgds_wq);
	return ret;
}

static void __exit fgds_exit(void)
{
	struct fgds_gpu *gpu;

	bus_unregister_notifier(&pci_bus_type, &fgds_pci_nb);
	debugfs_remove(fgds_debugfs);
	for (;;) {
		mutex_lock(&fgds_lock);
		gpu = list_first_entry_or_null(&fgds_gpus, struct fgds_gpu,
					       list);
		if (gpu)
			list_del(&gpu->list);
		mutex_unlock(&fgds_lock);
		if (!gpu)
			break;
		fgds_gpu_remove(gpu);
	}
	/* Each reissue holds an io_uring command, so the node: none is left. */
	destroy_workqueue(fgds_io_wq);
	/* The quiesce work queues cleanup work: it goes first. */
	destroy_workqueue(fgds_signal_wq);
	/* Cleanup and fence work drop their module references last. */
	destroy_workqueue(fgds_wq);
	/*
	 * Killing a registration's users queued an RCU callback of the
	 * percpu_ref core that calls fgds_users_release(), module text.
	 */
	rcu_barrier();
	class_destroy(fgds_class);
	unregister_chrdev_region(fgds_devt, FGDS_MAX_MINORS);
	ida_destroy(&fgds_minors);
	fgds_mapping_exit();
}

module_init(fgds_init);
module_exit(fgds_exit);

FGDS_IMPORT_NS_DMA_BUF();
MODULE_DESCRIPTION("Direct I/O between NVMe and GPU memory exported as dma-buf");
MODULE_LICENSE("GPL");

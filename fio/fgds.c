// SPDX-License-Identifier: GPL-2.0-only
/*
 * fio ioengine "fgds": reads and writes between a file opened O_DIRECT and
 * GPU memory exported as a dma-buf, through fgds's own commands
 * (FGDS_URING_CMD_READ/WRITE on an io_uring of the job's depth, or with
 * fgds_ioctl=1 FGDS_IOCTL_READ/WRITE, one at a time). fio's I/O buffers are
 * the registration's CPU mapping, so fio's verify checks what reached GPU
 * memory.
 *
 *   ioengine=external:/usr/lib/fgds/fio-fgds.so
 *   direct=1
 *   fgds_dmabuf=vgpu:0     where the GPU memory comes from (see below)
 *   fgds_gpu=0000:03:00.0  the GPU (default: the only one fgds serves)
 *   fgds_buffer_size=64m   GPU memory to register (default: what fio needs)
 *
 * External engines see fio's internal structures, so this file is built
 * against the source of the fio that loads it: `cargo xtask fio` builds it
 * for Debian's fio 3.33 (fio refuses an engine of another FIO_IOOPS_VERSION).
 * Nothing falls back: a file the GPU's memory cannot reach by DMA fails the
 * job with EREMOTEIO (fgds's kernel log line says why).
 */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/io_uring.h>
#include <linux/fgds.h>
#include <linux/vgpu.h>

#include "fio.h"
#include "optgroup.h"

struct fgds_options {
	void *pad;		/* fio takes an option at offset 0 as unset */
	char *gpu;
	char *dmabuf;
	unsigned long long buffer_size;
	unsigned int ioctl;
};

struct fgds_ring {
	int fd;
	unsigned int *sq_head, *sq_tail, *sq_mask, *sq_array;
	unsigned int *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;	/* 128 bytes each (IORING_SETUP_SQE128) */
	struct io_uring_cqe *cqes;
	void *sq_map, *cq_map;
	size_t sq_len, cq_len, sqes_len;
	unsigned int tail;		/* the next entry to fill */
	unsigned int to_submit;		/* filled, not yet taken by the kernel */
};

struct fgds_data {
	int node;
	int dmabuf;
	__u64 idx;
	void *map;
	size_t len;
	struct fgds_ring ring;
	struct io_u **events;
	unsigned int nr_events;
	bool told;		/* the EOPNOTSUPP hint was logged */
};

static struct fio_option options[] = {
	{
		.name	= "fgds_gpu",
		.lname	= "fgds GPU",
		.type	= FIO_OPT_STR_STORE,
		.off1	= offsetof(struct fgds_options, gpu),
		.help	= "PCI address of the GPU (default: the only GPU fgds serves)",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= "fgds_dmabuf",
		.lname	= "fgds GPU memory",
		.type	= FIO_OPT_STR_STORE,
		.off1	= offsetof(struct fgds_options, dmabuf),
		.help	= "GPU memory: vgpu:N (the rig's /dev/vgpuN) or fd:N (a dma-buf fd fio inherits)",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= "fgds_buffer_size",
		.lname	= "fgds buffer size",
		.type	= FIO_OPT_STR_VAL,
		.off1	= offsetof(struct fgds_options, buffer_size),
		.help	= "GPU memory to register (default: what the job's buffers need)",
		.def	= "0",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= "fgds_ioctl",
		.lname	= "fgds ioctls",
		.type	= FIO_OPT_BOOL,
		.off1	= offsetof(struct fgds_options, ioctl),
		.help	= "FGDS_IOCTL_READ/WRITE, one at a time, instead of io_uring commands",
		.def	= "0",
		.category = FIO_OPT_C_ENGINE,
		.group	= FIO_OPT_G_INVALID,
	},
	{
		.name	= NULL,
	},
};

static int fgds_err(struct thread_data *td, int err, const char *what)
{
	log_err("fio-fgds: %s: %s\n", what, strerror(err));
	td_verror(td, err, what);
	return 1;
}

/* The node of fgds_gpu, or the only /dev/fgds_* there is. */
static int fgds_open_node(struct thread_data *td, const char *gpu)
{
	char path[64];
	glob_t g;
	int fd;

	if (gpu) {
		unsigned int dom, bus, dev, fn;

		if (sscanf(gpu, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4)
			return -fgds_err(td, EINVAL,
					 "fgds_gpu: give the GPU's PCI address as DDDD:BB:DD.F");
		snprintf(path, sizeof(path), "/dev/fgds_%04x_%02x_%02x_%x",
			 dom, bus, dev, fn);
	} else {
		int ret = glob("/dev/fgds_*", 0, NULL, &g);

		if (ret || g.gl_pathc != 1) {
			if (!ret)
				globfree(&g);
			return -fgds_err(td, ret ? ENODEV : EINVAL,
					 ret ? "no /dev/fgds_* node: load fgds and bind the GPU's driver" :
					 "several GPUs: name one with fgds_gpu=DDDD:BB:DD.F");
		}
		snprintf(path, sizeof(path), "%s", g.gl_pathv[0]);
		globfree(&g);
	}
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0) {
		log_err("fio-fgds: open %s: %s (the fgds group may open it)\n",
			path, strerror(errno));
		td_verror(td, errno, "open the fgds node");
		return -1;
	}
	return fd;
}

/* A dma-buf of at least @len bytes: a fresh vgpu allocation or an inherited fd. */
static int fgds_get_dmabuf(struct thread_data *td, const char *spec, size_t len)
{
	unsigned int n;
	int fd;

	if (spec && sscanf(spec, "vgpu:%u", &n) == 1) {
		struct vgpu_alloc va = { .size = len };
		char path[32];
		int vgpu;

		snprintf(path, sizeof(path), "/dev/vgpu%u", n);
		vgpu = open(path, O_RDWR | O_CLOEXEC);
		if (vgpu < 0)
			return -fgds_err(td, errno, "open /dev/vgpuN (fgds_dmabuf=vgpu:N)");
		if (ioctl(vgpu, VGPU_IOCTL_ALLOC, &va)) {
			int err = errno;

			close(vgpu);
			return -fgds_err(td, err, "VGPU_IOCTL_ALLOC of the buffer");
		}
		close(vgpu);
		return va.fd;
	}
	if (spec && sscanf(spec, "fd:%u", &n) == 1) {
		off_t size = lseek(n, 0, SEEK_END);

		if (size < 0)
			return -fgds_err(td, errno, "fgds_dmabuf=fd:N is no dma-buf fio inherited");
		if ((size_t)size < len) {
			log_err("fio-fgds: the dma-buf of fd %u holds %lld bytes, the job needs %zu\n",
				n, (long long)size, len);
			td_verror(td, ENOSPC, "dma-buf too small");
			return -1;
		}
		fd = fcntl(n, F_DUPFD_CLOEXEC, 0);
		if (fd < 0)
			return -fgds_err(td, errno, "dup of the dma-buf fd");
		return fd;
	}
	return -fgds_err(td, EINVAL,
			 "say where the GPU memory comes from: fgds_dmabuf=vgpu:N or fd:N");
}

static void fgds_ring_exit(struct fgds_ring *r)
{
	if (r->sqes)
		munmap(r->sqes, r->sqes_len);
	if (r->cq_map)
		munmap(r->cq_map, r->cq_len);
	if (r->sq_map)
		munmap(r->sq_map, r->sq_len);
	if (r->fd >= 0)
		close(r->fd);
	r->fd = -1;
}

static int fgds_ring_init(struct fgds_ring *r, unsigned int entries)
{
	struct io_uring_params p = { .flags = IORING_SETUP_SQE128 };
	int prot = PROT_READ | PROT_WRITE, flags = MAP_SHARED | MAP_POPULATE;

	r->fd = syscall(__NR_io_uring_setup, entries, &p);
	if (r->fd < 0)
		return -errno;
	r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned int);
	r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
	r->sqes_len = p.sq_entries * 2 * sizeof(struct io_uring_sqe);
	r->sq_map = mmap(NULL, r->sq_len, prot, flags, r->fd, IORING_OFF_SQ_RING);
	r->cq_map = mmap(NULL, r->cq_len, prot, flags, r->fd, IORING_OFF_CQ_RING);
	r->sqes = mmap(NULL, r->sqes_len, prot, flags, r->fd, IORING_OFF_SQES);
	if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) {
		int err = errno;

		if (r->sq_map == MAP_FAILED)
			r->sq_map = NULL;
		if (r->cq_map == MAP_FAILED)
			r->cq_map = NULL;
		if (r->sqes == MAP_FAILED)
			r->sqes = NULL;
		fgds_ring_exit(r);
		return -err;
	}
	r->sq_head = r->sq_map + p.sq_off.head;
	r->sq_tail = r->sq_map + p.sq_off.tail;
	r->sq_mask = r->sq_map + p.sq_off.ring_mask;
	r->sq_array = r->sq_map + p.sq_off.array;
	r->cq_head = r->cq_map + p.cq_off.head;
	r->cq_tail = r->cq_map + p.cq_off.tail;
	r->cq_mask = r->cq_map + p.cq_off.ring_mask;
	r->cqes = r->cq_map + p.cq_off.cqes;
	r->tail = *r->sq_tail;
	return 0;
}

static int fgds_init(struct thread_data *td)
{
	struct fgds_options *o = td->eo;
	struct fgds_data *d;
	int ret;

	if (!td->o.odirect) {
		log_err("fio-fgds: set direct=1: fgds moves data by DMA, which needs O_DIRECT\n");
		td_verror(td, EINVAL, "direct=1 required");
		return 1;
	}
	d = calloc(1, sizeof(*d));
	if (!d)
		return fgds_err(td, ENOMEM, "engine data");
	d->node = -1;
	d->dmabuf = -1;
	d->ring.fd = -1;
	td->io_ops_data = d;
	d->events = calloc(td->o.iodepth, sizeof(*d->events));
	if (!d->events)
		return fgds_err(td, ENOMEM, "event array");
	d->node = fgds_open_node(td, o->gpu);
	if (d->node < 0)
		return 1;
	if (!o->ioctl) {
		ret = fgds_ring_init(&d->ring, td->o.iodepth);
		if (ret)
			return fgds_err(td, -ret, "io_uring_setup with 128-byte entries");
	}
	return 0;
}

static void fgds_cleanup(struct thread_data *td)
{
	struct fgds_data *d = td->io_ops_data;

	if (!d)
		return;
	fgds_ring_exit(&d->ring);
	if (d->node >= 0)
		close(d->node);
	free(d->events);
	free(d);
	td->io_ops_data = NULL;
}

static int fgds_iomem_alloc(struct thread_data *td, size_t total_mem)
{
	struct fgds_options *o = td->eo;
	struct fgds_data *d = td->io_ops_data;
	long page = sysconf(_SC_PAGESIZE);
	struct fgds_ioctl_reg_buffer reg = { 0 };
	struct fgds_ioctl_unreg_buffer unreg;
	size_t len = (total_mem + page - 1) & ~(size_t)(page - 1);
	void *map;

	if (o->buffer_size) {
		if (o->buffer_size < len) {
			log_err("fio-fgds: fgds_buffer_size=%llu is less than the %zu bytes the job's buffers need (iodepth x bs)\n",
				o->buffer_size, len);
			td_verror(td, EINVAL, "fgds_buffer_size too small");
			return 1;
		}
		len = (o->buffer_size + page - 1) & ~(size_t)(page - 1);
	}
	d->dmabuf = fgds_get_dmabuf(td, o->dmabuf, len);
	if (d->dmabuf < 0)
		return 1;
	reg.dmabuf_fd = d->dmabuf;
	reg.size = len;
	if (ioctl(d->node, FGDS_IOCTL_REG_BUFFER, &reg)) {
		fgds_err(td, errno, "FGDS_IOCTL_REG_BUFFER (the kernel log says why)");
		goto err_dmabuf;
	}
	map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, d->node, reg.idx);
	if (map == MAP_FAILED) {
		fgds_err(td, errno, "mmap of the registration");
		goto err_unreg;
	}
	d->idx = reg.idx;
	d->map = map;
	d->len = len;
	td->orig_buffer = map;
	return 0;

err_unreg:
	unreg.idx = reg.idx;
	ioctl(d->node, FGDS_IOCTL_UNREG_BUFFER, &unreg);
err_dmabuf:
	close(d->dmabuf);
	d->dmabuf = -1;
	return 1;
}

static void fgds_iomem_free(struct thread_data *td)
{
	struct fgds_data *d = td->io_ops_data;
	struct fgds_ioctl_unreg_buffer unreg;

	if (!d || !d->map)
		return;
	munmap(d->map, d->len);
	unreg.idx = d->idx;
	if (ioctl(d->node, FGDS_IOCTL_UNREG_BUFFER, &unreg))
		log_err("fio-fgds: FGDS_IOCTL_UNREG_BUFFER: %s\n", strerror(errno));
	close(d->dmabuf);
	d->map = NULL;
	d->dmabuf = -1;
	td->orig_buffer = NULL;
}

static void fgds_fill_io(struct fgds_data *d, struct io_u *io_u, struct fgds_io *io)
{
	memset(io, 0, sizeof(*io));
	io->idx = d->idx;
	io->offset = (char *)io_u->xfer_buf - (char *)d->map;
	io->len = io_u->xfer_buflen;
	io->file_offset = io_u->offset;
	io->fd = io_u->file->fd;
}

static void fgds_complete(struct io_u *io_u, long long res)
{
	if (res < 0)
		io_u->error = -res;
	else if ((unsigned long long)res < io_u->xfer_buflen)
		io_u->resid = io_u->xfer_buflen - res;
}

static enum fio_q_status fgds_queue(struct thread_data *td, struct io_u *io_u)
{
	struct fgds_options *o = td->eo;
	struct fgds_data *d = td->io_ops_data;
	struct fgds_ring *r = &d->ring;
	struct io_uring_sqe *sqe;
	struct fgds_io io;
	unsigned int tail, at;

	fio_ro_check(td, io_u);
	if (io_u->ddir == DDIR_SYNC || io_u->ddir == DDIR_DATASYNC) {
		if (fsync(io_u->file->fd))
			io_u->error = errno;
		return FIO_Q_COMPLETED;
	}
	if (io_u->ddir != DDIR_READ && io_u->ddir != DDIR_WRITE) {
		io_u->error = EINVAL;
		return FIO_Q_COMPLETED;
	}
	fgds_fill_io(d, io_u, &io);
	if (o->ioctl) {
		unsigned long cmd = io_u->ddir == DDIR_READ ? FGDS_IOCTL_READ : FGDS_IOCTL_WRITE;
		long long res = ioctl(d->node, cmd, &io);

		fgds_complete(io_u, res < 0 ? -errno : res);
		return FIO_Q_COMPLETED;
	}
	tail = r->tail;
	if (tail - atomic_load_explicit((_Atomic unsigned int *)r->sq_head,
					memory_order_acquire) > *r->sq_mask)
		return FIO_Q_BUSY;
	at = tail & *r->sq_mask;
	sqe = &r->sqes[2 * at];
	memset(sqe, 0, 2 * sizeof(*sqe));
	sqe->opcode = IORING_OP_URING_CMD;
	sqe->fd = d->node;
	sqe->cmd_op = io_u->ddir == DDIR_READ ? FGDS_URING_CMD_READ : FGDS_URING_CMD_WRITE;
	sqe->user_data = (unsigned long)io_u;
	memcpy(sqe->cmd, &io, sizeof(io));
	r->sq_array[at] = at;
	r->tail++;
	r->to_submit++;
	return FIO_Q_QUEUED;
}

static int fgds_commit(struct thread_data *td)
{
	struct fgds_data *d = td->io_ops_data;
	struct fgds_ring *r = &d->ring;
	int ret;

	if (!r->to_submit)
		return 0;
	atomic_store_explicit((_Atomic unsigned int *)r->sq_tail, r->tail,
			      memory_order_release);
	do {
		ret = syscall(__NR_io_uring_enter, r->fd, r->to_submit, 0, 0, NULL, 0);
	} while (ret < 0 && errno == EINTR);
	if (ret < 0)
		return -errno;
	/* Entries the kernel did not take yet go with the next call. */
	r->to_submit -= ret;
	return 0;
}

static int fgds_getevents(struct thread_data *td, unsigned int min, unsigned int max,
			  const struct timespec *t)
{
	struct fgds_data *d = td->io_ops_data;
	struct fgds_ring *r = &d->ring;

	(void)t;
	d->nr_events = 0;
	while (d->nr_events < max) {
		unsigned int head = *r->cq_head;
		unsigned int tail = atomic_load_explicit((_Atomic unsigned int *)r->cq_tail,
							 memory_order_acquire);

		for (; head != tail && d->nr_events < max; head++) {
			struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
			struct io_u *io_u = (struct io_u *)(unsigned long)cqe->user_data;

			if (cqe->res == -EOPNOTSUPP && !d->told) {
				log_err("fio-fgds: this kernel's io_uring cannot carry fgds's commands (Linux 6.1): set fgds_ioctl=1\n");
				d->told = true;
			}
			fgds_complete(io_u, cqe->res);
			d->events[d->nr_events++] = io_u;
		}
		atomic_store_explicit((_Atomic unsigned int *)r->cq_head, head,
				      memory_order_release);
		if (d->nr_events >= min)
			break;
		if (syscall(__NR_io_uring_enter, r->fd, 0, min - d->nr_events,
			    IORING_ENTER_GETEVENTS, NULL, 0) < 0 && errno != EINTR)
			return -errno;
	}
	return d->nr_events;
}

static struct io_u *fgds_event(struct thread_data *td, int event)
{
	struct fgds_data *d = td->io_ops_data;

	return d->events[event];
}

static int fgds_open_file(struct thread_data *td, struct fio_file *f)
{
	return generic_open_file(td, f);
}

static int fgds_close_file(struct thread_data *td, struct fio_file *f)
{
	return generic_close_file(td, f);
}

struct ioengine_ops ioengine = {
	.name			= "fgds",
	.version		= FIO_IOOPS_VERSION,
	.init			= fgds_init,
	.cleanup		= fgds_cleanup,
	.queue			= fgds_queue,
	.commit			= fgds_commit,
	.getevents		= fgds_getevents,
	.event			= fgds_event,
	.open_file		= fgds_open_file,
	.close_file		= fgds_close_file,
	.get_file_size		= generic_get_file_size,
	.iomem_alloc		= fgds_iomem_alloc,
	.iomem_free		= fgds_iomem_free,
	.options		= options,
	.option_struct_size	= sizeof(struct fgds_options),
};

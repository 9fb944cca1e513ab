// SPDX-License-Identifier: GPL-2.0
/*
 * io_buffer_register_kbuf(): io_uring kernel buffers whose owner can revoke
 * them (vm-images/kernel-patches/io-uring-revocable-kbuf; not upstream).
 */
#include <linux/io_uring/cmd.h>
#include <linux/percpu-refcount.h>

int fgds_probe(struct io_uring_cmd *cmd, struct percpu_ref *users);
int fgds_probe(struct io_uring_cmd *cmd, struct percpu_ref *users)
{
	struct io_kbuf_desc desc = { .users = users };

	return io_buffer_register_kbuf(cmd, &desc, 0, 0);
}

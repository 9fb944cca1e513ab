// SPDX-License-Identifier: GPL-2.0
/*
 * linux/io_uring/cmd.h, and the whole SQE in struct io_uring_cmd (6.7);
 * linux/io_uring.h and only the command area (->cmd) before.
 */
#include <linux/io_uring/cmd.h>

const void *fgds_probe(const struct io_uring_cmd *cmd);
const void *fgds_probe(const struct io_uring_cmd *cmd)
{
	return cmd->sqe->cmd;
}

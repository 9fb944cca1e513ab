// SPDX-License-Identifier: GPL-2.0
/*
 * io_uring_cmd_done32(): io_uring_cmd_done() lost its res2 argument, which
 * moved to io_uring_cmd_done32().
 */
#include <linux/io_uring/cmd.h>

void fgds_probe(struct io_uring_cmd *cmd, unsigned int issue_flags);
void fgds_probe(struct io_uring_cmd *cmd, unsigned int issue_flags)
{
	io_uring_cmd_done32(cmd, 0, 0, issue_flags);
}

// SPDX-License-Identifier: GPL-2.0
/*
 * io_uring_cmd_from_tw(): an io_uring command's task-work callback gets the
 * request (struct io_tw_req), not the command and its issue flags.
 */
#include <linux/io_uring/cmd.h>

struct io_uring_cmd *fgds_probe(struct io_tw_req tw_req);
struct io_uring_cmd *fgds_probe(struct io_tw_req tw_req)
{
	return io_uring_cmd_from_tw(tw_req);
}

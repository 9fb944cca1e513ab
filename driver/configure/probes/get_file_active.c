// SPDX-License-Identifier: GPL-2.0
/* get_file_active() (6.7); get_file_rcu() on a struct file * before. */
#include <linux/fs.h>

struct file *fgds_probe(struct file **f);
struct file *fgds_probe(struct file **f)
{
	return get_file_active(f);
}

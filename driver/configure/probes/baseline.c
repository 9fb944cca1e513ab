// SPDX-License-Identifier: GPL-2.0
/* Compiles on every kernel: proves conftest.sh's flags work. */
#include <linux/module.h>

int fgds_probe(void);
int fgds_probe(void)
{
	return 0;
}

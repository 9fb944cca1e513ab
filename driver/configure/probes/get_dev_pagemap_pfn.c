// SPDX-License-Identifier: GPL-2.0
/* get_dev_pagemap() takes the pfn alone (7.x); a cached pgmap too before. */
#include <linux/memremap.h>

struct dev_pagemap *fgds_probe(unsigned long pfn);
struct dev_pagemap *fgds_probe(unsigned long pfn)
{
	return get_dev_pagemap(pfn);
}

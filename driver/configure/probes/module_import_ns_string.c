// SPDX-License-Identifier: GPL-2.0
/*
 * MODULE_IMPORT_NS() takes a string literal (6.13); before, it stringified its
 * argument, which makes the string below two bytes longer.
 */
#include <linux/module.h>

#undef MODULE_INFO
#define MODULE_INFO(tag, info) const char fgds_probe_##tag[] = info

MODULE_IMPORT_NS("DMA_BUF");
static_assert(sizeof(fgds_probe_import_ns) == sizeof("DMA_BUF"));

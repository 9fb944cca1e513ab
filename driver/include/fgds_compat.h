/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel-version differences for the fgds driver and the rig's vgpu
 * exporter. Supported: Linux 6.1, 6.12, 7.2 and 7.3 (Debian). Every
 * difference between those kernels lives here, nowhere else.
 */
#ifndef _FGDS_COMPAT_H
#define _FGDS_COMPAT_H

#include <linux/version.h>
#include <linux/module.h>

/* --- dma-buf exporter side (vgpu) --- */

/* --- end of exporter side --- */

/* --- dma-buf importer and ZONE_DEVICE side (fgds) --- */

/* --- end of importer side --- */

#endif /* _FGDS_COMPAT_H */

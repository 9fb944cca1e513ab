// SPDX-License-Identifier: GPL-2.0
/* The importer's callback is invalidate_mappings (move_notify before 7.x). */
#include <linux/dma-buf.h>

void fgds_probe_invalidate(struct dma_buf_attachment *attach);
void fgds_probe_invalidate(struct dma_buf_attachment *attach)
{
}

const struct dma_buf_attach_ops fgds_probe_ops = {
	.invalidate_mappings = fgds_probe_invalidate,
};

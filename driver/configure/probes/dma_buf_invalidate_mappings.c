// SPDX-License-Identifier: GPL-2.0
/*
 * dma_buf_invalidate_mappings() and dma_buf_attach_revocable(): the exporter's
 * invalidation under its 7.x name (dma_buf_move_notify() before).
 */
#include <linux/dma-buf.h>

bool fgds_probe(struct dma_buf *dmabuf, struct dma_buf_attachment *attach);
bool fgds_probe(struct dma_buf *dmabuf, struct dma_buf_attachment *attach)
{
	dma_buf_invalidate_mappings(dmabuf);
	return dma_buf_attach_revocable(attach);
}

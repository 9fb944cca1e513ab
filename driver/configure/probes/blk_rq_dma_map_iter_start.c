// SPDX-License-Identifier: GPL-2.0
/*
 * blk_rq_dma_map_iter_start() (6.17): the block layer maps a request for DMA
 * the way its first segment needs (P2P bus address or not) for all of it.
 */
#include <linux/blk-mq-dma.h>

bool fgds_probe(struct request *rq, struct device *dev,
		struct dma_iova_state *state, struct blk_dma_iter *iter);
bool fgds_probe(struct request *rq, struct device *dev,
		struct dma_iova_state *state, struct blk_dma_iter *iter)
{
	return blk_rq_dma_map_iter_start(rq, dev, state, iter);
}

// SPDX-License-Identifier: GPL-2.0
/*
 * P2PDMA providers without struct pages and the dma-buf MMIO helpers
 * (<linux/dma-buf-mapping.h>), with vfio-pci's dma-buf export (6.19).
 */
#include <linux/dma-buf-mapping.h>
#include <linux/pci-p2pdma.h>

struct p2pdma_provider *fgds_probe(struct pci_dev *pdev);
struct p2pdma_provider *fgds_probe(struct pci_dev *pdev)
{
	return pcim_p2pdma_provider(pdev, 0);
}

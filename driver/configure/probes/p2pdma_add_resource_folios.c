// SPDX-License-Identifier: GPL-2.0
/*
 * pci_p2pdma_add_resource_folios(): P2PDMA pages as large folios, kept out
 * of the P2PDMA allocator (kernel-patches/p2pdma-folios; not
 * upstream).
 */
#include <linux/pci-p2pdma.h>

int fgds_probe(struct pci_dev *pdev);
int fgds_probe(struct pci_dev *pdev)
{
	return pci_p2pdma_add_resource_folios(pdev, 0, 0, 0, 9);
}

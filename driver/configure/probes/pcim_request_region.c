// SPDX-License-Identifier: GPL-2.0
/* pcim_request_region() is public (6.12). */
#include <linux/pci.h>

int fgds_probe(struct pci_dev *pdev);
int fgds_probe(struct pci_dev *pdev)
{
	return pcim_request_region(pdev, 0, "fgds");
}

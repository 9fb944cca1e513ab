/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Peer-to-peer reachability between two PCI devices, for kernels built
 * without CONFIG_PCI_P2PDMA, where pci_p2pdma_distance() always fails. The
 * rules are those of the kernel's own check (calc_map_type_and_dist() in
 * drivers/pci/p2pdma.c): two devices below a common upstream bridge with no
 * ACS redirection on the path reach each other at their bus addresses; any
 * other path goes through the host bridge, which only some host bridges
 * route (an AMD Zen CPU, or a root complex on the kernel's allow-list).
 * Shared by fgds (which vouches for GENERIC pages) and the rig's vgpu.
 */
#ifndef _FGDS_P2P_H
#define _FGDS_P2P_H

#include <linux/pci.h>
#include <linux/processor.h>

static inline bool fgds_p2p_acs_redirects(struct pci_dev *pdev)
{
	u16 ctrl;

	if (!pdev->acs_cap)
		return false;
	pci_read_config_word(pdev, pdev->acs_cap + PCI_ACS_CTRL, &ctrl);
	return ctrl & (PCI_ACS_RR | PCI_ACS_CR | PCI_ACS_EC);
}

/*
 * True if @a and @b sit below a common upstream bridge (a PCIe switch, or
 * the same device) with no ACS redirection on the path between them. The
 * caller holds references on both, which hold their upstream bridges.
 */
static inline bool fgds_p2p_switch_local(struct pci_dev *a, struct pci_dev *b)
{
	struct pci_dev *up, *down;
	bool redirect = false;

	for (up = a; up; up = pci_upstream_bridge(up)) {
		redirect |= fgds_p2p_acs_redirects(up);
		for (down = b; down; down = pci_upstream_bridge(down))
			if (up == down)
				goto common;
	}
	return false;

common:
	for (down = b; down != up; down = pci_upstream_bridge(down))
		redirect |= fgds_p2p_acs_redirects(down);
	return !redirect;
}

/*
 * The device that identifies a host bridge: the first device on its root bus
 * if it is 00.0 or a root port (the kernel's pci_host_bridge_dev()).
 */
static inline struct pci_dev *fgds_p2p_root(struct pci_host_bridge *host)
{
	struct pci_dev *root = list_first_entry_or_null(&host->bus->devices,
							struct pci_dev,
							bus_list);

	if (root && (root->devfn == PCI_DEVFN(0, 0) ||
		     pci_pcie_type(root) == PCI_EXP_TYPE_ROOT_PORT))
		return root;
	return NULL;
}

/*
 * True if @host is a root complex known to route peer-to-peer traffic between
 * its root ports (the kernel's pci_p2pdma_whitelist[]); @same: both devices
 * are below it.
 */
static inline bool fgds_p2p_host_bridge_listed(struct pci_host_bridge *host,
					       bool same)
{
	static const struct {
		unsigned short vendor;
		unsigned short device;
		bool same_host_bridge;
	} listed[] = {
		/* Intel Xeon E5/Core i7 */
		{ PCI_VENDOR_ID_INTEL, 0x3c00, true },
		{ PCI_VENDOR_ID_INTEL, 0x3c01, true },
		/* Intel Xeon E7 v3/Xeon E5 v3/Core i7 */
		{ PCI_VENDOR_ID_INTEL, 0x2f00, true },
		{ PCI_VENDOR_ID_INTEL, 0x2f01, true },
		/* Intel Skylake-E */
		{ PCI_VENDOR_ID_INTEL, 0x2030, false },
		{ PCI_VENDOR_ID_INTEL, 0x2031, false },
		{ PCI_VENDOR_ID_INTEL, 0x2032, false },
		{ PCI_VENDOR_ID_INTEL, 0x2033, false },
		{ PCI_VENDOR_ID_INTEL, 0x2020, false },
		{ PCI_VENDOR_ID_INTEL, 0x09a2, false },
	};
	struct pci_dev *root = fgds_p2p_root(host);
	unsigned int i;

	if (!root)
		return false;
	for (i = 0; i < ARRAY_SIZE(listed); i++) {
		if (root->vendor == listed[i].vendor &&
		    root->device == listed[i].device)
			return same || !listed[i].same_host_bridge;
	}
	return false;
}

/* True if traffic between @a and @b may go through their host bridge(s). */
static inline bool fgds_p2p_host_bridge_ok(struct pci_dev *a, struct pci_dev *b)
{
	struct pci_host_bridge *ha = pci_find_host_bridge(a->bus);
	struct pci_host_bridge *hb = pci_find_host_bridge(b->bus);

#ifdef CONFIG_X86
	/* Any AMD CPU of family Zen or newer routes it. */
	if (boot_cpu_data.x86_vendor == X86_VENDOR_AMD &&
	    boot_cpu_data.x86 >= 0x17)
		return true;
#endif
	if (ha == hb)
		return fgds_p2p_host_bridge_listed(ha, true);
	return fgds_p2p_host_bridge_listed(ha, false) &&
	       fgds_p2p_host_bridge_listed(hb, false);
}

#endif /* _FGDS_P2P_H */

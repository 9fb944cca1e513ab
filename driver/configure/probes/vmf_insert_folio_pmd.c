// SPDX-License-Identifier: GPL-2.0
/*
 * vmf_insert_folio_pmd() and vmf_insert_page_mkwrite(): a PMD of a
 * ZONE_DEVICE folio is a normal huge PMD that GUP pins in one step; before,
 * only devmap PMDs, pinned page by page.
 */
#include <linux/mm.h>

vm_fault_t fgds_probe(struct vm_fault *vmf, struct folio *folio,
		      struct page *page);
vm_fault_t fgds_probe(struct vm_fault *vmf, struct folio *folio,
		      struct page *page)
{
	if (vmf_insert_folio_pmd(vmf, folio, true) == VM_FAULT_NOPAGE)
		return VM_FAULT_NOPAGE;
	return vmf_insert_page_mkwrite(vmf, page, true);
}

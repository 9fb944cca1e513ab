// SPDX-License-Identifier: GPL-2.0
/*
 * The folio rmap functions (6.9) replaced page_add_file_rmap(), which wants a
 * compound folio with a ->mapping locked (6.1).
 */
#include <linux/rmap.h>

void fgds_probe(struct folio *folio, struct page *page,
		struct vm_area_struct *vma);
void fgds_probe(struct folio *folio, struct page *page,
		struct vm_area_struct *vma)
{
	folio_add_file_rmap_ptes(folio, page, 1, vma);
}

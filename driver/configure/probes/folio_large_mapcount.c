// SPDX-License-Identifier: GPL-2.0
/*
 * A large folio's mapcount is kept in the folio (6.9), and folio_mapcount() is
 * an inline over it, usable from a module; before, folio_mapcount() was not
 * exported.
 */
#include <linux/mm.h>

int fgds_probe(struct folio *folio);
int fgds_probe(struct folio *folio)
{
	return folio_large_mapcount(folio) + folio_mapcount(folio);
}

// SPDX-License-Identifier: GPL-2.0
/* vm_flags are changed through vm_flags_set()/vm_flags_clear() (6.3). */
#include <linux/mm.h>

void fgds_probe(struct vm_area_struct *vma);
void fgds_probe(struct vm_area_struct *vma)
{
	vm_flags_set(vma, VM_IO);
	vm_flags_clear(vma, VM_IO);
}

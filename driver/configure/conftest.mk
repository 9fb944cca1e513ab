# SPDX-License-Identifier: GPL-2.0
#
# Included by a module's Kbuild: generates fgds_config.h in the module's build
# directory from the compile probes of driver/configure/probes/ (conftest.sh),
# with the flags Kbuild compiles module objects with. fgds_compat.h decides
# every difference the probes can see by its FGDS_HAVE_* macros. The module's
# objects must depend on $(obj)/fgds_config.h.

fgds-configure := $(src)/../configure

quiet_cmd_fgds_config = CONFTEST $@
      cmd_fgds_config = $(CONFIG_SHELL) $(fgds-configure)/conftest.sh $@ \
	$(fgds-configure)/probes $(CC) $(NOSTDINC_FLAGS) $(LINUXINCLUDE) \
	$(KBUILD_CPPFLAGS) $(KBUILD_CFLAGS) $(KBUILD_CFLAGS_MODULE) -DMODULE \
	-DKBUILD_BASENAME='"fgds_conftest"' -DKBUILD_MODNAME='"fgds_conftest"'

$(obj)/fgds_config.h: $(fgds-configure)/conftest.sh \
		      $(wildcard $(fgds-configure)/probes/*.c) FORCE
	$(call if_changed,fgds_config)

targets += fgds_config.h
ccflags-y += -I$(obj)

//! Issue 7 (g): unloading fgds while buffers are registered is refused, whoever holds them
//! (the registering process through its open node, a mapping that outlives the node's fd,
//! another process); once they are gone the unload is clean (no node, no class, every dma-buf
//! given back to the exporter, no splat) and fgds loads again and works.

#[path = "../fgds_common.rs"]
mod common;
#[path = "../fgds_fault_common.rs"]
mod fault;

use std::os::fd::AsFd;
use std::time::Duration;

use anyhow::{Context, ensure};
use common::{MIB, Map};
use fault::Child;
use fgds_tests::ktap::{self, Case, CaseResult};

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "unload_refused_while_registered",
            run: unload_refused_while_registered,
        },
        Case {
            name: "unload_clean_after_release_then_reload",
            run: unload_clean_after_release,
        },
    ])
}

fn unload_refused_while_registered() -> CaseResult {
    fault::require_idle()?;
    let len = 2 * MIB;
    // Another process registers a buffer of its own and keeps it.
    let mut child = Child::spawn(|parent| {
        let node = common::open_node()?;
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, common::PAGE)?;
        common::reg(&node, dmabuf.as_fd(), 0, common::PAGE).context("REG in the child")?;
        parent.ready("registered");
        parent.wait_released();
        Ok(())
    })?;
    let result = (|| -> anyhow::Result<()> {
        child.wait_ready(Duration::from_secs(20))?;

        let node = common::open_node()?;
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, len)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
        let map = Map::shared(&node, idx, len as usize)?;
        let nvme = common::nvme(false)?;
        common::pread_raw(&nvme, map.ptr, len as usize, 6 * MIB).context("pread")?;
        // The registration holds the dma-buf; the node's fd and the mapping hold fgds.
        drop(dmabuf);
        drop(vgpu);
        ensure!(
            fault::counters()? == (2, len + common::PAGE),
            "counters {:?}, want 2 buffers of {} bytes",
            fault::counters()?,
            len + common::PAGE
        );
        fault::expect_unload_refused("with a registered, mapped buffer and its node open")?;
        drop(node);
        fault::expect_unload_refused("with the node closed but the buffer still mapped")?;
        // The mapping still works after the refused unloads.
        common::pread_raw(&nvme, map.ptr, len as usize, 8 * MIB).context("pread after")?;
        common::check_nvme_pattern(8 * MIB, &fault::read_mapping(&map))?;
        drop(map);
        fault::wait_until(
            "our buffer to go once unmapped",
            Duration::from_secs(20),
            || Ok(fault::counters()? == (1, common::PAGE)),
        )?;
        fault::expect_unload_refused("with a buffer registered by another process")?;
        Ok(())
    })();
    child.release();
    let status = child.wait()?;
    result?;
    ensure!(status == 0, "the child ended with status {status}");
    fault::wait_counters_zero("after every holder is gone")?;
    ktap::pass()
}

fn unload_clean_after_release() -> CaseResult {
    fault::require_idle()?;
    // A registration made and released just before, so the unload also tears the provider
    // down (the first registration set it up).
    fault::data_check(4 * MIB, 2 * MIB)?;
    fault::wait_counters_zero("after the last buffer was released")?;
    fault::wait_vgpu_buffers_gone("before the unload")?;
    fault::host_log("fgds_fault_unload: unloading fgds")?;
    let unloaded = fault::unload_fgds();
    // Whatever happened, load it again so that the suite goes on.
    let loaded = if std::path::Path::new("/sys/module/fgds").exists() {
        Ok(())
    } else {
        fault::load_fgds_and_wait_node()
    };
    fault::host_log("fgds_fault_unload: fgds loaded again")?;
    unloaded?;
    loaded?;
    ensure!(
        common::sysfs("mode")? == "none",
        "a fresh node reads mode {:?}",
        common::sysfs("mode")?
    );
    ensure!(
        fault::counters()? == (0, 0),
        "fresh node counts {:?}",
        fault::counters()?
    );
    // The provider sets up again over the same BAR (the old pages are gone) and I/O works.
    fault::data_check(4 * MIB, 10 * MIB).context("after the reload")?;
    fault::wait_counters_zero("after the check")?;
    ktap::pass()
}

//! Issue 7 (g): unloading fgds while buffers are registered is refused, whoever holds them
//! (the registering process through its open node, a mapping that outlives the node's fd,
//! another process); once they are gone the unload is clean (no node, no class, every dma-buf
//! given back to the exporter, no splat) and fgds loads again and works.

use fgds_tests::common;
use fgds_tests::fault;

use std::os::fd::AsFd;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fault::Child;
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

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
        Case {
            name: "pages_parameter_checked",
            run: pages_parameter_checked,
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
    // down (opening the node set it up).
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

/// `pages=` takes auto, p2pdma or generic: anything else fails the load with EINVAL and a log
/// line naming the choices. `pages=p2pdma` on a kernel without CONFIG_PCI_P2PDMA loads, logs
/// when the node is opened a line that says how to load fgds instead, and refuses
/// registrations with EOPNOTSUPP (sysfs mode "refused"); on a kernel with it, the GPU gets
/// P2PDMA pages and reads land. fgds is loaded again with the init's parameters either way.
fn pages_parameter_checked() -> CaseResult {
    fault::require_idle()?;
    fault::wait_vgpu_buffers_gone("before the unload")?;
    fault::unload_fgds()?;
    let (_, params) = fault::fgds_module()?;
    let others = params
        .split_whitespace()
        .filter(|p| !p.starts_with("pages="))
        .collect::<Vec<_>>()
        .join(" ");
    let result = (|| -> anyhow::Result<()> {
        let mark = fgds_tests::guest::kernel_log_mark()?;
        match fault::load_fgds_with(&format!("{others} pages=huge"))? {
            Err(Errno::INVAL) => {}
            Ok(()) => bail!("fgds loaded with pages=huge"),
            Err(e) => bail!("loading fgds with pages=huge: {e}, want EINVAL"),
        }
        fault::expect_logged(
            &fgds_tests::guest::kernel_log_since(mark)?,
            "fgds: pages=huge: expected auto, p2pdma or generic",
        )?;

        fault::load_fgds_with(&format!("{others} pages=p2pdma"))?
            .context("loading fgds with pages=p2pdma")?;
        fault::wait_until("the fgds node", Duration::from_secs(10), || {
            Ok(common::node_path().is_ok())
        })?;
        let mark = fgds_tests::guest::kernel_log_mark()?;
        let node = common::open_node()?;
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, common::PAGE)?;
        let reg = common::reg(&node, dmabuf.as_fd(), 0, common::PAGE);
        if kernel_has_p2pdma()? {
            let idx = reg.context("REG with pages=p2pdma")?;
            // The exporter's own P2PDMA pages (vgpu mode p2pdma) take precedence.
            let mode = common::sysfs("mode")?;
            ensure!(
                mode == "p2pdma" || mode == "exporter-p2pdma",
                "pages=p2pdma, but mode reads {mode}"
            );
            common::unreg(&node, idx)?;
            fault::data_check(2 * MIB, 4 * MIB).context("reading with P2PDMA pages")?;
        } else {
            match reg {
                Err(Errno::OPNOTSUPP) => {}
                Ok(_) => bail!("REG with pages=p2pdma succeeded on a kernel without P2PDMA"),
                Err(e) => bail!("REG with pages=p2pdma: {e}, want EOPNOTSUPP"),
            }
            ensure!(
                common::sysfs("mode")? == "refused",
                "refused, but mode reads {}",
                common::sysfs("mode")?
            );
            fault::expect_logged(
                &fgds_tests::guest::kernel_log_since(mark)?,
                "fgds: pages=p2pdma, but the kernel has no CONFIG_PCI_P2PDMA; load fgds with pages=auto",
            )?;
        }
        drop((node, dmabuf, vgpu));
        fault::wait_counters_zero("after the pages=p2pdma check")?;
        fault::wait_vgpu_buffers_gone("before the unload")?;
        fault::unload_fgds()?;
        if kernel_has_p2pdma()? {
            // fgds's P2PDMA resource can stay on the GPU until the exporter's driver unbinds
            // (docs/driver.md, Devres): the next fgds would take those pages for the
            // exporter's (mode exporter-p2pdma) and the rest of the suite would not run in the
            // configured mode. A rebind gives the GPU back as the init left it.
            rebind_vgpu()?;
        }
        Ok(())
    })();
    // Whatever happened, load fgds as the init did so that the suite goes on.
    if !std::path::Path::new("/sys/module/fgds").exists() {
        fault::load_fgds_and_wait_node()?;
    }
    result?;
    fault::data_check(2 * MIB, 6 * MIB).context("after loading fgds as the init did")?;
    fault::wait_counters_zero("after the check")?;
    let (mode, expected) = (common::sysfs("mode")?, fgds_tests::guest::expected_mode()?);
    ensure!(
        mode == expected,
        "fgds loaded again as the init did shows mode {mode}; the run's configuration implies \
         {expected}"
    );
    ktap::pass()
}

/// Unbinds vgpu from the GPU and binds it again (fgds is not loaded: nothing holds the GPU).
fn rebind_vgpu() -> anyhow::Result<()> {
    let bdf = common::vgpu_bdf()?;
    let driver = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bdf}/driver"))
        .context("vgpu driver link")?;
    std::fs::write(driver.join("unbind"), &bdf).context("unbind vgpu")?;
    std::fs::write(driver.join("bind"), &bdf).context("bind vgpu")?;
    fault::wait_until("vgpu after its rebind", Duration::from_secs(20), || {
        Ok(common::vgpu_name().is_ok())
    })
    .map(drop)
}

/// Whether the kernel was built with CONFIG_PCI_P2PDMA (its exported entry point exists).
fn kernel_has_p2pdma() -> anyhow::Result<bool> {
    fgds_tests::guest::kernel_has_symbol("pci_p2pdma_add_resource")
}

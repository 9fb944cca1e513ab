//! The expected outcome of a run, by its configuration: the fgds mode the configuration implies
//! ([`MODES`]) and the cases of the default suite that skip there, and why ([`SKIPS`]). The
//! one place to look when a run fails with "unexpected skip", "the table is stale" or a wrong
//! mode.
//!
//! # A configuration
//!
//! [`RunConfig`]: the kernel (its series and its `.config`), fgds's `pages=` parameter, vgpu's
//! mode, whether a translating vIOMMU is there (`--iommu`), and the exporter of the GPU memory
//! (`--exporter`: the rig's vgpu, or vfio-pci's BAR dma-bufs; [`Exporter`]).
//!
//! # Reading the tables
//!
//! Both are lists of rows with conditions ([`When`]); a row applies to a run when all of its
//! conditions hold.
//! - [`MODES`]: the first row that applies gives the mode, which the guest's sysfs `mode` must
//!   read (`<run>::mode`, and the cases that use the mode, get it from here through the guest's
//!   `FGDS_EXPECTED_MODE`, never from the driver).
//! - [`SKIPS`]: every row that applies names cases (`program::case`, `program::*` for all of a
//!   program's cases, or a bare `program` for a program that skips as a whole) that skip in that
//!   configuration, with the start of the reason they give: the errno's name where the guest
//!   skips because the kernel answered with one (`EREMOTEIO`), else the start of the message.
//!
//! Every case of the default suite (tests/suite.txt) and the rig's own results (`setup`,
//! `kmemleak`) get their verdict from it:
//! - a skip that a row names, with a reason that starts as the row says, is a skip (`ignored`,
//!   counted per configuration in the summary);
//! - any other skip fails: something refused or missing that no row expects;
//! - a pass that a row names as skipping fails: the table is stale.
//!
//! Programs given with `--exec`, and programs run instead of the suite (bench), are not in the
//! table: their skips stay skips.
//!
//! # Editing
//!
//! When a change makes a case skip somewhere on purpose, or stop skipping, change its row in the
//! same commit, and say why in the row. A row names the errno the guest got, never "any error".
//! `cargo test -p xtask` checks that every row names cases that exist.

use std::collections::BTreeSet;

use fgds_vm_images::kernel::{Kernel, KernelSpec};

use crate::report::{Outcome, Verdict};

/// fgds's page provider as sysfs `mode` shows it once a buffer was registered (docs/driver.md,
/// Page providers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Generic,
    P2pdma,
    ExporterP2pdma,
    /// REG_BUFFER fails with EOPNOTSUPP: fgds cannot map this GPU's memory safely here.
    Refused,
}

impl Mode {
    pub fn sysfs(self) -> &'static str {
        match self {
            Mode::Generic => "generic",
            Mode::P2pdma => "p2pdma",
            Mode::ExporterP2pdma => "exporter-p2pdma",
            Mode::Refused => "refused",
        }
    }
}

/// fgds's `pages=` parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    Auto,
    P2pdma,
    Generic,
}

/// vgpu's `mode=` parameter: its BAR as plain memory (like VRAM under amdgpu or NVIDIA's
/// driver), plain memory with a P2PDMA provider of its own (as vfio-pci has on 7.x), or with
/// P2PDMA pages of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VgpuMode {
    Plain,
    Provider,
    P2pdma,
}

/// Who exports the GPU memory the tests register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exporter {
    /// The rig's test exporter (driver/vgpu).
    Vgpu,
    /// vfio-pci (`VFIO_DEVICE_FEATURE_DMA_BUF`, Linux 6.19 and later): the GPU is bound to
    /// vfio-pci instead of vgpu, and vgpu is not loaded.
    Vfio,
}

impl Exporter {
    /// The name `--exporter` takes and the guest sees in `FGDS_EXPORTER`.
    pub fn name(self) -> &'static str {
        match self {
            Exporter::Vgpu => "vgpu",
            Exporter::Vfio => "vfio",
        }
    }
}

/// The values of test-vm's `--exporter`.
pub const EXPORTERS: [&str; 2] = ["vgpu", "vfio"];

/// What a run is, as far as its expected outcome goes.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The kernel as given, e.g. `debian:6.12`.
    pub kernel: String,
    /// Its series, e.g. (6, 12), from `uname -r`.
    pub series: (u32, u32),
    /// The options its `.config` sets to y or m (`CONFIG_...`).
    pub configs: BTreeSet<String>,
    pub pages: Pages,
    pub vgpu_mode: VgpuMode,
    pub iommu: bool,
    pub exporter: Exporter,
    /// GPUs in the machine (`--gpus`).
    pub gpus: u8,
}

/// A condition of a row.
#[derive(Debug, Clone, Copy)]
pub enum When {
    /// The kernel's series is before X.Y.
    SeriesBelow(u32, u32),
    /// The kernel's config has this option (y or m).
    Has(&'static str),
    /// The kernel's config lacks at least one of these options.
    LacksAny(&'static [&'static str]),
    Pages(Pages),
    VgpuMode(VgpuMode),
    Iommu(bool),
    Exporter(Exporter),
    /// The machine has fewer GPUs than this.
    GpusBelow(u8),
    /// fgds's mode, as [`MODES`] gives it, is one of these (not for rows of [`MODES`]).
    Mode(&'static [Mode]),
    /// The kernel is not a `build:` kernel with this change of kernel-patches/.
    Unpatched(&'static str),
    /// The kernel is a `build:` kernel with this change of kernel-patches/.
    Patched(&'static str),
}

/// A row of [`MODES`].
pub struct ModeRow {
    pub when: &'static [When],
    pub mode: Mode,
}

/// The mode each configuration implies: the first row whose conditions hold. `pages=auto` gives
/// P2PDMA pages wherever the kernel has CONFIG_PCI_P2PDMA, GENERIC pages elsewhere; GENERIC pages
/// are allowed in the rig unless a vIOMMU translates DMA (the devices share a PCIe switch, which
/// fgds's own topology walk, or the kernel's P2P check where it has one, accepts); see
/// docs/driver.md, Page providers. vfio-pci registers no P2PDMA pages for the BAR it exports
/// (its dma-bufs carry addresses only) but keeps P2PDMA state of its own, as vgpu's `provider`
/// mode does: fgds adds no pages to another driver's P2PDMA state, so it makes GENERIC pages of
/// its own where they are safe (no vIOMMU, and every NVMe controller behind the GPU's switch:
/// `--gpus 2` puts a drive behind each GPU's own switch, out of the other's reach) and refuses
/// otherwise (always for vfio-pci, which needs the vIOMMU).
pub const MODES: &[ModeRow] = &[
    // The exporter registered P2PDMA pages for its BAR: fgds reuses them, whatever `pages=`.
    ModeRow {
        when: &[
            When::Exporter(Exporter::Vgpu),
            When::VgpuMode(VgpuMode::P2pdma),
        ],
        mode: Mode::ExporterP2pdma,
    },
    ModeRow {
        when: &[
            When::Pages(Pages::Generic),
            When::Iommu(false),
            When::GpusBelow(2),
        ],
        mode: Mode::Generic,
    },
    ModeRow {
        when: &[When::Pages(Pages::Generic)],
        mode: Mode::Refused,
    },
    ModeRow {
        when: &[When::Exporter(Exporter::Vfio)],
        mode: Mode::Refused,
    },
    ModeRow {
        when: &[
            When::VgpuMode(VgpuMode::Provider),
            When::Pages(Pages::P2pdma),
        ],
        mode: Mode::Refused,
    },
    ModeRow {
        when: &[
            When::VgpuMode(VgpuMode::Provider),
            When::Iommu(false),
            When::GpusBelow(2),
        ],
        mode: Mode::Generic,
    },
    ModeRow {
        when: &[When::VgpuMode(VgpuMode::Provider)],
        mode: Mode::Refused,
    },
    ModeRow {
        when: &[When::Pages(Pages::P2pdma), When::Has("CONFIG_PCI_P2PDMA")],
        mode: Mode::P2pdma,
    },
    ModeRow {
        when: &[When::Pages(Pages::P2pdma)],
        mode: Mode::Refused,
    },
    ModeRow {
        when: &[When::Pages(Pages::Auto), When::Has("CONFIG_PCI_P2PDMA")],
        mode: Mode::P2pdma,
    },
    ModeRow {
        when: &[
            When::Pages(Pages::Auto),
            When::Iommu(false),
            When::GpusBelow(2),
        ],
        mode: Mode::Generic,
    },
    ModeRow {
        when: &[When::Pages(Pages::Auto)],
        mode: Mode::Refused,
    },
];

/// A row of [`SKIPS`].
pub struct Skip {
    /// `program::case`, `program::*` (every case of the program) or `program` (the program
    /// skips as a whole).
    pub cases: &'static [&'static str],
    pub when: &'static [When],
    /// How the skip reason starts: an errno's name, or the start of the message.
    pub reason: &'static str,
    /// Why they skip there.
    pub why: &'static str,
}

/// The cases about huge PMD mappings of GPU memory.
const PMD_CASES: &[&str] = &[
    "fgds_revoke::no_pmd_in_a_mixedmap_mapping_of_two_extents",
    "fgds_revoke::no_pmd_after_mremap_to_an_aligned_address",
];

/// The kernel options fgds_fault_inject needs.
const FAULT_INJECTION: &[&str] = &[
    "CONFIG_FAULT_INJECTION_DEBUG_FS",
    "CONFIG_FAILSLAB",
    "CONFIG_FAIL_PAGE_ALLOC",
    "CONFIG_FAIL_MAKE_REQUEST",
];

/// The programs of the suite that need vgpu (its allocator, its sysfs, its node, or the GPU
/// bound to it): with `--exporter vfio` they skip as a whole.
const VGPU_PROGRAMS: &[&str] = &[
    "fgds_badinput",
    "fgds_data",
    "fgds_lifetime",
    "fgds_host",
    "rfc_client",
    "fgds_hotplug",
    "fgds_fault_unload",
    "fgds_fault_kill",
    "fgds_revoke",
    "fgds_io",
    "fgds_gate",
    "fgds_fault_drive",
    "fgds_fault_nvme_unplug",
    "fgds_fault_gpu_unplug",
    "fgds_fault_inject",
    "fgds_cli",
    "fgds_crate",
    "fgds_fio",
    "fgds_python",
    "fgds_owner",
    "vgpu_exporter",
    "smoke::vgpu_mmap_reaches_backing_file",
    "rig_control::gpu_unplug_and_replug",
    "rig_control::gpu_check_sees_memory_as_it_is_now",
];

/// The skips each configuration expects (see the module's documentation).
pub const SKIPS: &[Skip] = &[
    Skip {
        cases: VGPU_PROGRAMS,
        when: &[When::Exporter(Exporter::Vfio)],
        reason: "the GPU is bound to vfio-pci",
        why: "these programs allocate GPU memory from vgpu (or unplug, unbind and check the GPU \
              through it); with --exporter vfio the GPU is vfio-pci's and vgpu is not loaded: \
              fgds_vfio checks that fgds refuses vfio-pci's dma-bufs and leaves its P2PDMA \
              state alone, uring_dmabuf runs data and revocation through the kernel's own \
              dma-buf I/O on the comparator kernel",
    },
    Skip {
        cases: &["fgds_vfio"],
        when: &[When::Exporter(Exporter::Vgpu)],
        reason: "the GPU is not bound to vfio-pci",
        why: "fgds_vfio imports vfio-pci's BAR dma-bufs: it runs with --iommu --exporter vfio \
              (cargo xtask matrix has those runs on debian:7.2 and debian:7.3)",
    },
    Skip {
        cases: &["uring_dmabuf"],
        when: &[When::Unpatched("io-uring-dmabuf")],
        reason: "this kernel has no dma-buf registered buffers",
        why: "the kernel's own dma-buf registered buffers come with Begunkov's io_uring dma-buf \
              series, in no released kernel: the rig builds it as build:7.2+io-uring-dmabuf",
    },
    Skip {
        cases: &["fgds_owner::foreign_p2pdma_state_gets_no_pages"],
        when: &[When::SeriesBelow(6, 19)],
        reason: "no P2PDMA providers",
        why: "vgpu's provider mode (P2PDMA state without pages, as vfio-pci keeps) needs \
              pcim_p2pdma_provider(), Linux 6.19 and later",
    },
    Skip {
        cases: &[
            "fgds_owner::foreign_p2pdma_state_gets_no_pages",
            "fgds_owner::exporter_p2pdma_pages_unchanged",
        ],
        when: &[When::LacksAny(&["CONFIG_PCI_P2PDMA"])],
        reason: "no",
        why: "P2PDMA state, a provider or pages, needs CONFIG_PCI_P2PDMA (off in Debian's 6.1 \
              and 6.12)",
    },
    Skip {
        cases: &["fgds_owner::foreign_p2pdma_state_gets_no_pages"],
        when: &[When::Iommu(true)],
        reason: "the GPU's DMA is translated",
        why: "beside another driver's P2PDMA state fgds makes only GENERIC pages, which it \
              refuses under a translating IOMMU (fgds_vfio checks that refusal)",
    },
    Skip {
        cases: &["fgds_python"],
        when: &[When::Patched("io-uring-dmabuf")],
        reason: "this kernel has its own dma-buf registered buffers",
        why: "the Python cases assert fgds's path for dma-bufs, which the kernel's own path \
              takes first on the comparator kernel; uring_dmabuf and fgds_crate check that path",
    },
    Skip {
        cases: &["fgds_fio"],
        when: &[When::LacksAny(&["CONFIG_SYSVIPC"])],
        reason: "the kernel has no SysV IPC",
        why: "fio keeps its job table in SysV shared memory; the build: kernels leave \
              CONFIG_SYSVIPC out (configs/base.config), Debian's have it",
    },
    Skip {
        cases: &["fgds_data::xfs_file_both_directions"],
        when: &[When::LacksAny(&["CONFIG_XFS_FS"])],
        reason: "the kernel has no xfs",
        why: "the build: kernels leave file systems other than ext4 out (configs/); Debian's \
              kernels have xfs and btrfs as modules",
    },
    Skip {
        cases: &["fgds_data::btrfs_file_both_directions"],
        when: &[When::LacksAny(&["CONFIG_BTRFS_FS"])],
        reason: "the kernel has no btrfs",
        why: "the build: kernels leave file systems other than ext4 out (configs/); Debian's \
              kernels have xfs and btrfs as modules",
    },
    Skip {
        cases: &["kmemleak"],
        when: &[When::LacksAny(&["CONFIG_DEBUG_KMEMLEAK"])],
        reason: "the kernel has no kmemleak",
        why: "only the build:X.Y+debug kernels have kmemleak",
    },
    Skip {
        cases: &["fgds_badinput::reg_udmabuf_einval"],
        when: &[When::LacksAny(&["CONFIG_UDMABUF"])],
        reason: "no /dev/udmabuf",
        why: "the kernel has no udmabuf to make a dma-buf of system RAM (Debian 6.1)",
    },
    Skip {
        cases: &["fgds_python::fallback_system_ram_dmabuf"],
        when: &[When::LacksAny(&["CONFIG_UDMABUF"])],
        reason: "no /dev/udmabuf",
        why: "the fallback for a dma-buf fgds cannot register (system RAM) is tested with a \
              udmabuf, which Debian 6.1 lacks",
    },
    Skip {
        cases: &["fgds_badinput::unsafe_setup_refused"],
        when: &[When::Iommu(false)],
        reason: "the GPU's DMA is not translated by an IOMMU",
        why: "the case is about a translating IOMMU: it runs with --iommu",
    },
    Skip {
        cases: &["fgds_io::lookup_racing_unreg_takes_no_freed_registration"],
        when: &[When::LacksAny(&["CONFIG_FAULT_INJECTION"])],
        reason: "no lookup_window_us",
        why: "fgds's race windows (module parameters) exist only on kernels with fault \
              injection, the build:X.Y+debug ones: without one the race is left to chance",
    },
    Skip {
        cases: &["fgds_fault_inject::*"],
        when: &[When::LacksAny(FAULT_INJECTION)],
        reason: "no fault-injection debugfs",
        why: "only the build:X.Y+debug kernels have failslab, fail_page_alloc and \
              fail_make_request",
    },
    Skip {
        cases: PMD_CASES,
        when: &[When::Mode(&[Mode::ExporterP2pdma])],
        reason: "no PMD mappings with",
        why: "the exporter's P2PDMA pages are order-0 folios: fgds maps them with PTEs only",
    },
    Skip {
        cases: &["fgds_io::two_runs_both_directions"],
        when: &[When::Mode(&[Mode::ExporterP2pdma])],
        reason: "vgpu in mode p2pdma has no buffers of two runs",
        why: "vgpu makes a buffer of two runs of BAR2 (VGPU_ALLOC_SKEW) only from its own pool \
              (mode=plain); in p2pdma mode its buffers come from the P2PDMA pool, one run each",
    },
    Skip {
        cases: &["fgds_gate::zram_refused"],
        when: &[When::LacksAny(&["CONFIG_ZRAM"])],
        reason: "the kernel has no zram",
        why: "the build: kernels leave zram out (it drags in a compressor and zsmalloc); loop, \
              brd and dm-crypt are refused there the same way",
    },
    Skip {
        cases: &[
            "fgds_fio::example_job_file_verifies",
            "fgds_fio::write_then_verify_depth_8",
            "fgds_fio::randwrite_verify_4k_depth_32",
            "fgds_fio::ext4_file_verify",
        ],
        when: &[When::SeriesBelow(6, 12)],
        reason: "EOPNOTSUPP: this kernel's io_uring loses the byte count",
        why: "the fgds engine's default path is fgds's io_uring commands, offered from 6.12; \
              fgds_fio::ioctl_path_verify runs the engine with fgds_ioctl=1 there",
    },
    Skip {
        cases: &["fgds_fio::tmpfs_file_fails_with_eremoteio"],
        when: &[When::SeriesBelow(6, 6)],
        reason: "this kernel's tmpfs takes no O_DIRECT",
        why: "tmpfs opens files O_DIRECT from Linux 6.6; fgds_gate checks the refusal of other \
              files fgds cannot reach on every kernel",
    },
    Skip {
        cases: &[
            "fgds_gpus::each_gpu_reads_its_own_drive_directly",
            "fgds_gpus::reads_across_switches_take_the_topology_path",
        ],
        when: &[When::GpusBelow(2)],
        reason: "one GPU in this machine",
        why: "two GPUs behind switches of their own need `--gpus 2`, a machine of its own (its \
              second switch's drive would make fgds refuse GENERIC pages for the first GPU); CI \
              boots it on debian:6.12 and debian:7.3 for fgds_gpus alone",
    },
    Skip {
        cases: &["fgds_gate::md_raid0_over_two_drives"],
        when: &[When::LacksAny(&["CONFIG_MD_RAID0"])],
        reason: "the kernel has no md RAID0",
        why: "the build: kernels leave md out; the Debian kernels have it as a module",
    },
    Skip {
        cases: &["fgds_gate::nvme_over_tcp_refused"],
        when: &[When::LacksAny(&[
            "CONFIG_NVME_TCP",
            "CONFIG_NVME_TARGET_TCP",
        ])],
        reason: "the kernel has no NVMe over TCP",
        why: "the build: kernels leave the NVMe target and fabrics out; the Debian kernels have \
              both as modules, and dm_crypt_refused checks the same refusal everywhere",
    },
    Skip {
        cases: &["fgds_gate::ram_and_gpu_alternating_in_one_batch"],
        when: &[When::LacksAny(&["CONFIG_TRACING"])],
        reason: "the kernel has no tracefs",
        why: "the case counts the block layer's merges in its trace events; the comparator \
              kernel is built without tracing (the debug kernels have it)",
    },
    Skip {
        cases: &["fgds_gate::ram_and_gpu_alternating_in_one_batch"],
        when: &[When::SeriesBelow(6, 12)],
        reason: "EOPNOTSUPP: this kernel's io_uring loses the byte count",
        why: "the batch mixes io_uring reads with fgds's commands, which 6.1 cannot carry",
    },
    Skip {
        cases: &[
            "fgds_io::uring_commands_many_in_flight",
            "fgds_io::held_command_never_lands_after_revocation",
            "fgds_io::crate_transfer_takes_the_commands",
            "fgds_io::command_completing_inside_its_issue_waits_for_it",
        ],
        when: &[When::SeriesBelow(6, 12)],
        reason: "EOPNOTSUPP: this kernel's io_uring loses the byte count",
        why: "6.1's io_uring takes a positive result of a driver's command for \"not completed\" \
              and never completes it: fgds offers FGDS_URING_CMD_READ/WRITE from 6.12 (the \
              ioctls everywhere)",
    },
    Skip {
        cases: PMD_CASES,
        when: &[
            When::Mode(&[Mode::P2pdma]),
            When::Unpatched("p2pdma-folios"),
        ],
        reason: "no PMD mappings with",
        why: "P2PDMA pages are order-0 folios (pci_p2pdma_add_resource() makes no others; the \
              kernel change p2pdma-folios does): fgds maps them with PTEs only",
    },
    Skip {
        cases: PMD_CASES,
        when: &[When::SeriesBelow(7, 0), When::Mode(&[Mode::Generic])],
        reason: "no PMD mappings on",
        why: "before 7.x fgds maps GENERIC folios with PTEs (a ZONE_DEVICE PMD is a devmap PMD, \
              which GUP pins page by page)",
    },
    Skip {
        cases: &[
            "fgds_badinput::reg_bad_arguments",
            "fgds_badinput::unreg_bad_arguments",
            "fgds_badinput::mmap_bad_arguments",
            "fgds_badinput::limit_buffers_per_file_emfile",
            "fgds_badinput::limit_bytes_per_gpu_enospc",
            "fgds_data::*",
            "fgds_lifetime::*",
            "fgds_host::*",
            "rfc_client::rfc_round_trip",
            "fgds_hotplug::*",
            "fgds_fault_unload::*",
            "fgds_fault_kill::*",
            "fgds_fault_drive::*",
            "fgds_fault_nvme_unplug::*",
            "fgds_fault_gpu_unplug::*",
            "fgds_fault_inject::*",
            "fgds_revoke::*",
            "fgds_io::*",
            "fgds_gate::*",
            "fgds_badinput::limit_memlock_enomem",
            "fgds_badinput::limit_bytes_per_user_enospc",
            "fgds_badinput::unprivileged_group_member_reads_and_is_limited",
            "fgds_owner::dma_device_is_the_importer",
            "fgds_owner::exporter_refusing_the_dma_device_is_eremoteio",
            "fgds_cli",
            "fgds_crate",
            "fgds_fio",
            "fgds_python",
        ],
        when: &[When::Mode(&[Mode::Refused])],
        reason: "EOPNOTSUPP",
        why: "fgds refuses the setup by design (fgds_badinput::unsafe_setup_refused checks \
              it), so nothing that needs a registration can run",
    },
];

/// A case that fails in a configuration because of a bug outside this project (in a third-party
/// kernel series the rig builds to compare against), written up where `bug` says. Its failure
/// is reported as a skip with that reason, never as a pass; a failure with another message
/// stays a failure, and a pass fails too (the bug was fixed: drop the row).
pub struct KnownBug {
    pub case: &'static str,
    pub when: &'static [When],
    /// What its failure message says: one of these.
    pub failures: &'static [&'static str],
    /// The bug, and where it is written up.
    pub bug: &'static str,
    /// It shows only in some runs (a race in the series): a pass is then a pass.
    pub intermittent: bool,
}

/// How uring_dmabuf's cases of the series' leaked map begin when an earlier case leaked one
/// (tests/src/bin/uring_dmabuf.rs): the leak is that case's, and this one cannot run.
const HELD_BY_AN_EARLIER_LEAK: &str = "an earlier case's leaked map holds a dma-buf";

/// The known bugs of the comparators (see [`KnownBug`]).
pub const KNOWN_BUGS: &[KnownBug] = &[
    KnownBug {
        case: "uring_dmabuf::clearing_o_direct_after_registration",
        when: &[When::Patched("io-uring-dmabuf")],
        failures: &[
            "v3 checks O_DIRECT only at registration",
            HELD_BY_AN_EARLIER_LEAK,
        ],
        bug: "known bug of Begunkov's io_uring dma-buf series v3 (10/10 checks O_DIRECT only \
              when the buffer is registered, and the dma-buf of such a read may never be \
              released; or it cannot start after an earlier case's leak; docs/upstream.md)",
        intermittent: false,
    },
    KnownBug {
        case: "uring_dmabuf::split_request_lets_the_dmabuf_go",
        when: &[When::Patched("io-uring-dmabuf")],
        failures: &["the NVMe driver still holds the dma-buf"],
        bug: "known bug of Begunkov's io_uring dma-buf series v3 (10/10 takes a map reference \
              at every issue of a request and drops one: a re-issued request keeps the \
              dma-buf for ever; seen in some runs only; docs/upstream.md)",
        intermittent: true,
    },
    KnownBug {
        case: "uring_dmabuf::nvme_unplug_during_reads",
        when: &[When::Patched("io-uring-dmabuf")],
        failures: &["let the dma-buf go", HELD_BY_AN_EARLIER_LEAK],
        bug: "known bug of Begunkov's io_uring dma-buf series v3 (the same leaked map reference \
              as split_request_lets_the_dmabuf_go, when reads in flight are re-issued as the \
              drive goes: the dma-buf is never released, io_dmabuf_token_release_work waits in \
              D state; 3 of 4 fresh-clone CI runs on 2026-12-05; or it cannot start after \
              split_request_lets_the_dmabuf_go leaked one; docs/upstream.md)",
        intermittent: true,
    },
    KnownBug {
        case: "uring_dmabuf::gpu_unplug_during_reads",
        when: &[When::Patched("io-uring-dmabuf")],
        failures: &[
            "the guest did not finish removing it",
            HELD_BY_AN_EARLIER_LEAK,
        ],
        bug: "known bug of Begunkov's io_uring dma-buf series v3 (after the leak of an \
              earlier case it cannot start: the GPU's removal would wait for the dma-buf for \
              ever, as it does when a request of this case leaks one; docs/upstream.md)",
        intermittent: true,
    },
    KnownBug {
        case: "vm",
        when: &[When::Patched("io-uring-dmabuf")],
        failures: &["the guest's power-off was stuck"],
        bug: "known bug of Begunkov's io_uring dma-buf series v3 (where gpu_unplug_during_reads \
              leaks a map, the GPU's removal waits for ever under its device lock, and the \
              power-off's device shutdown waits for that lock; docs/upstream.md)",
        intermittent: true,
    },
];

impl RunConfig {
    /// The configuration of a run of `kernel` with test-vm's options.
    pub fn new(
        kernel: &Kernel,
        pages: &str,
        vgpu_mode: &str,
        iommu: bool,
        exporter: &str,
    ) -> anyhow::Result<RunConfig> {
        let text = std::fs::read(&kernel.config).map_err(|err| {
            anyhow::format_err!(
                "cannot read the kernel's config {}: {err}",
                kernel.config.display()
            )
        })?;
        let configs: BTreeSet<String> = String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|l| {
                let (option, value) = l.split_once('=')?;
                matches!(value, "y" | "m").then(|| option.to_owned())
            })
            .collect();
        Ok(RunConfig {
            kernel: kernel.spec.clone(),
            series: series(&kernel.release)?,
            pages: match pages {
                "auto" => Pages::Auto,
                "p2pdma" => Pages::P2pdma,
                "generic" => Pages::Generic,
                other => anyhow::bail!("fgds pages={other}: use auto, p2pdma or generic"),
            },
            vgpu_mode: match vgpu_mode {
                "plain" => VgpuMode::Plain,
                "provider" => VgpuMode::Provider,
                "p2pdma" => VgpuMode::P2pdma,
                other => anyhow::bail!("--vgpu-mode {other}: use plain, provider or p2pdma"),
            },
            configs,
            iommu,
            exporter: match exporter {
                "vgpu" => Exporter::Vgpu,
                "vfio" => Exporter::Vfio,
                other => anyhow::bail!("--exporter {other}: use vgpu or vfio"),
            },
            gpus: 1,
        })
    }

    /// One line for a person: `debian:6.12 pages=auto vgpu=plain iommu=off exporter=vgpu`.
    pub fn describe(&self) -> String {
        format!(
            "{} pages={} vgpu={} iommu={} exporter={}",
            self.kernel,
            format!("{:?}", self.pages).to_lowercase(),
            format!("{:?}", self.vgpu_mode).to_lowercase(),
            if self.iommu { "on" } else { "off" },
            format!("{:?}", self.exporter).to_lowercase(),
        )
    }

    fn holds(&self, when: &When) -> bool {
        match *when {
            When::SeriesBelow(major, minor) => self.series < (major, minor),
            When::Has(option) => self.configs.contains(option),
            When::LacksAny(options) => options.iter().any(|o| !self.configs.contains(*o)),
            When::Pages(pages) => self.pages == pages,
            When::VgpuMode(mode) => self.vgpu_mode == mode,
            When::Iommu(on) => self.iommu == on,
            When::GpusBelow(n) => self.gpus < n,
            When::Exporter(exporter) => self.exporter == exporter,
            When::Mode(modes) => mode(self).is_ok_and(|m| modes.contains(&m)),
            When::Unpatched(name) => !self.holds(&When::Patched(name)),
            When::Patched(name) => matches!(
                self.kernel.parse::<KernelSpec>(),
                Ok(KernelSpec::Build { patches, .. }) if patches.iter().any(|p| p == name)
            ),
        }
    }

    fn all(&self, when: &[When]) -> bool {
        when.iter().all(|w| self.holds(w))
    }
}

/// `6.12.118+deb12-amd64` -> (6, 12).
fn series(release: &str) -> anyhow::Result<(u32, u32)> {
    let mut parts = release.split(['.', '-', '+']);
    let mut number = || parts.next().and_then(|p| p.parse().ok());
    match (number(), number()) {
        (Some(major), Some(minor)) => Ok((major, minor)),
        _ => anyhow::bail!("kernel release {release:?} does not start with a series like 6.12"),
    }
}

/// The mode `config` implies ([`MODES`]); an error for a configuration the rig cannot run.
pub fn mode(config: &RunConfig) -> anyhow::Result<Mode> {
    if config.vgpu_mode == VgpuMode::P2pdma && !config.configs.contains("CONFIG_PCI_P2PDMA") {
        anyhow::bail!(
            "vgpu mode=p2pdma needs a kernel with CONFIG_PCI_P2PDMA, which {} lacks: use \
             --vgpu-mode plain or a 7.x or build: kernel",
            config.kernel
        );
    }
    if config.vgpu_mode == VgpuMode::Provider
        && (config.series < (6, 19) || !config.configs.contains("CONFIG_PCI_P2PDMA"))
    {
        anyhow::bail!(
            "vgpu mode=provider needs P2PDMA providers (Linux 6.19 and later with \
             CONFIG_PCI_P2PDMA), which {} lacks: use --vgpu-mode plain or a 7.x kernel",
            config.kernel
        );
    }
    if config.exporter == Exporter::Vfio {
        vfio_runnable(config)?;
    }
    MODES
        .iter()
        .find(|row| config.all(row.when))
        .map(|row| row.mode)
        .ok_or_else(|| {
            anyhow::format_err!(
                "no row of xtask/src/expected.rs MODES matches {}",
                config.describe()
            )
        })
}

/// Why `--exporter vfio` cannot run in `config`, if it cannot.
fn vfio_runnable(config: &RunConfig) -> anyhow::Result<()> {
    if !config.configs.contains("CONFIG_VFIO_PCI_DMABUF") {
        anyhow::bail!(
            "--exporter vfio needs a kernel with CONFIG_VFIO_PCI_DMABUF (vfio-pci's BAR \
             dma-bufs, Linux 6.19 and later), which {} lacks: use debian:7.2 or debian:7.3",
            config.kernel
        );
    }
    if !config.iommu {
        anyhow::bail!(
            "--exporter vfio needs the translating vIOMMU (--iommu): vfio-pci serves only \
             devices in an IOMMU group, through a type1 container (Debian's kernels have no \
             CONFIG_VFIO_NOIOMMU, and the rig does not use vfio's no-IOMMU mode)"
        );
    }
    if config.vgpu_mode != VgpuMode::Plain {
        anyhow::bail!("--vgpu-mode has no meaning with --exporter vfio (vgpu is not loaded)");
    }
    Ok(())
}

/// Whether `key` (`program::case` or `program`) is one of `pattern`'s cases.
fn names(pattern: &str, key: &str) -> bool {
    match pattern.strip_suffix("::*") {
        Some(program) => key
            .strip_prefix(program)
            .is_some_and(|rest| rest.starts_with("::")),
        None => pattern == key,
    }
}

/// Applies [`SKIPS`] to a run's verdicts. `label` prefixes every name (`debian-6.12`);
/// `covered` names the programs the table speaks for (the default suite's and the rig's own
/// `setup`, `kmemleak` and `vm`). Returns how many skips were expected.
pub fn apply(
    config: &RunConfig,
    label: &str,
    covered: &[String],
    outcomes: &mut [Outcome],
) -> usize {
    let rows = SKIPS
        .iter()
        .filter(|row| config.all(row.when))
        .collect::<Vec<_>>();
    let bugs = KNOWN_BUGS
        .iter()
        .filter(|row| config.all(row.when))
        .collect::<Vec<_>>();
    let mut expected = 0;
    // Programs whose failed cases were all known bugs, so far.
    let mut known_only: BTreeSet<String> = BTreeSet::new();
    let mut other_failures: BTreeSet<String> = BTreeSet::new();
    for outcome in outcomes.iter_mut() {
        let Some(key) = outcome
            .name
            .strip_prefix(label)
            .and_then(|k| k.strip_prefix("::"))
        else {
            continue;
        };
        let program = key.split("::").next().unwrap_or(key);
        if !covered.iter().any(|c| c == program) {
            continue;
        }
        if let Some(bug) = bugs.iter().find(|b| b.case == key) {
            outcome.verdict = match &outcome.verdict {
                Verdict::Fail(msg) if bug.failures.iter().any(|f| msg.contains(f)) => {
                    expected += 1;
                    known_only.insert(program.to_owned());
                    Verdict::Skip(bug.bug.to_owned())
                }
                Verdict::Pass if bug.intermittent => Verdict::Pass,
                Verdict::Pass => Verdict::Fail(format!(
                    "passed, but the expected-outcome table (xtask/src/expected.rs KNOWN_BUGS) \
                     says it fails in {} ({}): the bug is fixed, drop the row",
                    config.describe(),
                    bug.bug
                )),
                other => other.clone(),
            };
            continue;
        }
        if key.contains("::") && matches!(outcome.verdict, Verdict::Fail(_)) {
            other_failures.insert(program.to_owned());
        }
        let listed = rows
            .iter()
            .filter(|row| row.cases.iter().any(|p| names(p, key)))
            .collect::<Vec<_>>();
        let verdict = match (&outcome.verdict, listed.as_slice()) {
            (Verdict::Fail(_), _) | (Verdict::Pass, []) => continue,
            (Verdict::Skip(reason), []) => Verdict::Fail(format!(
                "unexpected skip ({reason}): no row of the expected-outcome table \
                 (xtask/src/expected.rs) lets {key} skip in {}; fix the cause, or add a row \
                 naming the errno if the skip is by design",
                config.describe()
            )),
            (Verdict::Skip(reason), rows) => {
                if rows.iter().any(|row| reason.starts_with(row.reason)) {
                    expected += 1;
                    continue;
                }
                Verdict::Fail(format!(
                    "skipped with {reason:?}, but in {} the expected-outcome table \
                     (xtask/src/expected.rs) allows only {}",
                    config.describe(),
                    allowed(rows)
                ))
            }
            (Verdict::Pass, rows) => Verdict::Fail(format!(
                "passed, but the expected-outcome table (xtask/src/expected.rs) says it skips \
                 in {} with {}: the table is stale, change its row",
                config.describe(),
                allowed(rows)
            )),
        };
        outcome.verdict = verdict;
    }
    // A program that failed (its exit code) only because of known bugs.
    for outcome in outcomes.iter_mut() {
        let Some(key) = outcome
            .name
            .strip_prefix(label)
            .and_then(|k| k.strip_prefix("::"))
        else {
            continue;
        };
        if known_only.contains(key)
            && !other_failures.contains(key)
            && matches!(&outcome.verdict, Verdict::Fail(msg) if msg.starts_with("failed exit="))
        {
            outcome.verdict = Verdict::Pass;
        }
    }
    expected
}

fn allowed(rows: &[&&Skip]) -> String {
    rows.iter()
        .map(|row| format!("{:?} ({})", row.reason, row.why))
        .collect::<Vec<_>>()
        .join(" or ")
}

/// The verdict on fgds's mode: every `# fgds-report: fgds mode=M` the guest printed must say
/// the mode `config` implies. None where the run had no fgds program and nothing reported.
pub fn mode_outcome(
    config: &RunConfig,
    label: &str,
    ktap: &str,
    fgds_planned: bool,
) -> Option<Outcome> {
    let reported = ktap
        .lines()
        .filter_map(|l| l.split("fgds-report: fgds mode=").nth(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .collect::<BTreeSet<_>>();
    if reported.is_empty() && !fgds_planned {
        return None;
    }
    let verdict = match mode(config) {
        Err(err) => Verdict::Fail(format!("{err:#}")),
        Ok(want) if reported.iter().all(|m| *m == want.sysfs()) && !reported.is_empty() => {
            Verdict::Pass
        }
        Ok(want) if reported.is_empty() => Verdict::Fail(format!(
            "no program reported fgds's mode (`# fgds-report: fgds mode=`); {} implies {}",
            config.describe(),
            want.sysfs()
        )),
        Ok(want) => Verdict::Fail(format!(
            "fgds showed mode {} (sysfs `mode`), but {} implies {} (xtask/src/expected.rs \
             MODES)",
            reported.into_iter().collect::<Vec<_>>().join(" and "),
            config.describe(),
            want.sysfs()
        )),
    };
    Some(Outcome {
        name: format!("{label}::mode"),
        verdict,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(series: (u32, u32), configs: &[&str], pages: Pages, iommu: bool) -> RunConfig {
        RunConfig {
            kernel: format!("debian:{}.{}", series.0, series.1),
            series,
            configs: configs.iter().map(|c| (*c).to_owned()).collect(),
            pages,
            vgpu_mode: VgpuMode::Plain,
            iommu,
            exporter: Exporter::Vgpu,
            gpus: 1,
        }
    }

    fn stock_612() -> RunConfig {
        config((6, 12), &["CONFIG_UDMABUF"], Pages::Auto, false)
    }

    fn outcome(name: &str, verdict: Verdict) -> Outcome {
        Outcome {
            name: format!("k::{name}"),
            verdict,
        }
    }

    fn covered() -> Vec<String> {
        [
            "kmemleak",
            "fgds_data",
            "fgds_badinput",
            "fgds_crate",
            "fgds_revoke",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    #[test]
    fn modes_follow_the_configuration() {
        let p2p = &["CONFIG_PCI_P2PDMA"];
        let cases = [
            (config((6, 12), &[], Pages::Auto, false), Mode::Generic),
            (config((6, 12), &[], Pages::Auto, true), Mode::Refused),
            (config((6, 12), &[], Pages::P2pdma, false), Mode::Refused),
            (config((7, 3), p2p, Pages::Auto, false), Mode::P2pdma),
            (config((7, 3), p2p, Pages::Auto, true), Mode::P2pdma),
            (config((7, 3), p2p, Pages::Generic, false), Mode::Generic),
            (config((7, 3), p2p, Pages::P2pdma, false), Mode::P2pdma),
            (config((7, 3), p2p, Pages::Generic, true), Mode::Refused),
        ];
        for (c, want) in cases {
            assert_eq!(mode(&c).unwrap(), want, "{}", c.describe());
        }
        let exporter = RunConfig {
            vgpu_mode: VgpuMode::P2pdma,
            ..config((7, 3), p2p, Pages::Generic, false)
        };
        assert_eq!(mode(&exporter).unwrap(), Mode::ExporterP2pdma);
        let provider = |pages, iommu| RunConfig {
            vgpu_mode: VgpuMode::Provider,
            ..config((7, 3), p2p, pages, iommu)
        };
        assert_eq!(mode(&provider(Pages::Auto, false)).unwrap(), Mode::Generic);
        assert_eq!(mode(&provider(Pages::Auto, true)).unwrap(), Mode::Refused);
        assert_eq!(
            mode(&provider(Pages::P2pdma, false)).unwrap(),
            Mode::Refused
        );
        let old = RunConfig {
            vgpu_mode: VgpuMode::Provider,
            ..config((6, 12), p2p, Pages::Auto, false)
        };
        assert!(
            mode(&old).is_err(),
            "vgpu mode=provider needs 6.19 or later"
        );
        let impossible = RunConfig {
            vgpu_mode: VgpuMode::P2pdma,
            ..config((6, 12), &[], Pages::Auto, false)
        };
        assert!(mode(&impossible).is_err());
    }

    #[test]
    fn vfio_runs_need_its_kernel_and_the_iommu() {
        let vfio = |configs: &[&str], iommu| RunConfig {
            exporter: Exporter::Vfio,
            ..config((7, 2), configs, Pages::Auto, iommu)
        };
        let full = &["CONFIG_PCI_P2PDMA", "CONFIG_VFIO_PCI_DMABUF"];
        // vfio-pci keeps P2PDMA state of its own: fgds adds no pages to it, and refuses
        // GENERIC ones under the IOMMU that vfio needs.
        assert_eq!(mode(&vfio(full, true)).unwrap(), Mode::Refused);
        let err = format!("{:#}", mode(&vfio(full, false)).unwrap_err());
        assert!(err.contains("--iommu"), "{err}");
        let err = format!(
            "{:#}",
            mode(&vfio(&["CONFIG_PCI_P2PDMA"], true)).unwrap_err()
        );
        assert!(err.contains("CONFIG_VFIO_PCI_DMABUF"), "{err}");
        let p2p_vgpu = RunConfig {
            vgpu_mode: VgpuMode::P2pdma,
            ..vfio(full, true)
        };
        assert!(mode(&p2p_vgpu).is_err());
    }

    /// A vfio run fails where fgds_vfio skips (say the GPU stayed vgpu's) and where a vgpu
    /// program runs (vgpu was loaded after all); a vgpu run lets fgds_vfio skip.
    #[test]
    fn vfio_cases_must_run_in_vfio_runs() {
        let vfio = RunConfig {
            exporter: Exporter::Vfio,
            ..config(
                (7, 2),
                &["CONFIG_PCI_P2PDMA", "CONFIG_VFIO_PCI_DMABUF"],
                Pages::Auto,
                true,
            )
        };
        let covered = ["fgds_vfio", "fgds_data"].map(str::to_owned).to_vec();
        let mut out = vec![
            outcome(
                "fgds_vfio",
                Verdict::Skip("the GPU is not bound to vfio-pci: it is vgpu's".into()),
            ),
            outcome(
                "fgds_data",
                Verdict::Skip("the GPU is bound to vfio-pci (--exporter vfio)".into()),
            ),
        ];
        assert_eq!(apply(&vfio, "k", &covered, &mut out), 1);
        assert!(matches!(out[0].verdict, Verdict::Fail(_)));
        assert!(matches!(out[1].verdict, Verdict::Skip(_)));
        let mut out = vec![outcome("fgds_data", Verdict::Pass)];
        apply(&vfio, "k", &covered, &mut out);
        assert!(
            matches!(out[0].verdict, Verdict::Fail(_)),
            "stale: vgpu ran"
        );
        let mut out = vec![outcome(
            "fgds_vfio",
            Verdict::Skip("the GPU is not bound to vfio-pci: run with --exporter vfio".into()),
        )];
        assert_eq!(apply(&stock_612(), "k", &covered, &mut out), 1);
    }

    #[test]
    fn expected_skips_stay_skips_and_others_fail() {
        let mut out = vec![
            outcome(
                "kmemleak",
                Verdict::Skip("the kernel has no kmemleak".into()),
            ),
            outcome(
                "fgds_data::io_uring_registered_buffers_refused",
                Verdict::Skip("EFAULT: io_uring refuses".into()),
            ),
            outcome("fgds_data::mode_reported", Verdict::Pass),
            outcome("exec:mine::x", Verdict::Skip("whatever".into())),
        ];
        let expected = apply(&stock_612(), "k", &covered(), &mut out);
        assert_eq!(expected, 1);
        assert!(matches!(out[0].verdict, Verdict::Skip(_)));
        let Verdict::Fail(msg) = &out[1].verdict else {
            panic!("a skip of the io_uring case is in no row of the table")
        };
        assert!(msg.contains("unexpected skip"), "{msg}");
        assert!(matches!(out[2].verdict, Verdict::Pass));
        assert!(
            matches!(out[3].verdict, Verdict::Skip(_)),
            "--exec programs are not the table's"
        );
    }

    /// A comparator's known bug is a skip with its reason where it fails as written up, a
    /// failure where it fails otherwise or passes, and its program's exit code counts only
    /// where nothing else failed.
    #[test]
    fn known_bugs_are_skips_never_passes() {
        let comparator = RunConfig {
            kernel: "build:7.2+io-uring-dmabuf".to_owned(),
            ..config((7, 2), &["CONFIG_PCI_P2PDMA"], Pages::Auto, false)
        };
        let covered = vec!["uring_dmabuf".to_owned()];
        let case = "uring_dmabuf::clearing_o_direct_after_registration";
        let written_up = "succeeded after O_DIRECT was cleared (v3 checks O_DIRECT only at \
                          registration): the host could not ...";
        let mut out = vec![
            outcome(case, Verdict::Fail(written_up.into())),
            outcome("uring_dmabuf", Verdict::Fail("failed exit=1".into())),
        ];
        assert_eq!(apply(&comparator, "k", &covered, &mut out), 1);
        let Verdict::Skip(why) = &out[0].verdict else {
            panic!("the known bug is not a skip: {:?}", out[0].verdict)
        };
        assert!(why.contains("docs/upstream.md"), "{why}");
        assert!(matches!(out[1].verdict, Verdict::Pass));

        let mut out = vec![
            outcome(case, Verdict::Fail(written_up.into())),
            outcome("uring_dmabuf::other", Verdict::Fail("broken".into())),
            outcome("uring_dmabuf", Verdict::Fail("failed exit=1".into())),
        ];
        apply(&comparator, "k", &covered, &mut out);
        assert!(
            matches!(out[2].verdict, Verdict::Fail(_)),
            "another failure counts"
        );

        let mut out = vec![outcome(case, Verdict::Fail("a hang".into()))];
        apply(&comparator, "k", &covered, &mut out);
        assert!(
            matches!(out[0].verdict, Verdict::Fail(_)),
            "another failure stays"
        );

        let mut out = vec![outcome(case, Verdict::Pass)];
        apply(&comparator, "k", &covered, &mut out);
        let Verdict::Fail(msg) = &out[0].verdict else {
            panic!("a fixed bug passes silently")
        };
        assert!(msg.contains("drop the row"), "{msg}");
    }

    #[test]
    fn a_skip_with_another_errno_fails() {
        let p2pdma = config((7, 3), &["CONFIG_PCI_P2PDMA"], Pages::P2pdma, false);
        let mut out = vec![
            outcome(
                "fgds_revoke::no_pmd_after_mremap_to_an_aligned_address",
                Verdict::Skip("no PMD mappings with p2pdma pages (order-0 folios)".into()),
            ),
            outcome(
                "fgds_revoke::no_pmd_in_a_mixedmap_mapping_of_two_extents",
                Verdict::Skip("no PMD mappings on 6.12".into()),
            ),
        ];
        apply(&p2pdma, "k", &covered(), &mut out);
        assert!(matches!(out[0].verdict, Verdict::Skip(_)));
        let Verdict::Fail(msg) = &out[1].verdict else {
            panic!("that reason is not the one the table allows there")
        };
        assert!(
            msg.contains("allows only \"no PMD mappings with\""),
            "{msg}"
        );
    }

    #[test]
    fn a_listed_case_that_passes_fails_as_stale() {
        let refused = config((6, 12), &["CONFIG_UDMABUF"], Pages::Auto, true);
        let mut out = vec![
            outcome("fgds_data::gpu_to_nvme_pwrite", Verdict::Pass),
            outcome(
                "fgds_badinput::reg_closed_fd_ebadf",
                Verdict::Pass, // needs no registration: not listed
            ),
            outcome(
                "fgds_crate",
                Verdict::Skip("EOPNOTSUPP: fgds refuses this setup".into()),
            ),
        ];
        let expected = apply(&refused, "k", &covered(), &mut out);
        let Verdict::Fail(msg) = &out[0].verdict else {
            panic!("a pass where the table expects a skip must fail")
        };
        assert!(msg.contains("stale"), "{msg}");
        assert!(matches!(out[1].verdict, Verdict::Pass));
        assert!(matches!(out[2].verdict, Verdict::Skip(_)));
        assert_eq!(expected, 1);
    }

    #[test]
    fn a_wrong_or_missing_mode_fails_the_mode_case() {
        let c = stock_612();
        let ok = "  # fgds-report: fgds mode=generic\n";
        let ok = mode_outcome(&c, "k", ok, true).expect("an outcome");
        assert!(matches!(ok.verdict, Verdict::Pass));
        assert_eq!(ok.name, "k::mode");
        let wrong = "  # fgds-report: fgds mode=generic\n  # fgds-report: fgds mode=p2pdma\n";
        let Some(Outcome {
            verdict: Verdict::Fail(msg),
            ..
        }) = mode_outcome(&c, "k", wrong, true)
        else {
            panic!("a wrong mode must fail")
        };
        assert!(msg.contains("implies generic"), "{msg}");
        assert!(matches!(
            mode_outcome(&c, "k", "", true).map(|o| o.verdict),
            Some(Verdict::Fail(_))
        ));
        assert!(mode_outcome(&c, "k", "", false).is_none());
    }

    #[test]
    fn release_series() {
        assert_eq!(series("6.12.118+deb12-amd64").unwrap(), (6, 12));
        assert_eq!(series("7.3.0-1-amd64").unwrap(), (7, 3));
        assert_eq!(series("6.12.57-fgds-debug").unwrap(), (6, 12));
        assert!(series("linux").is_err());
    }

    /// Every case a row names is a case of a program of the default suite (by its name in the
    /// program's source), so that a renamed case cannot leave a row that never applies.
    #[test]
    fn rows_name_cases_that_exist() {
        let root = crate::project_root();
        let suite = std::fs::read_to_string(root.join("tests/suite.txt")).unwrap();
        let programs = suite
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .filter_map(|l| l.split_whitespace().next())
            .collect::<Vec<_>>();
        for row in SKIPS {
            for case in row.cases {
                if *case == "kmemleak" {
                    continue;
                }
                let (program, name) = case.split_once("::").unwrap_or((case, "*"));
                let source = match programs
                    .iter()
                    .find(|p| p.trim_end_matches(".c").trim_end_matches(".py") == program)
                {
                    Some(p) if p.ends_with(".c") => root.join("tests/c").join(p),
                    Some(p) if p.ends_with(".py") => root.join("tests/python").join(p),
                    Some(_) => root.join(format!("tests/src/bin/{program}.rs")),
                    None => panic!("{case}: {program} is not in tests/suite.txt"),
                };
                let text = std::fs::read_to_string(&source).unwrap();
                // A Rust or Python program names its cases as string literals, the C client
                // in its result lines (`ok 1 name`).
                assert!(
                    name == "*"
                        || text.contains(&format!("\"{name}\""))
                        || text.contains(&format!(" {name}\\n")),
                    "{case}: {} names no case {name}",
                    source.display()
                );
            }
        }
    }
}

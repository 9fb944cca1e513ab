//! How the host backs the machine's memory, as QEMU's own `/proc/<pid>/smaps` shows it: the
//! GPU's memory (BAR2, a file QEMU maps shared) and the guest's RAM (QEMU's largest anonymous
//! mapping). A benchmark records it, so that two runs whose host pages differ (2 MiB against
//! 4 KiB) are not compared as if they were alike.

use std::path::Path;

use anyhow::Context;

/// One mapping's figures from smaps, in KiB.
#[derive(Default)]
struct Mapping {
    path: String,
    size: u64,
    rss: u64,
    anon_huge: u64,
    pmd_mapped: u64,
    kernel_page: u64,
}

/// The backing of the GPU's memory (the mapping of `gpu_backing`) and of the guest's RAM, as
/// one line of JSON.
pub fn describe(pid: i32, gpu_backing: &Path) -> anyhow::Result<String> {
    let smaps_path = format!("/proc/{pid}/smaps");
    let smaps = std::fs::read_to_string(&smaps_path)
        .with_context(|| format!("cannot read {smaps_path}"))?;
    let maps = parse(&smaps);
    let gpu = gpu_backing
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", gpu_backing.display()))?;
    let gpu = gpu.to_string_lossy();
    let bar = maps
        .iter()
        .filter(|m| m.path == gpu)
        .max_by_key(|m| m.size)
        .with_context(|| format!("QEMU (pid {pid}) has no mapping of {gpu}"))?;
    let ram = maps
        .iter()
        .filter(|m| m.path.is_empty())
        .max_by_key(|m| m.size)
        .with_context(|| format!("QEMU (pid {pid}) has no anonymous mapping"))?;
    let (fs, options) = mount_of(pid, &gpu)?;
    Ok(serde_json::json!({
        "bar": {
            "path": gpu,
            "fs": fs,
            "mount_options": options,
            "size_kib": bar.size,
            "rss_kib": bar.rss,
            "pmd_mapped_kib": bar.pmd_mapped,
            "kernel_page_kib": bar.kernel_page,
        },
        "guest_ram": {
            "size_kib": ram.size,
            "rss_kib": ram.rss,
            "anon_huge_kib": ram.anon_huge,
            "kernel_page_kib": ram.kernel_page,
        },
    })
    .to_string())
}

/// The mappings of an smaps text, each with the figures this module reads.
fn parse(smaps: &str) -> Vec<Mapping> {
    let mut maps: Vec<Mapping> = Vec::new();
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else {
            continue;
        };
        if let Some(key) = first.strip_suffix(':') {
            let (Some(map), Some(kib)) = (
                maps.last_mut(),
                words.next().and_then(|v| v.parse::<u64>().ok()),
            ) else {
                continue;
            };
            match key {
                "Size" => map.size = kib,
                "Rss" => map.rss = kib,
                "AnonHugePages" => map.anon_huge = kib,
                "ShmemPmdMapped" | "FilePmdMapped" => map.pmd_mapped += kib,
                "KernelPageSize" => map.kernel_page = kib,
                _ => {}
            }
        } else if first.contains('-') {
            // "start-end perms offset dev inode [path]"
            let path = line.split_whitespace().nth(5).unwrap_or("").to_owned();
            maps.push(Mapping {
                path,
                ..Mapping::default()
            });
        }
    }
    maps
}

/// The file system type and super-block options of the mount holding `path`, as QEMU sees its
/// mounts (the longest mount point that is a prefix of the path).
fn mount_of(pid: i32, path: &str) -> anyhow::Result<(String, String)> {
    let info_path = format!("/proc/{pid}/mountinfo");
    let info =
        std::fs::read_to_string(&info_path).with_context(|| format!("cannot read {info_path}"))?;
    let mut best: Option<(usize, String, String)> = None;
    for line in info.lines() {
        // "id parent major:minor root mountpoint options [optional...] - fstype source superopts"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = left.split_whitespace().nth(4) else {
            continue;
        };
        let inside = path == point
            || point == "/"
            || path.starts_with(point) && path.as_bytes().get(point.len()) == Some(&b'/');
        if !inside || best.as_ref().is_some_and(|(len, _, _)| *len > point.len()) {
            continue;
        }
        let mut right = right.split_whitespace();
        let fs = right.next().unwrap_or("").to_owned();
        let options = right.nth(1).unwrap_or("").to_owned();
        best = Some((point.len(), fs, options));
    }
    best.map(|(_, fs, options)| (fs, options))
        .with_context(|| format!("no mount holds {path} in {info_path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_figures_per_mapping() {
        let text = "\
7f0000000000-7f0040000000 rw-s 00000000 00:2a 12 /run/fgds/gpu
Size:            1048576 kB
KernelPageSize:        4 kB
Rss:              524288 kB
ShmemPmdMapped:   524288 kB
7f1000000000-7f1100000000 rw-p 00000000 00:00 0 
Size:            4194304 kB
KernelPageSize:        4 kB
Rss:             1000000 kB
AnonHugePages:    997376 kB
";
        let maps = parse(text);
        assert_eq!(maps.len(), 2);
        assert_eq!(maps[0].path, "/run/fgds/gpu");
        assert_eq!((maps[0].size, maps[0].pmd_mapped), (1048576, 524288));
        assert_eq!(maps[1].path, "");
        assert_eq!((maps[1].rss, maps[1].anon_huge), (1000000, 997376));
    }
}

//! The host-side images of a run: the NVMe drive (pattern, then scratch) and the GPU's memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use fgds_tests::pattern;

/// Writes a fresh NVMe image: [`pattern::NVME_PATTERN_BYTES`] of the pattern, then zeroes up to
/// [`pattern::NVME_IMAGE_BYTES`] (sparse).
pub fn write_nvme_image(path: &Path) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 20, &file);
    let mut chunk = vec![0u8; 1 << 20];
    let mut offset = 0;
    while offset < pattern::NVME_PATTERN_BYTES {
        pattern::fill(pattern::NVME_SEED, offset, &mut chunk);
        w.write_all(&chunk)?;
        offset += chunk.len() as u64;
    }
    w.flush()?;
    drop(w);
    file.set_len(pattern::NVME_IMAGE_BYTES)?;
    Ok(())
}

/// Creates a fresh, zeroed GPU backing file of `bytes` (sparse).
pub fn write_gpu_backing(path: &Path, bytes: u64) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    file.set_len(bytes)?;
    Ok(())
}

//! The deterministic data pattern of the rig, defined in one place.
//!
//! The host writes it into the first [`NVME_PATTERN_BYTES`] of the NVMe image, guest tests write
//! it into GPU memory, and the host checks the GPU backing file against it after the run.
//! Every 8-byte word is a hash of its byte offset and a seed, so a misplaced, shifted or
//! repeated block never matches by accident.

/// Bytes at the start of the NVMe image that hold the pattern with seed [`NVME_SEED`].
pub const NVME_PATTERN_BYTES: u64 = 64 << 20;
/// Size of the NVMe image; the part past the pattern is scratch space tests may write.
pub const NVME_IMAGE_BYTES: u64 = 256 << 20;
/// Size of the fake GPU's memory (ivshmem BAR2); a power of two, as QEMU requires.
pub const GPU_MEMORY_BYTES: u64 = 256 << 20;
/// The seed of the NVMe image's pattern.
pub const NVME_SEED: u64 = 0x6667_6473;

/// Where the NVMe drive fails I/O on purpose (QEMU blkdebug, set up by the rig for every run):
/// a request that touches one of these bytes fails. The suite's other tests stay clear of them.
pub mod fault {
    /// Reads touching this MiB fail every time with EIO (the kernel reports ENODATA for the
    /// NVMe media error QEMU returns).
    pub const READ_ALWAYS: u64 = 240 << 20;
    /// The first read touching this MiB fails, later ones succeed.
    pub const READ_ONCE: u64 = 241 << 20;
    /// Writes touching this MiB fail every time.
    pub const WRITE_ALWAYS: u64 = 242 << 20;
    /// The first write touching this MiB fails, later ones succeed.
    pub const WRITE_ONCE: u64 = 243 << 20;
    /// The bytes of each failing area that a request must touch (one sector).
    pub const SECTOR: u64 = 512;
}

/// The pattern word for the 8 bytes at `offset` (a multiple of 8).
pub fn word(seed: u64, offset: u64) -> u64 {
    // splitmix64 of the word index mixed with the seed.
    let mut z = (offset / 8) ^ seed.rotate_left(32);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern as it stands at byte `offset` of a pattern stream.
///
/// `offset` and `buf.len()` must be multiples of 8.
pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    assert!(
        offset.is_multiple_of(8) && buf.len().is_multiple_of(8),
        "pattern offset and length must be multiples of 8"
    );
    for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(seed, offset + 8 * i as u64).to_le_bytes());
    }
}

/// Returns the byte offset (relative to `buf`) of the first byte that differs from the pattern.
pub fn first_mismatch(seed: u64, offset: u64, buf: &[u8]) -> Option<usize> {
    assert!(
        offset.is_multiple_of(8) && buf.len().is_multiple_of(8),
        "pattern offset and length must be multiples of 8"
    );
    buf.chunks_exact(8).enumerate().find_map(|(i, chunk)| {
        let expected = word(seed, offset + 8 * i as u64).to_le_bytes();
        chunk
            .iter()
            .zip(expected)
            .position(|(a, b)| *a != b)
            .map(|p| 8 * i + p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_and_check_agree_at_any_offset() {
        let mut buf = vec![0u8; 4096];
        fill(NVME_SEED, 8192, &mut buf);
        assert_eq!(first_mismatch(NVME_SEED, 8192, &buf), None);
        assert_eq!(first_mismatch(NVME_SEED, 8200, &buf), Some(0));
        assert_eq!(first_mismatch(NVME_SEED + 1, 8192, &buf), Some(0));
        buf[1000] ^= 1;
        assert_eq!(first_mismatch(NVME_SEED, 8192, &buf), Some(1000));
    }

    #[test]
    fn words_do_not_repeat_across_blocks() {
        let a = (0..512).map(|i| word(NVME_SEED, i * 8)).collect::<Vec<_>>();
        let b = (0..512)
            .map(|i| word(NVME_SEED, 4096 + i * 8))
            .collect::<Vec<_>>();
        assert_ne!(a, b);
    }
}

//! The guest's initramfs: a newc cpio archive written with fixed metadata (mtime 0, uid and gid
//! 0, inode numbers in path order), so the same inputs give the same bytes.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use cpio::newc::{Builder, ModeFileType, trailer};

/// One entry of the archive.
#[derive(Debug, Clone)]
pub enum Entry {
    Dir,
    /// A host file copied in, with its permission bits.
    File {
        source: PathBuf,
        mode: u32,
    },
    /// Bytes given directly.
    Data {
        bytes: Vec<u8>,
        mode: u32,
    },
    CharDev {
        major: u32,
        minor: u32,
        mode: u32,
    },
}

/// The archive's entries by guest path (without the leading `/`); parent directories are added
/// by [`write()`].
pub type Tree = BTreeMap<String, Entry>;

/// The entries every rig image has: the kernel filesystem mount points and `/dev/console`,
/// which the kernel opens for PID 1 before devtmpfs is mounted.
pub fn base_tree() -> Tree {
    let mut tree = Tree::new();
    for dir in ["dev", "proc", "sys", "tmp", "run", "etc", "etc/fgds"] {
        tree.insert(dir.to_owned(), Entry::Dir);
    }
    tree.insert(
        "dev/console".to_owned(),
        Entry::CharDev {
            major: 5,
            minor: 1,
            mode: 0o600,
        },
    );
    tree
}

/// Writes `tree` as a newc archive to `out`.
pub fn write(tree: &Tree, out: &Path) -> anyhow::Result<()> {
    let mut full = tree.clone();
    for path in tree.keys() {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.filter(|p| !p.as_os_str().is_empty()) {
            full.entry(dir.to_string_lossy().into_owned())
                .or_insert(Entry::Dir);
            parent = dir.parent();
        }
    }
    let file = File::create(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut w = BufWriter::new(file);
    for (ino, (path, entry)) in full.iter().enumerate() {
        let builder = Builder::new(path)
            .ino(ino as u32 + 1)
            .uid(0)
            .gid(0)
            .mtime(0);
        match entry {
            Entry::Dir => {
                let b = builder
                    .mode(0o755)
                    .set_mode_file_type(ModeFileType::Directory)
                    .nlink(2);
                b.write(&mut w, 0).finish()?;
            }
            Entry::File { source, mode } => {
                let bytes = std::fs::read(source)
                    .with_context(|| format!("cannot read {}", source.display()))?;
                write_file(&mut w, builder, &bytes, *mode)?;
            }
            Entry::Data { bytes, mode } => write_file(&mut w, builder, bytes, *mode)?,
            Entry::CharDev { major, minor, mode } => {
                let b = builder
                    .mode(*mode)
                    .set_mode_file_type(ModeFileType::Char)
                    .nlink(1)
                    .rdev_major(*major)
                    .rdev_minor(*minor);
                b.write(&mut w, 0).finish()?;
            }
        }
    }
    trailer(&mut w)?;
    w.flush()?;
    Ok(())
}

fn write_file(w: &mut impl Write, builder: Builder, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    let size = u32::try_from(bytes.len())
        .context("a file of more than 4 GiB cannot go into a newc archive")?;
    let mut writer = builder
        .mode(mode)
        .set_mode_file_type(ModeFileType::Regular)
        .nlink(1)
        .write(w, size);
    writer.write_all(bytes)?;
    writer.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_tree_same_bytes_and_parents_added() {
        let dir = std::env::temp_dir().join(format!("fgds-initramfs-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut tree = base_tree();
        tree.insert(
            "tests/bin/x".to_owned(),
            Entry::Data {
                bytes: b"hello".to_vec(),
                mode: 0o755,
            },
        );
        write(&tree, &dir.join("a.cpio")).unwrap();
        write(&tree, &dir.join("b.cpio")).unwrap();
        let a = std::fs::read(dir.join("a.cpio")).unwrap();
        assert_eq!(a, std::fs::read(dir.join("b.cpio")).unwrap());
        let names = list(&a);
        assert!(names.contains(&"tests".to_owned()) && names.contains(&"tests/bin".to_owned()));
        assert!(names.contains(&"dev/console".to_owned()));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn list(archive: &[u8]) -> Vec<String> {
        let mut names = Vec::new();
        let mut rest = archive;
        loop {
            let reader = cpio::NewcReader::new(rest).unwrap();
            if reader.entry().is_trailer() {
                return names;
            }
            names.push(reader.entry().name().to_owned());
            rest = reader.finish().unwrap();
        }
    }
}

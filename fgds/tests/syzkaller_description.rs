//! The syzkaller descriptions in tests/syzkaller/ (syzkaller's own compiler is not packaged
//! for Debian, see the README there) are checked here against the C headers as syz-extract and
//! syz-sysgen would: every type they use is defined, every struct has the header's fields in
//! the header's order at the header's offsets, every constant exists, and every ioctl's
//! argument has the size and direction its number encodes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const FILES: &[&str] = &["dev_fgds.txt", "dev_vgpu.txt"];

/// syzlang's built-in types, and what the descriptions use from upstream's files
/// (`fd_dma_buf` from dev_udmabuf.txt, the mmap flag sets from sys.txt).
const KNOWN: &[&str] = &[
    "int8",
    "int16",
    "int32",
    "int64",
    "intptr",
    "bool32",
    "fd",
    "vma",
    "len",
    "ptr",
    "string",
    "flags",
    "const",
    "array",
    "in",
    "out",
    "inout",
    "fd_dma_buf",
    "mmap_prot",
    "mmap_flags",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

#[derive(Default)]
struct Description {
    /// struct name -> (field, type) in order.
    structs: BTreeMap<String, Vec<(String, String)>>,
    /// Resources and their underlying type.
    resources: BTreeMap<String, String>,
    /// Flag sets and string sets: name -> values.
    sets: BTreeMap<String, Vec<String>>,
    /// Calls: (name, argument list).
    calls: Vec<(String, String)>,
}

fn parse(text: &str) -> Description {
    let mut d = Description::default();
    let mut open: Option<(String, Vec<(String, String)>)> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if line.starts_with('#') || line.trim().is_empty() || line.starts_with("include ") {
            continue;
        }
        if let Some((name, fields)) = open.as_mut() {
            if line == "}" {
                d.structs.insert(name.clone(), std::mem::take(fields));
                open = None;
            } else {
                let mut parts = line.trim().splitn(2, char::is_whitespace);
                let field = parts.next().unwrap().to_owned();
                let ty = parts.next().unwrap_or("").trim().to_owned();
                assert!(!ty.is_empty(), "field {field} of {name} has no type");
                fields.push((field, ty));
            }
        } else if let Some(name) = line.strip_suffix(" {") {
            open = Some((name.to_owned(), Vec::new()));
        } else if let Some(rest) = line.strip_prefix("resource ") {
            let (name, under) = rest.split_once('[').expect("resource name[type]");
            let under = under.split(']').next().unwrap();
            d.resources.insert(name.to_owned(), under.to_owned());
        } else if let Some((name, values)) = line.split_once(" = ") {
            d.sets.insert(
                name.to_owned(),
                values.split(',').map(|v| v.trim().to_owned()).collect(),
            );
        } else {
            let (name, args) = line.split_once('(').expect("a call");
            d.calls.push((name.to_owned(), args.to_owned()));
        }
    }
    assert!(open.is_none(), "a struct is not closed");
    d
}

/// The identifiers of a type expression (or argument list), without literals and strings.
fn identifiers(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_string = false;
    let mut word = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            in_string = !in_string;
            continue;
        }
        if in_string {
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
        } else if !word.is_empty() {
            if !word.starts_with(|c: char| c.is_ascii_digit()) {
                out.push(std::mem::take(&mut word));
            }
            word.clear();
        }
    }
    out
}

/// Field name -> size, for the field types the descriptions use.
fn size_of(d: &Description, ty: &str) -> u64 {
    let base = ty.split(['[', ' ', '\t']).next().unwrap();
    match base {
        "int8" => 1,
        "int16" => 2,
        "int32" | "bool32" | "fd" | "fd_dma_buf" => 4,
        "int64" | "intptr" => 8,
        "flags" | "const" => {
            if ty.contains("int64") {
                8
            } else if ty.contains("int16") {
                2
            } else if ty.contains("int8") {
                1
            } else {
                4
            }
        }
        other => match d.resources.get(other) {
            Some(under) => size_of(d, under),
            None => panic!("no size for field type {ty}"),
        },
    }
}

#[test]
fn syzkaller_descriptions_match_the_headers() {
    let dir = root().join("tests/syzkaller");
    let mut all = Description::default();
    for file in FILES {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let d = parse(&text);
        all.structs.extend(d.structs);
        all.resources.extend(d.resources);
        all.sets.extend(d.sets);
        all.calls.extend(d.calls);
    }

    // Every identifier is a built-in, defined here, or a C constant (upper case).
    // Argument names may be referred to (len[addr]).
    let arg_names: Vec<String> = all
        .calls
        .iter()
        .flat_map(|(_, args)| {
            args.split(',')
                .filter_map(|a| a.split_whitespace().next().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    let defined: BTreeSet<&str> = all
        .structs
        .keys()
        .chain(all.resources.keys())
        .chain(all.sets.keys())
        .map(String::as_str)
        .chain(KNOWN.iter().copied())
        .chain(arg_names.iter().map(String::as_str))
        .collect();
    let mut constants = BTreeSet::new();
    let exprs = all
        .structs
        .values()
        .flatten()
        .map(|(_, ty)| ty.clone())
        .chain(all.resources.values().cloned())
        .chain(all.sets.values().flatten().cloned())
        .chain(all.calls.iter().map(|(_, args)| {
            // Argument names are not types: keep what follows each name.
            args.split(',')
                .filter_map(|a| a.trim().split_once(' ').map(|(_, ty)| ty.to_owned()))
                .collect::<Vec<_>>()
                .join(", ")
        }));
    for expr in exprs {
        for id in identifiers(&expr) {
            if id
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                constants.insert(id);
            } else {
                assert!(
                    defined.contains(id.as_str()),
                    "{id} (in {expr}) is not defined"
                );
            }
        }
    }

    // A C program prints each struct's layout and each constant; it fails to compile where
    // a field or a constant does not exist.
    let mut c = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <fcntl.h>\n#include <sys/mman.h>\n\
         #include <linux/fgds.h>\n#include <linux/vgpu.h>\nint main(void)\n{\n",
    );
    for (name, fields) in &all.structs {
        writeln!(
            c,
            "\tprintf(\"size {name} %zu\\n\", sizeof(struct {name}));"
        )
        .unwrap();
        for (field, _) in fields {
            writeln!(
                c,
                "\tprintf(\"offset {name}.{field} %zu\\n\", offsetof(struct {name}, {field}));"
            )
            .unwrap();
            writeln!(
                c,
                "\tprintf(\"width {name}.{field} %zu\\n\", sizeof(((struct {name} *)0)->{field}));"
            )
            .unwrap();
        }
    }
    for k in &constants {
        writeln!(
            c,
            "\tprintf(\"const {k} %llu\\n\", (unsigned long long)({k}));"
        )
        .unwrap();
    }
    c.push_str("\treturn 0;\n}\n");
    let out_dir = root().join("target/syzkaller-check");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::write(out_dir.join("probe.c"), &c).unwrap();
    let cc = Command::new("cc")
        .arg("-I")
        .arg(root().join("driver/include/uapi"))
        .arg(out_dir.join("probe.c"))
        .arg("-o")
        .arg(out_dir.join("probe"))
        .output()
        .expect("cannot run cc: install gcc");
    assert!(
        cc.status.success(),
        "the descriptions name a field or constant the headers lack:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let out = Command::new(out_dir.join("probe")).output().unwrap();
    let c_values: BTreeMap<String, u64> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_owned(), v.parse().unwrap())
        })
        .collect();

    // Fields in the header's order, at the offsets natural alignment gives them.
    for (name, fields) in &all.structs {
        let mut off = 0u64;
        let mut align = 1u64;
        for (field, ty) in fields {
            let size = size_of(&all, ty);
            assert_eq!(
                c_values[&format!("width {name}.{field}")],
                size,
                "{name}.{field}: the description gives it {size} bytes"
            );
            off = off.div_ceil(size) * size;
            align = align.max(size);
            assert_eq!(
                c_values[&format!("offset {name}.{field}")],
                off,
                "{name}.{field}: the description puts it at {off}"
            );
            off += size;
        }
        assert_eq!(
            c_values[&format!("size {name}")],
            off.div_ceil(align) * align,
            "struct {name}: size"
        );
    }

    // ioctls: the argument's size and direction are the ones the number encodes.
    for (call, args) in all.calls.iter().filter(|(c, _)| c.starts_with("ioctl$")) {
        let cmd = identifiers(args.split("cmd const[").nth(1).expect("cmd const[...]"))[0].clone();
        let number = c_values[&format!("const {cmd}")];
        let arg = args.split("arg ptr[").nth(1).expect("arg ptr[dir, struct]");
        let (dir, ty) = arg.split_once(',').unwrap();
        let ty = ty.trim().trim_end_matches([']', ')']);
        let size = c_values[&format!("size {ty}")];
        assert_eq!(
            (number >> 16) & 0x3fff,
            size,
            "{call}: {cmd} encodes another size than struct {ty}'s"
        );
        let encoded = match number >> 30 {
            1 => "in",
            2 => "out",
            3 => "inout",
            _ => "none",
        };
        assert_eq!(
            encoded,
            dir.trim(),
            "{call}: {cmd} encodes direction {encoded}"
        );
    }
    assert_eq!(
        c_values["const FGDS_IOCTL_REG_BUFFER"],
        u64::from(fgds::uapi::REG_BUFFER)
    );
    assert_eq!(
        c_values["const FGDS_IOCTL_UNREG_BUFFER"],
        u64::from(fgds::uapi::UNREG_BUFFER)
    );
}

//! Kernel config fragments (`vm-images/configs/*.config`): parsing, merging into a `.config`
//! as `scripts/kconfig/merge_config.sh` does, and checking that the result has what they ask.

use anyhow::{Context, bail};

/// A config fragment: its path in the repository (for messages) and its text.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fragment {
    pub(super) name: &'static str,
    pub(super) text: &'static str,
}

/// The base guest kernel.
pub(super) const BASE: Fragment = Fragment {
    name: "vm-images/configs/base.config",
    text: include_str!("../../configs/base.config"),
};

/// What `+debug` adds.
pub(super) const DEBUG: Fragment = Fragment {
    name: "vm-images/configs/debug.config",
    text: include_str!("../../configs/debug.config"),
};

/// One requested setting: `CONFIG_NAME=value`, or `# CONFIG_NAME is not set` (`value` is
/// `None`), and the fragment that asked for it last.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Setting {
    /// Without the `CONFIG_` prefix.
    pub(super) name: String,
    pub(super) value: Option<String>,
    pub(super) fragment: &'static str,
}

/// A setting the final `.config` does not have as asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Unmet {
    pub(super) wanted: Setting,
    /// The value the `.config` has; `None` if the option is unset or absent.
    pub(super) got: Option<String>,
}

/// The settings of `fragments`, in order of first mention; a later fragment overrides an
/// earlier one. Fails naming the fragment and line of anything that is not a setting, a
/// comment or blank.
pub(super) fn settings(fragments: &[Fragment]) -> anyhow::Result<Vec<Setting>> {
    let mut res: Vec<Setting> = Vec::new();
    for fragment in fragments {
        for (idx, line) in fragment.text.lines().enumerate() {
            let at = || format!("{}:{}", fragment.name, idx + 1);
            let Some((name, value)) = parse_line(line).with_context(at)? else {
                continue;
            };
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                bail!("{}: {line:?} is not a kernel config setting", at());
            }
            let setting = Setting {
                name: name.to_owned(),
                value: value.map(str::to_owned),
                fragment: fragment.name,
            };
            match res.iter_mut().find(|it| it.name == name) {
                Some(it) => *it = setting,
                None => res.push(setting),
            }
        }
    }
    Ok(res)
}

/// A `.config` or fragment line: `Some((name, Some(value)))` for `CONFIG_NAME=value`,
/// `Some((name, None))` for `# CONFIG_NAME is not set` (and `CONFIG_NAME=n`), `None` for
/// comments and blank lines. Fails on other text.
fn parse_line(line: &str) -> anyhow::Result<Option<(&str, Option<&str>)>> {
    let line = line.trim();
    if let Some(rest) = line.strip_prefix("# CONFIG_") {
        if let Some(name) = rest.strip_suffix(" is not set") {
            return Ok(Some((name, None)));
        }
        return Ok(None);
    }
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let Some((name, value)) = line
        .strip_prefix("CONFIG_")
        .and_then(|it| it.split_once('='))
    else {
        bail!(
            "{line:?} is not a kernel config setting (`CONFIG_NAME=value` or \
             `# CONFIG_NAME is not set`)"
        );
    };
    Ok(Some((name, (value != "n").then_some(value))))
}

fn format_setting(name: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!("CONFIG_{name}={value}"),
        None => format!("# CONFIG_{name} is not set"),
    }
}

/// `config` (a `.config`) with `settings` in place of whatever it said about those options,
/// appended at the end as merge_config.sh does; `make olddefconfig` then resolves the rest.
pub(super) fn merge(config: &str, settings: &[Setting]) -> String {
    let mut res = String::with_capacity(config.len() + settings.len() * 40);
    for line in config.lines() {
        let overridden = parse_line(line)
            .ok()
            .flatten()
            .is_some_and(|(name, _)| settings.iter().any(|it| it.name == name));
        if !overridden {
            res.push_str(line);
            res.push('\n');
        }
    }
    res.push_str("# fgds config fragments\n");
    for setting in settings {
        res.push_str(&format_setting(&setting.name, setting.value.as_deref()));
        res.push('\n');
    }
    res
}

/// The settings `config` (a final `.config`) does not have as asked.
pub(super) fn unmet(config: &str, settings: &[Setting]) -> Vec<Unmet> {
    settings
        .iter()
        .filter_map(|wanted| {
            let got = super::config_value(config, &wanted.name).filter(|it| *it != "n");
            (got != wanted.value.as_deref()).then(|| Unmet {
                wanted: wanted.clone(),
                got: got.map(str::to_owned),
            })
        })
        .collect()
}

/// A message naming every unmet setting, what the `.config` has instead, and how to find the
/// missing dependency.
pub(super) fn unmet_message(unmet: &[Unmet], config_path: &str, src: &str) -> String {
    let mut res = format!(
        "{} requested kernel option(s) did not end up in {config_path} as asked (a dependency \
         is missing from the fragments, or the option does not exist in this kernel):\n",
        unmet.len()
    );
    for it in unmet {
        let wanted = format_setting(&it.wanted.name, it.wanted.value.as_deref());
        let got = match &it.got {
            Some(value) => format!("CONFIG_{}={value}", it.wanted.name),
            None => "unset".to_owned(),
        };
        res.push_str(&format!(
            "  {wanted} (from {}): the .config has {got}\n",
            it.wanted.fragment
        ));
    }
    let first = &unmet
        .first()
        .map(|it| it.wanted.name.as_str())
        .unwrap_or("");
    res.push_str(&format!(
        "find what an option depends on with `grep -rn -A12 -E '^(menu)?config {first}$' \
         --include='Kconfig*' {src}` and add the dependency to the fragment"
    ));
    res
}

/// The cache key of a build: FNV-1a over everything that changes the result, as 16 hex digits.
pub(super) fn cache_key(parts: &[&str]) -> String {
    let mut text = String::new();
    for part in parts {
        // Length-prefixed, so ("ab", "c") and ("a", "bc") differ.
        text.push_str(&format!("{}:{part}\n", part.len()));
    }
    format!("{:016x}", super::fnv1a(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Fragment = Fragment {
        name: "a.config",
        text: "# A comment\nCONFIG_PCI=y\n# CONFIG_VT is not set\n\nCONFIG_LOCALVERSION=\"-a\"\n",
    };
    const B: Fragment = Fragment {
        name: "b.config",
        text: "CONFIG_KASAN=y\nCONFIG_LOCALVERSION=\"-b\"\nCONFIG_VT=n\n",
    };

    fn setting(name: &str, value: Option<&str>, fragment: &'static str) -> Setting {
        Setting {
            name: name.to_owned(),
            value: value.map(str::to_owned),
            fragment,
        }
    }

    #[test]
    fn later_fragments_override_earlier_ones() {
        let settings = settings(&[A, B]).unwrap();
        assert_eq!(
            settings,
            [
                setting("PCI", Some("y"), "a.config"),
                setting("VT", None, "b.config"),
                setting("LOCALVERSION", Some("\"-b\""), "b.config"),
                setting("KASAN", Some("y"), "b.config"),
            ]
        );
    }

    #[test]
    fn rejects_lines_that_are_not_settings() {
        let bad = Fragment {
            name: "bad.config",
            text: "CONFIG_A=y\nPCI=y\n",
        };
        let err = settings(&[bad]).unwrap_err().to_string();
        assert!(err.contains("bad.config:2"), "{err}");
        let bad = Fragment {
            name: "bad.config",
            text: "CONFIG_A B=y\n",
        };
        let err = settings(&[bad]).unwrap_err().to_string();
        assert!(err.contains("bad.config:1"), "{err}");
    }

    #[test]
    fn merges_like_merge_config() {
        let config = "\
#
# Automatically generated file; DO NOT EDIT.
#
CONFIG_VT=y
CONFIG_PCI_QUIRKS=y
# CONFIG_PCI is not set
CONFIG_LOCALVERSION=\"\"
";
        let merged = merge(config, &settings(&[A, B]).unwrap());
        assert_eq!(
            merged,
            "\
#
# Automatically generated file; DO NOT EDIT.
#
CONFIG_PCI_QUIRKS=y
# fgds config fragments
CONFIG_PCI=y
# CONFIG_VT is not set
CONFIG_LOCALVERSION=\"-b\"
CONFIG_KASAN=y
"
        );
    }

    #[test]
    fn finds_unmet_settings() {
        let settings = settings(&[A, B]).unwrap();
        let good = "CONFIG_PCI=y\nCONFIG_LOCALVERSION=\"-b\"\nCONFIG_KASAN=y\n";
        assert_eq!(unmet(good, &settings), []);
        // Unset both ways: "is not set" and absent.
        let good =
            "CONFIG_PCI=y\n# CONFIG_VT is not set\nCONFIG_LOCALVERSION=\"-b\"\nCONFIG_KASAN=y\n";
        assert_eq!(unmet(good, &settings), []);

        let bad =
            "CONFIG_PCI=m\nCONFIG_VT=y\nCONFIG_LOCALVERSION=\"-b\"\n# CONFIG_KASAN is not set\n";
        let unmet = unmet(bad, &settings);
        assert_eq!(
            unmet,
            [
                Unmet {
                    wanted: setting("PCI", Some("y"), "a.config"),
                    got: Some("m".to_owned()),
                },
                Unmet {
                    wanted: setting("VT", None, "b.config"),
                    got: Some("y".to_owned()),
                },
                Unmet {
                    wanted: setting("KASAN", Some("y"), "b.config"),
                    got: None,
                },
            ]
        );
        let message = unmet_message(&unmet, "/b/.config", "/src/linux");
        assert!(message.starts_with("3 requested"), "{message}");
        assert!(
            message.contains("CONFIG_KASAN=y (from b.config): the .config has unset"),
            "{message}"
        );
        assert!(
            message.contains("# CONFIG_VT is not set (from b.config): the .config has CONFIG_VT=y"),
            "{message}"
        );
        assert!(message.contains("config PCI$"), "{message}");
    }

    #[test]
    fn the_shipped_fragments_parse_and_ask_for_what_the_rig_needs() {
        let base = settings(&[BASE]).unwrap();
        let debug = settings(&[BASE, DEBUG]).unwrap();
        let wants = |settings: &[Setting], name: &str, value: Option<&str>| {
            settings
                .iter()
                .any(|it| it.name == name && it.value.as_deref() == value)
        };
        for name in [
            "PCI_P2PDMA",
            "ZONE_DEVICE",
            "HOTPLUG_PCI_PCIE",
            "BLK_DEV_NVME",
            "IO_URING",
            "DMABUF_HEAPS",
            "UDMABUF",
            "VIRTIO_CONSOLE",
            "PVPANIC_PCI",
            "EXT4_FS",
            "MODULE_UNLOAD",
            "KERNEL_GZIP",
        ] {
            assert!(wants(&base, name, Some("y")), "{name}");
        }
        assert!(wants(&base, "DEBUG_INFO", None));
        assert!(!base.iter().any(|it| it.name == "KASAN"));
        for name in [
            "KASAN",
            "KASAN_INLINE",
            "PROVE_LOCKING",
            "DMABUF_DEBUG",
            "DEBUG_KMEMLEAK",
            "FAIL_MAKE_REQUEST",
        ] {
            assert!(wants(&debug, name, Some("y")), "{name}");
        }
        assert!(wants(&debug, "DEBUG_KMEMLEAK_DEFAULT_OFF", None));
        assert!(wants(&debug, "LOCALVERSION", Some("\"-fgds-debug\"")));
    }

    #[test]
    fn cache_keys_change_with_any_part() {
        let key = cache_key(&["6.12.117-1~deb12u1", "CONFIG_A=y\n", "gcc 12"]);
        assert_eq!(key.len(), 16);
        assert_eq!(
            key,
            cache_key(&["6.12.117-1~deb12u1", "CONFIG_A=y\n", "gcc 12"])
        );
        assert_ne!(
            key,
            cache_key(&["6.12.117-2~deb12u1", "CONFIG_A=y\n", "gcc 12"])
        );
        assert_ne!(
            key,
            cache_key(&["6.12.117-1~deb12u1", "CONFIG_A=m\n", "gcc 12"])
        );
        assert_ne!(cache_key(&["ab", "c"]), cache_key(&["a", "bc"]));
        // Stable across releases and platforms: FNV-1a, not std's hasher.
        assert_eq!(
            cache_key(&[]),
            format!("{:016x}", 0xcbf2_9ce4_8422_2325_u64)
        );
    }
}

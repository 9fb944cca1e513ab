//! The rig's own modules unload and load again cleanly (the console is checked for splats by
//! the host). Runs last: it leaves the modules loaded as the init did.

use std::ffi::CString;
use std::fs::File;
use std::path::Path;

use anyhow::{Context, bail};
use fgds_tests::guest;
use fgds_tests::ktap::{self, Case, CaseResult};

fn main() {
    ktap::run(&[Case {
        name: "unload_and_reload",
        run: unload_and_reload,
    }])
}

fn module_name(path: &str) -> String {
    let file = Path::new(path)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    file.replace('-', "_")
}

fn unload_and_reload() -> CaseResult {
    let rig = guest::rig_modules()?
        .into_iter()
        .filter(|(path, _)| path.contains("/rig/"))
        .collect::<Vec<_>>();
    if rig.is_empty() {
        return ktap::skip("the init loaded none of the rig's modules");
    }
    for (path, _) in rig.iter().rev() {
        let name = module_name(path);
        let cname = CString::new(name.clone())?;
        rustix::system::delete_module(&cname, 0)
            .with_context(|| format!("cannot unload {name}"))?;
        if Path::new("/sys/module").join(&name).exists() {
            bail!("/sys/module/{name} still exists after unloading it");
        }
    }
    for (path, params) in &rig {
        let file = File::open(path).with_context(|| format!("cannot open {path}"))?;
        let params = CString::new(params.as_str())?;
        rustix::system::finit_module(&file, &params, 0)
            .with_context(|| format!("cannot load {path}"))?;
        let name = module_name(path);
        if !Path::new("/sys/module").join(&name).exists() {
            bail!("/sys/module/{name} is missing after loading {path}");
        }
    }
    ktap::pass()
}

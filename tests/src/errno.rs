//! Errno names for skip reasons and diagnostics: a test that skips because the kernel refused
//! something starts its reason with the errno's name (`EREMOTEIO: ...`), and the host's
//! expected-outcome table (xtask/src/expected.rs) names the errno it allows there.

/// The symbolic name of `errno` (`EREMOTEIO`), or `errno N` for one not listed here.
pub fn name(errno: i32) -> String {
    let known = [
        (libc::EPERM, "EPERM"),
        (libc::ENOENT, "ENOENT"),
        (libc::EINTR, "EINTR"),
        (libc::EIO, "EIO"),
        (libc::ENXIO, "ENXIO"),
        (libc::EBADF, "EBADF"),
        (libc::EAGAIN, "EAGAIN"),
        (libc::ENOMEM, "ENOMEM"),
        (libc::EACCES, "EACCES"),
        (libc::EFAULT, "EFAULT"),
        (libc::EBUSY, "EBUSY"),
        (libc::EEXIST, "EEXIST"),
        (libc::ENODEV, "ENODEV"),
        (libc::EINVAL, "EINVAL"),
        (libc::EMFILE, "EMFILE"),
        (libc::ENOTTY, "ENOTTY"),
        (libc::EFBIG, "EFBIG"),
        (libc::ENOSPC, "ENOSPC"),
        (libc::ERANGE, "ERANGE"),
        (libc::ENOSYS, "ENOSYS"),
        (libc::ENODATA, "ENODATA"),
        (libc::EOVERFLOW, "EOVERFLOW"),
        (libc::EOPNOTSUPP, "EOPNOTSUPP"),
        (libc::ETIMEDOUT, "ETIMEDOUT"),
        (libc::EREMOTEIO, "EREMOTEIO"),
    ];
    known
        .iter()
        .find(|(n, _)| *n == errno)
        .map_or_else(|| format!("errno {errno}"), |(_, name)| (*name).to_owned())
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_known_and_unknown_errnos() {
        assert_eq!(super::name(libc::EREMOTEIO), "EREMOTEIO");
        assert_eq!(super::name(libc::EOPNOTSUPP), "EOPNOTSUPP");
        assert_eq!(super::name(4242), "errno 4242");
    }
}

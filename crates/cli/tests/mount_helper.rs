//! `mount -t fuse.kochab` and /etc/fstab lines, through `scripts/mount.fuse.kochab` (the
//! mount(8) helper), as an administrator would use them.

mod common;

use common::{ServerProc, is_mounted, kochab_bin};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The helper installed for this test run under a type of its own
/// (`fuse.kochabtest<pid>`), removed again when dropped.
struct Helper {
    path: PathBuf,
    fstype: String,
}

impl Helper {
    fn install() -> Helper {
        let subtype = format!("kochabtest{}", std::process::id());
        let path = PathBuf::from(format!("/sbin/mount.fuse.{subtype}"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mount.fuse.kochab");
        std::fs::copy(&script, &path).expect("install the mount helper");
        Helper {
            path,
            fstype: format!("fuse.{subtype}"),
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs mount(8) with `args`; the helper finds the kochab binary under test by KOCHAB_BIN.
fn mount(args: &[&str]) -> std::process::Output {
    Command::new("mount")
        .args(args)
        .env("KOCHAB_BIN", kochab_bin())
        .output()
        .expect("mount(8)")
}

fn umount(dir: &Path) {
    let out = Command::new("umount").arg(dir).output().expect("umount");
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn mount_t_fuse_kochab_and_an_fstab_line_mount_the_cluster() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = ServerProc::start(&dir.path().join("data"), &[]);
    let key = dir.path().join("data/cluster.key");
    let helper = Helper::install();
    let addr = server.addr.to_string();

    // mount -t fuse.kochab SOURCE DIR -o OPTIONS
    let mnt = dir.path().join("m1");
    std::fs::create_dir_all(&mnt).expect("mountpoint");
    let opts = format!(
        "noatime,_netdev,keyfile={},log={}",
        key.display(),
        dir.path().join("m1.log").display()
    );
    let out = mount(&[
        "-t",
        &helper.fstype,
        &addr,
        mnt.to_str().expect("utf8"),
        "-o",
        &opts,
    ]);
    assert!(out.status.success(), "mount -t: {out:?}");
    assert!(is_mounted(&mnt), "mounted");
    std::fs::write(mnt.join("hello"), b"through mount(8)").expect("write");
    let line = std::fs::read_to_string("/proc/self/mounts")
        .expect("mounts")
        .lines()
        .find(|l| l.contains(mnt.to_str().expect("utf8")))
        .map(str::to_string)
        .expect("in /proc/self/mounts");
    assert!(line.contains("nosuid") && line.contains("nodev"), "{line}");

    // An fstab line, with mount(8)'s and systemd's own options.
    let mnt2 = dir.path().join("m2");
    std::fs::create_dir_all(&mnt2).expect("mountpoint");
    let fstab = dir.path().join("fstab");
    std::fs::write(
        &fstab,
        format!(
            "# kochab\n{addr} {} {} ro,noatime,nofail,x-systemd.automount,keyfile={},log={} 0 0\n",
            mnt2.display(),
            helper.fstype,
            key.display(),
            dir.path().join("m2.log").display()
        ),
    )
    .expect("fstab");
    let out = mount(&[
        "-T",
        fstab.to_str().expect("utf8"),
        mnt2.to_str().expect("utf8"),
    ]);
    assert!(out.status.success(), "mount from fstab: {out:?}");
    assert!(is_mounted(&mnt2), "mounted from fstab");
    assert_eq!(
        std::fs::read(mnt2.join("hello")).expect("read through the second mount"),
        b"through mount(8)"
    );
    let e = std::fs::write(mnt2.join("nope"), b"x").expect_err("ro");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");

    umount(&mnt2);
    umount(&mnt);
    assert!(!is_mounted(&mnt) && !is_mounted(&mnt2));
}

#[test]
fn the_systemd_mount_unit_example_verifies() {
    let unit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mnt-kochab.mount");
    let dir = tempfile::tempdir().expect("tempdir");
    // systemd-analyze wants the unit's name to match its path (/mnt/kochab).
    let copy = dir.path().join("mnt-kochab.mount");
    std::fs::copy(&unit, &copy).expect("copy the unit");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&copy)
        .output()
        .expect("systemd-analyze (Debian package systemd)");
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {out:?}"
    );
}

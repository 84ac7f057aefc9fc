//! File data on the store on S3 (Ceph RGW): `kochab up --store s3://...` keeps it as slice
//! objects in the bucket, not in its local directory, so a server restarted on a NEW local
//! directory (another host, as far as the data is concerned) serves every byte that was
//! acknowledged (fsync returned) before it was SIGKILLed.
//!
//! Needs a running RGW: `KOCHAB_S3_ENV=$(scripts/ceph-rgw.sh up)` names its env file.
//! Without it this test fails, unless KOCHAB_S3_TESTS=0 says to skip it.

mod common;

use common::s3::{rgw_location, up};
use common::{Rng, force_unmount};
use kochab_s3store::{S3Settings, S3Store};
use kochab_store::ObjectStore;
use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// What each file must read as.
struct Expect {
    name: &'static str,
    bytes: Vec<u8>,
}

fn model_write(m: &mut Vec<u8>, offset: usize, data: &[u8]) {
    if m.len() < offset + data.len() {
        m.resize(offset + data.len(), 0);
    }
    m[offset..offset + data.len()].copy_from_slice(data);
}

/// Writes the files through the mount, each fsync'd (acknowledged), and returns what they
/// must read as.
fn write_files(mnt: &Path, rng: &mut Rng) -> Vec<Expect> {
    let mut out = Vec::new();
    // Across chunks (4 MiB) in 1 MiB writes, not chunk-aligned at the end.
    let big = rng.bytes((9 << 20) + 123);
    let mut f = fs::File::create(mnt.join("big")).unwrap();
    for part in big.chunks(1 << 20) {
        f.write_all(part).unwrap();
    }
    f.sync_all().unwrap();
    out.push(Expect {
        name: "big",
        bytes: big,
    });
    // Overwritten, truncated into a chunk, extended again (the cut bytes read as zeros),
    // and a far write after a hole.
    let mut m = Vec::new();
    let f = fs::File::create(mnt.join("cut")).unwrap();
    let first = rng.bytes(6 << 20);
    f.write_all_at(&first, 0).unwrap();
    model_write(&mut m, 0, &first);
    let over = rng.bytes(300_000);
    f.write_all_at(&over, 4_000_000).unwrap();
    model_write(&mut m, 4_000_000, &over);
    f.set_len((3 << 20) + 7).unwrap();
    m.truncate((3 << 20) + 7);
    f.set_len(5 << 20).unwrap();
    m.resize(5 << 20, 0);
    f.write_all_at(b"far", 20 << 20).unwrap();
    model_write(&mut m, 20 << 20, b"far");
    f.sync_all().unwrap();
    out.push(Expect {
        name: "cut",
        bytes: m,
    });
    // Many small overlapping writes into one chunk (compaction merges them).
    let mut m = vec![0u8; 1 << 20];
    let f = fs::File::create(mnt.join("small-writes")).unwrap();
    f.set_len(1 << 20).unwrap();
    for _ in 0..200 {
        let off = rng.below((1 << 20) - 5000) as usize;
        let n = 1 + rng.below(5000) as usize;
        let d = rng.bytes(n);
        f.write_all_at(&d, off as u64).unwrap();
        f.sync_data().unwrap();
        model_write(&mut m, off, &d);
    }
    out.push(Expect {
        name: "small-writes",
        bytes: m,
    });
    let mut f = fs::File::create(mnt.join("tiny")).unwrap();
    f.write_all(b"hello").unwrap();
    f.sync_all().unwrap();
    out.push(Expect {
        name: "tiny",
        bytes: b"hello".to_vec(),
    });
    out
}

fn check_files(mnt: &Path, files: &[Expect], what: &str) {
    for e in files {
        let got = fs::read(mnt.join(e.name)).unwrap();
        assert_eq!(got.len(), e.bytes.len(), "{what}: size of {}", e.name);
        if let Some(at) = got.iter().zip(&e.bytes).position(|(a, b)| a != b) {
            panic!("{what}: {} differs first at byte {at}", e.name);
        }
    }
}

#[test]
fn file_data_on_rgw_survives_a_sigkill_and_a_new_local_directory() {
    let Some((env_file, location)) = rgw_location("data") else {
        return;
    };
    let url = location.to_string();
    let dir = tempfile::tempdir().unwrap();
    let (data_a, mnt_a) = (dir.path().join("a/data"), dir.path().join("a/mnt"));
    let mut rng = Rng::new(common::seed("s3_data"));
    let mut server = up(&data_a, &mnt_a, &url, &env_file);
    let files = write_files(&mnt_a, &mut rng);
    check_files(&mnt_a, &files, "before the kill");
    server.kill9();
    force_unmount(&mnt_a);
    assert!(
        !data_a.join("store/data").exists(),
        "no file data in the local directory"
    );

    // The data is in the bucket, as slice objects.
    let vars = kochab_s3store::read_settings_file(&env_file).unwrap();
    let s3 = S3Store::open(&location, &S3Settings::from_vars(&vars).unwrap()).unwrap();
    let slices = count_slices(&s3);
    assert!(slices >= 5, "slices in the bucket: {slices}");

    // Another local directory: only the store is shared, and the cluster key, copied as
    // to a new host (the store checks it).
    let (data_b, mnt_b) = (dir.path().join("b/data"), dir.path().join("b/mnt"));
    fs::create_dir_all(&data_b).unwrap();
    fs::copy(data_a.join("cluster.key"), data_b.join("cluster.key")).unwrap();
    let mut server = up(&data_b, &mnt_b, &url, &env_file);
    check_files(&mnt_b, &files, "after the kill, on a new local directory");
    // It writes on from there: a rewrite wins over the old slices.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(mnt_b.join("tiny"))
        .unwrap();
    f.write_all_at(b"J", 0).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(fs::read(mnt_b.join("tiny")).unwrap(), b"Jello");
    // Deleting a file deletes its slices (in the background, once the unlink is durable):
    // big's folder of slices goes, and only big is removed, so the folder that goes is its.
    let before = slice_folders(&s3);
    fs::remove_file(mnt_b.join("big")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let after = slice_folders(&s3);
        let gone: Vec<_> = before.keys().filter(|f| !after.contains_key(*f)).collect();
        if let [folder] = gone[..] {
            assert!(before[folder] >= 1, "{folder} held no slices");
            break;
        }
        assert!(
            gone.len() <= 1,
            "folders of files not removed went: {gone:?}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "big's slices are still there after the unlink: {after:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(server.stop(), Some(0), "{}", server.log_text());
    force_unmount(&mnt_b);
}

/// Slice objects under the store's `data/`.
fn count_slices(s3: &S3Store) -> usize {
    s3.list("data")
        .unwrap()
        .iter()
        .flat_map(|shard| s3.list(shard).unwrap())
        .filter(|f| f.ends_with(".s"))
        .map(|f| s3.list(&f).unwrap().len())
        .sum()
}

/// Each folder of slices (one per file generation) and the objects in it.
fn slice_folders(s3: &S3Store) -> std::collections::BTreeMap<String, usize> {
    s3.list("data")
        .unwrap()
        .iter()
        .flat_map(|shard| s3.list(shard).unwrap())
        .filter(|f| f.ends_with(".s"))
        .map(|f| {
            let n = s3.list(&f).unwrap().len();
            (f, n)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

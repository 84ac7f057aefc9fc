//! Two mounts of one server, random namespace and data operations on either, and after
//! each one the *other* mount must show exactly what a model says (no sleep in between:
//! the callbacks make it so, docs/ARCHITECTURE.md "Coherent caching between mounts").
//! Both mounts look up names that do not exist yet, so negative entries are cached on
//! both and must be dropped. Files are also written through descriptors kept open across
//! steps (the writer's mount holds such writes back). Seeds are fixed: a failure names its
//! seed and step.

mod common;

use common::{MountProc, ServerProc};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq)]
enum Node {
    File(Vec<u8>, u32),
    Dir(u32),
    Link(String),
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, of: &'a [T]) -> &'a T {
        &of[self.below(of.len())]
    }
    /// A name of one of the test's directories.
    fn path(&mut self) -> String {
        let (d, n) = (*self.pick(&DIRS), *self.pick(&NAMES));
        if d.is_empty() {
            n.to_string()
        } else {
            format!("{d}/{n}")
        }
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = 1 + self.below(max);
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const DIRS: [&str; 4] = ["", "d1", "d2", "d1/e"];
const NAMES: [&str; 4] = ["a", "b", "c", "x"];

fn parent(rel: &str) -> &str {
    rel.rsplit_once('/').map_or("", |(p, _)| p)
}

fn join(root: &Path, rel: &str) -> PathBuf {
    if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(rel)
    }
}

/// What `root` shows under every directory of the model, compared with it.
fn check(model: &BTreeMap<String, Node>, root: &Path, what: &str) {
    for (rel, node) in model {
        if !matches!(node, Node::Dir(_)) {
            continue;
        }
        let mut seen: Vec<String> = fs::read_dir(join(root, rel))
            .unwrap_or_else(|e| panic!("{what}: list {rel:?}: {e}"))
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        seen.sort();
        let want: Vec<String> = model
            .keys()
            .filter(|k| !k.is_empty() && *k != rel && parent(k) == rel)
            .map(|k| k.rsplit('/').next().unwrap_or(k).to_string())
            .collect();
        assert_eq!(seen, want, "{what}: listing of {rel:?}");
        // Every name that may be asked for there, present or absent (absences get cached).
        for name in NAMES.iter().chain(&["d1", "d2", "e", "zz"]) {
            let child = if rel.is_empty() {
                name.to_string()
            } else {
                format!("{rel}/{name}")
            };
            let path = join(root, &child);
            let got = fs::symlink_metadata(&path);
            match (model.get(&child), got) {
                (None, Err(_)) => {}
                (None, Ok(_)) => panic!("{what}: {child} present"),
                (Some(_), Err(e)) => panic!("{what}: {child} missing: {e}"),
                (Some(Node::File(data, mode)), Ok(m)) => {
                    assert!(m.is_file(), "{what}: {child} not a file");
                    assert_eq!(m.len(), data.len() as u64, "{what}: size of {child}");
                    assert_eq!(
                        m.permissions().mode() & 0o777,
                        *mode,
                        "{what}: mode of {child}"
                    );
                    assert_eq!(
                        &fs::read(&path).expect("read"),
                        data,
                        "{what}: data of {child}"
                    );
                }
                (Some(Node::Dir(mode)), Ok(m)) => {
                    assert!(m.is_dir(), "{what}: {child} not a directory");
                    assert_eq!(
                        m.permissions().mode() & 0o777,
                        *mode,
                        "{what}: mode of {child}"
                    );
                }
                (Some(Node::Link(target)), Ok(m)) => {
                    assert!(m.file_type().is_symlink(), "{what}: {child} not a symlink");
                    let t = fs::read_link(&path).expect("readlink");
                    assert_eq!(t.to_string_lossy(), *target, "{what}: target of {child}");
                }
            }
        }
    }
}

/// Files a side keeps open for writing between steps (its mount may hold their writes
/// back), by path; both sides close theirs at any step that moves or removes names.
type Held = BTreeMap<String, fs::File>;

/// One random operation on `root`, applied to the model too: what it did (empty if the
/// drawn operation made no sense there and was skipped).
fn step(
    rng: &mut Rng,
    model: &mut BTreeMap<String, Node>,
    root: &Path,
    held: &mut [Held; 2],
    side: usize,
) -> String {
    let rel = rng.path();
    if !matches!(model.get(parent(&rel)), Some(Node::Dir(_))) {
        return String::new();
    }
    let p = join(root, &rel);
    let is_dir = |m: &BTreeMap<String, Node>, k: &str| matches!(m.get(k), Some(Node::Dir(_)));
    let op = *rng.pick(&[
        "write", "write", "append", "truncate", "unlink", "rename", "rename", "mkdir", "rmdir",
        "chmod", "symlink", "pwrite", "pwrite",
    ]);
    if matches!(op, "unlink" | "rename" | "rmdir" | "mkdir" | "symlink") {
        held.iter_mut().for_each(Held::clear);
    }
    let held = &mut held[side];
    match op {
        "pwrite" => {
            // Through a descriptor kept open: small writes the mount may hold back.
            let Some(Node::File(data, _)) = model.get_mut(&rel) else {
                return String::new();
            };
            if !held.contains_key(&rel) {
                let f = fs::OpenOptions::new().write(true).open(&p).expect("open");
                held.insert(rel.clone(), f);
            }
            let at = rng.below(data.len() + 50);
            let more = rng.bytes(2000);
            let f = held.get(&rel).expect("held");
            std::os::unix::fs::FileExt::write_all_at(f, &more, at as u64).expect("pwrite");
            if data.len() < at + more.len() {
                data.resize(at + more.len(), 0);
            }
            data[at..at + more.len()].copy_from_slice(&more);
        }
        "write" => {
            if matches!(model.get(&rel), Some(Node::Dir(_) | Node::Link(_))) {
                return String::new();
            }
            let data = rng.bytes(5000);
            fs::write(&p, &data).expect("write");
            let mode = match model.get(&rel) {
                Some(Node::File(_, m)) => *m,
                _ => 0o644,
            };
            model.insert(rel.clone(), Node::File(data, mode));
        }
        "append" => {
            let Some(Node::File(data, _)) = model.get_mut(&rel) else {
                return String::new();
            };
            let more = rng.bytes(300);
            let mut f = fs::OpenOptions::new().append(true).open(&p).expect("open");
            f.write_all(&more).expect("append");
            data.extend_from_slice(&more);
        }
        "truncate" => {
            let Some(Node::File(data, _)) = model.get_mut(&rel) else {
                return String::new();
            };
            let n = rng.below(data.len() + 100);
            fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .expect("open")
                .set_len(n as u64)
                .expect("truncate");
            data.resize(n, 0);
        }
        "unlink" => {
            if !matches!(model.get(&rel), Some(Node::File(..) | Node::Link(_))) {
                return String::new();
            }
            fs::remove_file(&p).expect("unlink");
            model.remove(&rel);
        }
        "mkdir" => {
            if model.contains_key(&rel) || rel.matches('/').count() > 1 {
                return String::new();
            }
            fs::create_dir(&p).expect("mkdir");
            model.insert(rel.clone(), Node::Dir(0o755));
        }
        "rmdir" => {
            let empty = !model.keys().any(|k| parent(k) == rel && !k.is_empty());
            if !is_dir(model, &rel) || !empty || DIRS.contains(&rel.as_str()) {
                return String::new();
            }
            fs::remove_dir(&p).expect("rmdir");
            model.remove(&rel);
        }
        "chmod" => {
            let mode = *rng.pick(&[0o600, 0o644, 0o755, 0o700]);
            match model.get_mut(&rel) {
                Some(Node::File(_, m)) | Some(Node::Dir(m)) => *m = mode,
                _ => return String::new(),
            }
            fs::set_permissions(&p, fs::Permissions::from_mode(mode)).expect("chmod");
        }
        "symlink" => {
            if model.contains_key(&rel) {
                return String::new();
            }
            let target = rng.pick(&["a", "../x", "nowhere"]).to_string();
            std::os::unix::fs::symlink(&target, &p).expect("symlink");
            model.insert(rel.clone(), Node::Link(target));
        }
        _ => {
            // rename src -> rel, over an empty directory or a non-directory of its kind
            let src = rng.path();
            let movable = model.contains_key(&src)
                && src != rel
                && !DIRS.contains(&src.as_str())
                && !DIRS.contains(&rel.as_str())
                && !rel.starts_with(&format!("{src}/"));
            if !movable {
                return String::new();
            }
            if model.contains_key(&rel) {
                let target_empty = !model.keys().any(|k| parent(k) == rel && !k.is_empty());
                if is_dir(model, &src) != is_dir(model, &rel) || !target_empty {
                    return String::new();
                }
            }
            fs::rename(join(root, &src), &p).expect("rename");
            let moved: Vec<(String, Node)> = model
                .iter()
                .filter(|(k, _)| *k == &src || k.starts_with(&format!("{src}/")))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            model.retain(|k, _| k != &rel && !k.starts_with(&format!("{rel}/")));
            for (k, v) in moved {
                model.remove(&k);
                model.insert(format!("{rel}{}", &k[src.len()..]), v);
            }
            return format!("rename {src} -> {rel}");
        }
    }
    format!("{op} {rel}")
}

#[test]
fn random_operations_on_two_mounts_are_seen_on_the_other_at_once() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let server = ServerProc::start(&data, &[]);
    let key = data.join("cluster.key");
    let a = MountProc::start(server.addr, &key, &tmp.path().join("a"));
    let b = MountProc::start(server.addr, &key, &tmp.path().join("b"));
    for seed in [1u64, 2, 3, 4] {
        let top = format!("t{seed}");
        fs::create_dir(a.mnt.join(&top)).expect("mkdir");
        let roots = [a.mnt.join(&top), b.mnt.join(&top)];
        let mut model = BTreeMap::from([(String::new(), Node::Dir(0o755))]);
        for d in &DIRS[1..] {
            fs::create_dir(roots[0].join(d)).expect("mkdir");
            model.insert(d.to_string(), Node::Dir(0o755));
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        let mut held = [Held::new(), Held::new()];
        for n in 0..800 {
            let side = rng.below(2);
            let done = step(&mut rng, &mut model, &roots[side], &mut held, side);
            if done.is_empty() {
                continue;
            }
            let what = format!("seed {seed} step {n} ({done} on {})", ["a", "b"][side]);
            check(
                &model,
                &roots[1 - side],
                &format!("{what}, seen on the other"),
            );
            if n % 7 == 0 {
                check(&model, &roots[side], &format!("{what}, seen on the same"));
            }
        }
    }
    drop((a, b));
}

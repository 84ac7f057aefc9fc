//! What one simulated client knows of its own directories: every name it was answered for.
//! Nobody else changes them, so the model predicts each reply exactly, and after any crash
//! the server's directories must read as the model does: an acknowledged change lost, or one
//! applied twice, shows up as a difference.

use std::collections::BTreeMap;

use kochab_cluster::sim::Rng;
use kochab_proto::{Errno, FileKind, InodeId, Op, Reply, mode};

/// The names a client uses in each of its directories: few, so that operations collide
/// (create over an existing name, rename onto one, unlink of one just renamed away).
pub const NAMES: [&str; 6] = ["a", "b", "c", "d", "e", "f"];

/// The directories a client works in: two of its own, and the one all clients share
/// (there with names of its own: every client's changes meet in one directory, and
/// its model still predicts each reply).
pub const DIRS: usize = 3;

/// Index of the directory all clients share.
pub const SHARED: usize = 2;

/// A name in one of the client's directories: (directory index, name).
pub type Place = (usize, &'static str);

/// What the server must answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A new entry of this kind (for a link: the linked inode).
    Entry { kind: FileKind, id: Option<InodeId> },
    /// Success with nothing to show.
    Done,
    /// This error.
    Fails(Errno),
}

/// How the names change once the reply is accepted.
#[derive(Clone, Copy, Debug)]
pub enum Change {
    None,
    /// A new name (its id comes with the reply).
    Add(Place, FileKind),
    Remove(Place),
    /// Moves a name, replacing what the target named.
    Move(Place, Place),
}

/// An exclusive create of a regular file with permissions `perm`.
fn mknod(parent: InodeId, name: Vec<u8>, perm: u32) -> Op {
    Op::Mknod {
        parent,
        name,
        mode: mode::S_IFREG | perm,
        rdev: 0,
        exclusive: true,
    }
}

/// One operation with its predicted outcome.
#[derive(Clone, Debug)]
pub struct Planned {
    pub op: Op,
    pub expect: Expect,
    pub change: Change,
}

/// The names of a client's directories, as its accepted replies made them.
#[derive(Clone, Debug, Default)]
pub struct Model {
    pub names: BTreeMap<Place, (InodeId, FileKind)>,
    /// What the client's names in the shared directory start with.
    pub shared_prefix: Vec<u8>,
}

impl Model {
    /// A client whose names in the shared directory start with `shared_prefix`.
    pub fn new(shared_prefix: &str) -> Model {
        Model {
            names: BTreeMap::new(),
            shared_prefix: shared_prefix.as_bytes().to_vec(),
        }
    }

    /// The name `at` stands for in its directory.
    pub fn name_of(&self, at: Place) -> Vec<u8> {
        match at.0 {
            SHARED => [self.shared_prefix.as_slice(), at.1.as_bytes()].concat(),
            _ => at.1.as_bytes().to_vec(),
        }
    }

    /// A random operation on the directories `dirs` (their inode ids), with what the server
    /// must answer.
    pub fn plan(&self, rng: &mut Rng, dirs: &[InodeId; DIRS]) -> Planned {
        let place = |rng: &mut Rng| -> Place {
            let d = rng.range(0, DIRS as u64 - 1) as usize;
            (d, NAMES[rng.range(0, NAMES.len() as u64 - 1) as usize])
        };
        let at = place(rng);
        let (parent, name) = (dirs[at.0], self.name_of(at));
        let here = self.names.get(&at).copied();
        match rng.range(0, 9) {
            0..=2 => self.create(mknod(parent, name, 0o644), at, here, FileKind::File),
            3 => {
                let op = Op::Mkdir {
                    parent,
                    name,
                    mode: 0o755,
                };
                self.create(op, at, here, FileKind::Dir)
            }
            4 => match here {
                Some((_, FileKind::Dir)) => Planned {
                    op: Op::Rmdir { parent, name },
                    expect: Expect::Done,
                    change: Change::Remove(at),
                },
                Some(_) => Planned {
                    op: Op::Unlink { parent, name },
                    expect: Expect::Done,
                    change: Change::Remove(at),
                },
                None => Planned {
                    op: Op::Unlink { parent, name },
                    expect: Expect::Fails(Errno::ENOENT),
                    change: Change::None,
                },
            },
            5..=7 => {
                let to = place(rng);
                let target = self.names.get(&to).copied();
                let op = Op::Rename {
                    parent,
                    name,
                    new_parent: dirs[to.0],
                    new_name: self.name_of(to),
                    flags: 0,
                };
                let (expect, change) = match (here, target) {
                    (None, _) => (Expect::Fails(Errno::ENOENT), Change::None),
                    // Two names of one inode (or a name onto itself): nothing happens.
                    (Some((a, _)), Some((b, _))) if a == b => (Expect::Done, Change::None),
                    (Some((_, FileKind::Dir)), Some((_, k))) if k != FileKind::Dir => {
                        (Expect::Fails(Errno::ENOTDIR), Change::None)
                    }
                    (Some((_, k)), Some((_, FileKind::Dir))) if k != FileKind::Dir => {
                        (Expect::Fails(Errno::EISDIR), Change::None)
                    }
                    _ => (Expect::Done, Change::Move(at, to)),
                };
                Planned { op, expect, change }
            }
            _ => {
                // A hard link of a file of ours under another name.
                let files: Vec<(Place, InodeId)> = self
                    .names
                    .iter()
                    .filter(|(_, (_, k))| *k == FileKind::File)
                    .map(|(p, (id, _))| (*p, *id))
                    .collect();
                let Some(&(_, id)) =
                    files.get(rng.range(0, files.len().max(1) as u64 - 1) as usize)
                else {
                    let op = mknod(parent, name, 0o600);
                    return self.create(op, at, here, FileKind::File);
                };
                let op = Op::Link {
                    id,
                    new_parent: parent,
                    new_name: name,
                };
                self.new_name(op, at, here, FileKind::File, Some(id))
            }
        }
    }

    fn create(
        &self,
        op: Op,
        at: Place,
        here: Option<(InodeId, FileKind)>,
        kind: FileKind,
    ) -> Planned {
        self.new_name(op, at, here, kind, None)
    }

    /// An operation that makes the name `at` (currently `here`) for an inode of `kind`:
    /// a new one, or `linked`.
    fn new_name(
        &self,
        op: Op,
        at: Place,
        here: Option<(InodeId, FileKind)>,
        kind: FileKind,
        linked: Option<InodeId>,
    ) -> Planned {
        match here {
            Some(_) => Planned {
                op,
                expect: Expect::Fails(Errno::EEXIST),
                change: Change::None,
            },
            None => Planned {
                op,
                expect: Expect::Entry { kind, id: linked },
                change: Change::Add(at, kind),
            },
        }
    }

    /// Checks `reply` against what `p` predicts; `Ok` with the inode it created, if any.
    pub fn check(p: &Planned, reply: &Reply) -> Result<Option<InodeId>, String> {
        let reply = reply.clone().without_dirs();
        match (p.expect, &reply) {
            (Expect::Entry { kind, id }, Reply::Entry(a))
                if a.kind() == Some(kind) && id.is_none_or(|id| id == a.id) =>
            {
                Ok(Some(a.id))
            }
            (Expect::Done, Reply::Empty) => Ok(None),
            (Expect::Fails(e), Reply::Error(got)) if got.errno == e => Ok(None),
            _ => Err(format!(
                "{} answered {reply:?}, expected {:?}",
                p.op.name(),
                p.expect
            )),
        }
    }

    /// Takes in the change of an accepted reply (`created`: the inode it made).
    pub fn apply(&mut self, change: Change, created: Option<InodeId>) {
        match change {
            Change::None => {}
            Change::Add(at, kind) => {
                if let Some(id) = created {
                    self.names.insert(at, (id, kind));
                }
            }
            Change::Remove(at) => {
                self.names.remove(&at);
            }
            Change::Move(from, to) => {
                if let Some(e) = self.names.remove(&from) {
                    self.names.insert(to, e);
                }
            }
        }
    }
}

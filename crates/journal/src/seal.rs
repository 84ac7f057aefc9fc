//! Sealing a journal, in either of its forms (segments written in place, or objects on a
//! store without positioned I/O): above both, so that neither imports the other.

use crate::segment::{JournalId, is_sealed};
use kochab_store::ObjectStore;
use std::io;

/// Seals journal `id`: creates its seal object (if nobody did yet). From then on its writer
/// acknowledges nothing: every record it acknowledged was durable before the seal existed,
/// so a reader that reads the journal after this returns sees all of them. On a store of
/// whole objects the journal's chain is fenced first (see `objects`): there the writer never
/// looks at the seal object, which only tells everyone else that the journal is sealed.
pub fn seal(store: &dyn ObjectStore, id: JournalId) -> io::Result<()> {
    if !store.positioned_io() && !is_sealed(store, id)? {
        crate::objects::fence(store, id)?;
    }
    match store.create_if_absent(&id.seal_name(), b"") {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

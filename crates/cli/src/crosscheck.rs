//! The online check of links between tables of different servers (part of `kochab fsck`
//! of a running cluster): every server's cross-server facts, gathered page by page and
//! checked together by `kochab_meta::links::check_cluster`.
//!
//! The servers are asked one after another while the namespace may change, so an
//! operation that crosses servers can fall between two answers (a hard link seen at the
//! directory's server but not yet at the file's) and look like a problem. Problems are
//! therefore looked at twice: a found problem counts only if a second, complete gather
//! after [`RECHECK_PAUSE`] shows it again.

use kochab_client::Client;
use kochab_meta::links::{ClusterLinks, check_cluster};
use kochab_proto::cluster::ServerId;
use kochab_proto::links::{FSCK_IDS_MAX, LinksCursor};
use std::collections::HashSet;
use std::time::Duration;

/// Pause before the second look: an operation in flight during the first (a few round
/// trips between two servers, or a borrow and its return) has ended by then.
pub const RECHECK_PAUSE: Duration = Duration::from_secs(1);

/// Pages asked of one server at most: at 2 MiB a page, far beyond what any server holds,
/// so only a server whose cursor never ends is stopped by it.
const PAGES_MAX: usize = 1 << 16;

/// What the check found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Problems seen by both looks.
    pub problems: Vec<String>,
    /// Problems the first look saw and the second did not (the namespace changed).
    pub passed: usize,
    /// Cross entries and inode facts of the last look.
    pub entries: usize,
    pub inodes: usize,
}

/// Checks the links between the tables of `servers` (every server holding tables).
pub async fn check(servers: &[(ServerId, &Client)]) -> Result<Outcome, String> {
    let links = gather(servers).await?;
    let first = check_cluster(&links);
    if first.is_empty() {
        return Ok(Outcome {
            entries: links.entries.len(),
            inodes: links.inodes.len(),
            ..Outcome::default()
        });
    }
    tokio::time::sleep(RECHECK_PAUSE).await;
    let links = gather(servers).await?;
    let second: HashSet<String> = check_cluster(&links).into_iter().collect();
    let (problems, passed): (Vec<String>, Vec<String>) =
        first.into_iter().partition(|p| second.contains(p));
    Ok(Outcome {
        problems,
        passed: passed.len(),
        entries: links.entries.len(),
        inodes: links.inodes.len(),
    })
}

/// Every server's pages, then the facts of the inodes cross entries name that no page
/// reported (asked of every server: each answers for those its tables hold).
async fn gather(servers: &[(ServerId, &Client)]) -> Result<ClusterLinks, String> {
    let mut links = ClusterLinks::default();
    for (id, c) in servers {
        let mut after = LinksCursor::Start;
        let mut pages = 0;
        loop {
            let page = c
                .fsck_links(after)
                .await
                .map_err(|e| format!("server {}: cross-server facts: {e}", id.0))?;
            links.entries.extend(page.entries);
            links.inodes.extend(page.inodes);
            pages += 1;
            match page.next {
                None => break,
                Some(next) if next == after || pages >= PAGES_MAX => {
                    return Err(format!(
                        "server {}: its cross-server facts do not end (page {pages} \
                         continues at {next:?})",
                        id.0
                    ));
                }
                Some(next) => after = next,
            }
        }
    }
    let unknown = links.unknown();
    for chunk in unknown.chunks(FSCK_IDS_MAX) {
        for (id, c) in servers {
            let found = c
                .fsck_inodes(chunk.to_vec())
                .await
                .map_err(|e| format!("server {}: inode facts: {e}", id.0))?;
            links.inodes.extend(found);
        }
    }
    Ok(links)
}

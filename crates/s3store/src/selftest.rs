//! The engine self-test run at start: conditional create, on which fencing rests, must be
//! honoured, or the store is refused with what the engine answered.

use crate::{Remote, answer, new_token};
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Folder of the probe objects (under the store's prefix).
pub const PROBE_DIR: &str = "kochab-selftest";
/// Racing creators of one probe: enough that an engine without atomic conditional create
/// lets two through (8 racers on RGW over 50 rounds always had exactly one winner), few
/// enough to cost one round trip at start.
pub const RACERS: usize = 8;

/// What the self-test found, one line per check, for the log.
#[derive(Debug, Clone)]
pub struct SelfTest {
    pub lines: Vec<String>,
}

impl std::fmt::Display for SelfTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.lines.join("; "))
    }
}

const FIRST: &[u8] = b"kochab self-test: the first write";
const SECOND: &[u8] = b"kochab self-test: a second write";

/// Runs the checks on fresh probe names and deletes the probes whatever happened.
pub(crate) async fn run(r: &Remote) -> Result<SelfTest, String> {
    let base = match new_token() {
        Ok(t) => format!("{PROBE_DIR}/{t}"),
        Err(e) => return Err(e.to_string()),
    };
    let (once, race) = (format!("{base}.once"), format!("{base}.race"));
    let result = checks(r, &once, &race).await;
    for n in [&once, &race] {
        if let Err(e) = r.delete(n).await {
            tracing::warn!("self-test probe {n} not deleted: {e}");
        }
    }
    result.map(|lines| SelfTest { lines })
}

async fn checks(r: &Remote, once: &str, race: &str) -> Result<Vec<String>, String> {
    let fail = |what: String| format!("{}: {what}", r.name);
    let token = new_token().map_err(|e| e.to_string())?;
    if let Err(e) = r.create_raw(once, Bytes::from_static(FIRST), &token).await {
        return Err(fail(format!(
            "a conditional create (PUT with If-None-Match: *) of the new object {once} \
             failed: {}",
            answer(&e)
        )));
    }
    let other = new_token().map_err(|e| e.to_string())?;
    let second = r.create_raw(once, Bytes::from_static(SECOND), &other).await;
    let now = r
        .get(once)
        .await
        .map_err(|e| fail(format!("reading the probe {once} back failed: {e}")))?;
    let mut lines = Vec::new();
    match (&second, now.as_deref()) {
        (Ok(()), now) => {
            return Err(fail(format!(
                "the engine does not honour conditional create: a second create of {once} \
                 (PUT with If-None-Match: *) was accepted with a 2xx answer{}; fencing rests \
                 on that refusal, so this engine cannot hold Kochab's state",
                if now == Some(SECOND) {
                    " and replaced the object"
                } else {
                    ""
                }
            )));
        }
        (Err(e), Some(FIRST)) => lines.push(format!(
            "a second create of one object was refused ({})",
            answer(e)
        )),
        (Err(e), _) => {
            return Err(fail(format!(
                "after a second conditional create of {once} (answered {}) the object does \
                 not hold the first write any more",
                answer(e)
            )));
        }
    }

    // The racers use the same path as the servers, answers settled by reading back.
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let mut racers = tokio::task::JoinSet::new();
    for k in 0..RACERS {
        let (r, race, barrier) = (r.clone(), race.to_string(), barrier.clone());
        let token = new_token().map_err(|e| e.to_string())?;
        racers.spawn(async move {
            let data = Bytes::from(format!("kochab self-test: racer {k}").into_bytes());
            barrier.wait().await;
            let a = r.create(&race, data, &token).await;
            (k, a.result, a.answer)
        });
    }
    let mut winners = Vec::new();
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    while let Some(joined) = racers.join_next().await {
        let (k, result, said) = joined.map_err(|e| fail(format!("a racer failed: {e}")))?;
        *answers.entry(said).or_default() += 1;
        match result {
            Ok(()) => winners.push(k),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => failures.push(e.to_string()),
        }
    }
    let said: Vec<String> = answers.iter().map(|(a, n)| format!("{n} x {a}")).collect();
    let said = said.join(", ");
    if let Some(f) = failures.first() {
        return Err(fail(format!(
            "{RACERS} racing conditional creates of {race}: {} failed outright (the engine \
             answered: {said}); the first: {f}",
            failures.len()
        )));
    }
    if winners.len() != 1 {
        return Err(fail(format!(
            "the engine does not honour conditional create: of {RACERS} racing creates of \
             {race}, {} succeeded where exactly one may (the engine answered: {said})",
            winners.len()
        )));
    }
    let expected = format!("kochab self-test: racer {}", winners[0]).into_bytes();
    let now = r
        .get(race)
        .await
        .map_err(|e| fail(format!("reading the probe {race} back failed: {e}")))?;
    if now.as_deref() != Some(expected.as_slice()) {
        return Err(fail(format!(
            "of {RACERS} racing conditional creates of {race} one succeeded, but the object \
             does not hold its write (the engine answered: {said})"
        )));
    }
    lines.push(format!(
        "of {RACERS} racing creates exactly one won (the engine answered: {said})"
    ));
    Ok(lines)
}

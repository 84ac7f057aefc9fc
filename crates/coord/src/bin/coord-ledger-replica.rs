//! Test tool: one coordinator replica holding a tiny ledger state, as its own process --
//! what `tests/process_kill.rs` SIGKILLs. Not part of Kochab's CLI. Usage:
//!
//! `coord-ledger-replica ID LISTEN DATA_DIR KEY_HEX BOOTSTRAP(0|1) [PEER_ID=ADDR ...]`

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use kochab_coord::wire::key_from_hex;
use kochab_coord::{ReplicaConfig, ReplicatedState, Timing, run_replica_until_signal};
use serde::{Deserialize, Serialize};

/// Uniquely numbered additions; a retried id is not applied twice.
#[derive(Clone, Default, Debug, Serialize, Deserialize)]
pub struct Ledger {
    /// Ids in applied order.
    pub order: Vec<u64>,
    /// Id to position.
    pub seen: BTreeMap<u64, u64>,
}

impl ReplicatedState for Ledger {
    type Command = u64;
    type Reply = (u64, bool);
    fn apply(&mut self, id: &u64) -> (u64, bool) {
        if let Some(&pos) = self.seen.get(id) {
            return (pos, false);
        }
        let pos = self.order.len() as u64;
        self.order.push(*id);
        self.seen.insert(*id, pos);
        (pos, true)
    }
}

fn parse() -> Result<ReplicaConfig, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        return Err(
            "usage: coord-ledger-replica ID LISTEN DATA_DIR KEY_HEX BOOTSTRAP [ID=ADDR ...]".into(),
        );
    }
    let id: u64 = args[0].parse().map_err(|e| format!("id: {e}"))?;
    let listen: SocketAddr = args[1].parse().map_err(|e| format!("listen: {e}"))?;
    let key = key_from_hex(&args[3]).ok_or("key: 64 hex digits")?;
    let mut peers = BTreeMap::new();
    for p in &args[5..] {
        let (i, a) = p.split_once('=').ok_or(format!("peer {p}: want ID=ADDR"))?;
        let i: u64 = i.parse().map_err(|e| format!("peer id {i}: {e}"))?;
        let a: SocketAddr = a.parse().map_err(|e| format!("peer addr {a}: {e}"))?;
        peers.insert(i, a);
    }
    Ok(ReplicaConfig {
        id,
        listen,
        peers,
        data_dir: PathBuf::from(&args[2]),
        key,
        bootstrap: args[4] == "1",
        timing: Timing {
            heartbeat_ms: 50,
            election_min_ms: 300,
            election_max_ms: 600,
            ..Timing::default()
        },
        tls: Default::default(),
    })
}

#[tokio::main]
async fn main() {
    let cfg = match parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("coord-ledger-replica: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run_replica_until_signal::<Ledger>(cfg).await {
        eprintln!("coord-ledger-replica: {e}");
        std::process::exit(1);
    }
}

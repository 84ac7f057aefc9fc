//! The coordinator proper: Kochab's [`CoordState`] replicated by a [`Replica`], and on the
//! leader the [`Driver`] that turns that state into control messages for metadata servers
//! and their answers into commands.
//!
//! The driver keeps nothing but retry timers, so a new leader (or a restarted group) builds
//! a fresh one and, from the replicated state alone, resumes every migration, recovery and
//! grant that was half done (Ursa Minor §3.7).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kochab_cluster::driver::{Driver, DriverAction, DriverConfig};
use kochab_cluster::state::CoordState;
use kochab_proto::cluster::{Control, ControlReply, CoordCommand, CoordReply};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::{Replica, ReplicatedState};

impl ReplicatedState for CoordState {
    type Command = CoordCommand;
    type Reply = CoordReply;

    fn apply(&mut self, cmd: &CoordCommand) -> CoordReply {
        CoordState::apply(self, cmd)
    }

    /// Servers' requests carry the leader's clock, not the sender's: leases are measured
    /// on one clock (a new leader's may lag; `CoordState` never lets time run backwards).
    fn stamp(cmd: &mut CoordCommand) {
        if let CoordCommand::Request { now_ms, .. } = cmd {
            *now_ms = wall_clock_ms();
        }
    }
}

/// Milliseconds of the leader's wall clock. Leases are measured in it; `CoordState` never
/// lets its own time run backwards when a new leader's clock is behind.
pub fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A control message on its way to a server, answered or not.
pub type ControlFuture = Pin<Box<dyn Future<Output = Option<ControlReply>> + Send>>;

/// How the leader reaches metadata servers. `None` means no answer (unreachable, timed
/// out, or the addressee is another incarnation): the driver resends on its timer.
pub trait ServerLink: Send + Sync + 'static {
    fn send(&self, addr: String, control: Control) -> ControlFuture;
}

/// Runs the driver beside `replica` until the replica's view closes: only while this
/// replica leads does it act, and every decision goes through the log (a deposed leader's
/// proposals fail). `clock` gives milliseconds (injected, for tests).
pub fn spawn_driver(
    replica: Arc<Replica<CoordState>>,
    link: Arc<dyn ServerLink>,
    cfg: DriverConfig,
    clock: Arc<dyn Fn() -> u64 + Send + Sync>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut view = replica.subscribe();
        let mut driver: Option<Driver> = None;
        let mut timer = tokio::time::interval(Duration::from_millis(cfg.tick_ms.max(1)));
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (reply_tx, mut replies) = mpsc::unbounded_channel::<ControlReply>();
        loop {
            let actions = tokio::select! {
                changed = view.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let v = view.borrow_and_update().clone();
                    if !v.is_leader {
                        driver = None;
                        continue;
                    }
                    let d = driver.get_or_insert_with(|| Driver::new(cfg));
                    d.on_state(&v.state, clock())
                }
                _ = timer.tick() => {
                    let v = view.borrow().clone();
                    if !v.is_leader {
                        driver = None;
                        continue;
                    }
                    let d = driver.get_or_insert_with(|| Driver::new(cfg));
                    d.tick(&v.state, clock())
                }
                Some(reply) = replies.recv() => match driver.as_mut() {
                    Some(d) => d.on_reply(&reply),
                    None => continue,
                },
            };
            let state = Arc::clone(&view.borrow().state);
            for action in actions {
                match action {
                    DriverAction::Propose(cmd) => {
                        let r = Arc::clone(&replica);
                        tokio::spawn(async move {
                            if let Err(e) = r.propose(cmd).await {
                                tracing::debug!("driver proposal not applied: {e}");
                            }
                        });
                    }
                    DriverAction::Send(control) => {
                        let Some(member) = state.servers.get(&control.to.server) else {
                            continue;
                        };
                        let fut = link.send(member.addr.clone(), control);
                        let tx = reply_tx.clone();
                        tokio::spawn(async move {
                            if let Some(reply) = fut.await {
                                let _ = tx.send(reply);
                            }
                        });
                    }
                }
            }
        }
    })
}

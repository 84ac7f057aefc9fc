//! The one clock the serving core reads (issue 32): leases, callback deadlines and
//! defaults, the replay window, disconnected sessions, and the times files are stamped
//! with. A served core reads the system's clocks; a simulation ([`SimulatedClock`]) moves
//! time itself, so lease expiry and callback deadlines happen within a run, at the same
//! point of every run of a seed.
//!
//! Times stay `Instant`s and `TimeNs`: a simulated instant is a base taken once plus an
//! offset the simulation advances, and its wall time the wall base plus the same offset.
//!
//! Left on the system clock, because they time the network and the process rather than
//! the core's protocol: tokio timers and handshake/heartbeat deadlines (`conn`,
//! `cluster_host`, `server`'s loops), durations measured for metrics and logs, the
//! checkpointer's interval, and the garbage collector of slice objects (`gc`).

use kochab_proto::TimeNs;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The core's clock: the system's, or a simulation's. Cheap to clone.
#[derive(Clone)]
pub struct Clock {
    simulated: Option<Arc<SimulatedTime>>,
}

/// What a [`SimulatedClock`] and the [`Clock`]s it hands out share.
struct SimulatedTime {
    base: Instant,
    wall_base_ns: TimeNs,
    /// Nanoseconds since `base` (only ever grows).
    offset_ns: AtomicU64,
}

impl SimulatedTime {
    fn offset(&self) -> Duration {
        Duration::from_nanos(self.offset_ns.load(Ordering::Acquire))
    }
}

impl Clock {
    /// The system's clocks (a served core).
    pub fn system() -> Clock {
        Clock { simulated: None }
    }

    /// Monotonic time: what leases, deadlines and windows are measured in.
    pub fn now(&self) -> Instant {
        match &self.simulated {
            None => Instant::now(),
            Some(t) => t.base + t.offset(),
        }
    }

    /// Nanoseconds since the epoch: what files are stamped with.
    pub fn wall_ns(&self) -> TimeNs {
        match &self.simulated {
            None => system_wall_ns(),
            Some(t) => {
                let offset = t.offset().as_nanos().min(i64::MAX as u128) as i64;
                t.wall_base_ns.saturating_add(offset)
            }
        }
    }

    /// Whole seconds since the epoch (the expiry of grants is stated in them).
    pub fn unix_secs(&self) -> u64 {
        (self.wall_ns().max(0) / 1_000_000_000) as u64
    }
}

/// Nanoseconds since the epoch from the system clock.
fn system_wall_ns() -> TimeNs {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos().min(i64::MAX as u128) as i64,
        Err(e) => -(e.duration().as_nanos().min(i64::MAX as u128) as i64),
    }
}

/// A clock that moves only when told to: a simulation owns it and gives its [`Clock`] to
/// every core it starts (all incarnations see one time, as the machine's clock would).
pub struct SimulatedClock {
    time: Arc<SimulatedTime>,
}

impl SimulatedClock {
    /// Starts at `wall_base_ns` wall time (its monotonic base is the system's now).
    pub fn new(wall_base_ns: TimeNs) -> SimulatedClock {
        SimulatedClock {
            time: Arc::new(SimulatedTime {
                base: Instant::now(),
                wall_base_ns,
                offset_ns: AtomicU64::new(0),
            }),
        }
    }

    /// The clock to give a core.
    pub fn clock(&self) -> Clock {
        Clock {
            simulated: Some(self.time.clone()),
        }
    }

    /// Moves time on by `by`.
    pub fn advance(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.time.offset_ns.fetch_add(ns, Ordering::AcqRel);
    }

    /// The time now.
    pub fn now(&self) -> Instant {
        self.clock().now()
    }
}

/// The time as the shell read it for one step.
#[derive(Clone, Copy, Debug)]
pub struct Now {
    /// Wall-clock nanoseconds (file times).
    pub wall: TimeNs,
    /// The monotonic instant (leases, callbacks, sessions).
    pub instant: Instant,
    /// The journal durable up to here when the step began (it only grows: a step that
    /// reads it early is conservative).
    pub durable: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_simulated_clock_moves_only_when_advanced_and_both_times_together() {
        let sim = SimulatedClock::new(1_000);
        let clock = sim.clock();
        let (t0, w0) = (clock.now(), clock.wall_ns());
        assert_eq!(w0, 1_000);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(clock.now(), t0, "no time passes by itself");
        sim.advance(Duration::from_millis(1500));
        assert_eq!(clock.now() - t0, Duration::from_millis(1500));
        assert_eq!(clock.wall_ns() - w0, 1_500_000_000);
        assert_eq!(sim.now(), clock.now());
    }

    #[test]
    fn the_system_clock_runs() {
        let clock = Clock::system();
        let t0 = clock.now();
        std::thread::sleep(Duration::from_millis(2));
        assert!(clock.now() > t0);
        assert!(clock.wall_ns() > 1_600_000_000_000_000_000);
    }
}

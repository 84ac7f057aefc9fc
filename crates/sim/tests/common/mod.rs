//! What both simulation tests read from the environment.

use kochab_breaks::{Break, Breaks};

/// The number in environment variable `name`, if it holds one.
pub fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The break `SIM_BREAK` names (none without it; a name that is no break fails the test).
pub fn breaks() -> Breaks {
    match std::env::var("SIM_BREAK") {
        Ok(name) => match Break::parse(&name) {
            Some(b) => Breaks::NONE.with(b),
            None => panic!(
                "SIM_BREAK={name}: not one of {:?}",
                Break::ALL.map(|b| b.name())
            ),
        },
        Err(_) => Breaks::NONE,
    }
}

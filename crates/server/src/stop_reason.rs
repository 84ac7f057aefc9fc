//! Why a server stops serving (its journal failed, or it was fenced): reasons published on
//! a watch, awaited by whoever must stop with them.

use tokio::sync::watch;

/// Resolves with the first reason `rx` carries (now or later); never, if its sender goes
/// without one.
pub async fn first_reason(mut rx: watch::Receiver<Option<String>>) -> String {
    loop {
        if let Some(why) = rx.borrow_and_update().clone() {
            return why;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

//! Whether the republish login gets into each vhost nackd intercepts for.
//!
//! A republisher only exists once something is held in its vhost, so a
//! wrong password or a missing permission would show only when the first
//! held message is due, and then only as a log line per attempt. Instead,
//! at startup and on each reload, [`LoginCheck`] logs in to every policy
//! vhost (and closes again), repeating every [`RETRY`] while that fails;
//! afterwards the republishers' own connects keep the answer current. The
//! answers live in [`Metrics::republish_logins`]: `/readyz` is not ready
//! while one of them is not `ok`.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::check::close_connection;
use super::conn::{Conn, ConnError};
use super::Credentials;
use crate::metrics::{Login, Metrics};
use crate::net::Connector;

/// How often a failing login is tried again.
pub(super) const RETRY: Duration = Duration::from_secs(10);
/// Time one login may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Logs in to each policy vhost, as the republisher would.
#[derive(Clone)]
pub struct LoginCheck {
    connector: Connector,
    login: Credentials,
    metrics: Arc<Metrics>,
    /// nackd's stop: ends every check.
    stop: CancellationToken,
    /// Stops the check a reload replaces (a child of `stop`).
    running: Arc<Mutex<CancellationToken>>,
}

impl std::fmt::Debug for LoginCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoginCheck")
            .field("user", &self.login.username)
            .finish()
    }
}

impl LoginCheck {
    /// A check through `connector`, logged in as the republisher, until
    /// `stop` (nackd's shutdown) is cancelled.
    pub fn new(
        connector: Connector,
        login: Credentials,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> Self {
        Self {
            connector,
            login,
            metrics,
            running: Arc::new(Mutex::new(stop.child_token())),
            stop,
        }
    }

    /// The policies now intercept for `vhosts`: each one not known to be
    /// `ok` is `checking` (not ready) until a login answers, and is tried
    /// again every [`RETRY`] while it fails. Replaces a check still running.
    /// Needs a tokio runtime to log in (outside one, only records).
    pub fn spawn(&self, vhosts: Vec<String>) {
        let logins = &self.metrics.republish_logins;
        logins.expect(vhosts.iter().map(String::as_str));
        let stop = self.stop.child_token();
        let old = std::mem::replace(
            &mut *self.running.lock().unwrap_or_else(|e| e.into_inner()),
            stop.clone(),
        );
        old.cancel();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (connector, login) = (self.connector.clone(), self.login.clone());
        let metrics = Arc::downgrade(&self.metrics);
        runtime.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = check_until_ok(&connector, &login, metrics, &vhosts) => {}
            }
        });
    }
}

/// Logs in to each of `vhosts` not yet `ok`, every [`RETRY`], until all
/// are (or nackd is gone).
async fn check_until_ok(
    connector: &Connector,
    login: &Credentials,
    metrics: Weak<Metrics>,
    vhosts: &[String],
) {
    loop {
        let Some(m) = metrics.upgrade() else { return };
        let pending: Vec<&String> = vhosts
            .iter()
            .filter(|v| m.republish_logins.get(v) != Some(Login::Ok))
            .collect();
        if pending.is_empty() {
            return;
        }
        for vhost in pending {
            let tried = tokio::time::timeout(TIMEOUT, try_login(connector, login, vhost)).await;
            let user = &login.username;
            let answer = match tried {
                Ok(Ok(())) => Login::Ok,
                Ok(Err(e)) => Login::Failed(failure(&e, user)),
                Err(_) => Login::Failed(format!("cannot log in as user {user}: timed out")),
            };
            record(&m, vhost, user, answer);
        }
        drop(m);
        tokio::time::sleep(RETRY).await;
    }
}

/// Opens a connection to `vhost` and closes it again.
async fn try_login(
    connector: &Connector,
    login: &Credentials,
    vhost: &str,
) -> Result<(), ConnError> {
    let mut conn = Conn::open(connector, login, vhost, None).await?;
    close_connection(&mut conn).await
}

/// What `/readyz` says about a login that failed with `e`: the broker's
/// reply and the user (`403 ACCESS_REFUSED - ... (user nackd)`), or why
/// no login could be made.
pub(super) fn failure(e: &ConnError, user: &str) -> String {
    match e.refusal() {
        Some(reply) => format!("{reply} (user {user})"),
        None => format!("cannot log in as user {user}: {e}"),
    }
}

/// Records `answer` for `vhost`, logging when it changes: a refusal is a
/// warning naming the vhost, the user and the broker's reply.
pub(super) fn record(metrics: &Metrics, vhost: &str, user: &str, answer: Login) {
    let before = metrics.republish_logins.set(vhost, answer.clone());
    if before.as_ref() == Some(&answer) {
        return;
    }
    match &answer {
        Login::Failed(reason) => warn!(
            vhost, user, reason = %reason,
            "the republish login into vhost {vhost:?} fails; what is held for this vhost cannot be republished, and /readyz reports not ready"
        ),
        Login::Ok if matches!(before, Some(Login::Failed(_))) => {
            info!(
                vhost,
                user, "the republish login into vhost {vhost:?} works again"
            )
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_reply_and_the_user_other_failures_say_no_login_was_made() {
        let refused = ConnError::Closed("403 ACCESS_REFUSED - Login was refused".into());
        assert_eq!(
            failure(&refused, "nackd"),
            "403 ACCESS_REFUSED - Login was refused (user nackd)"
        );
        let reset = ConnError::Io(std::io::ErrorKind::ConnectionReset.into());
        assert!(failure(&reset, "nackd").starts_with("cannot log in as user nackd: "));
    }

    #[test]
    fn a_login_recorded_is_what_readyz_shows() {
        let metrics = Metrics::new();
        record(
            &metrics,
            "shop",
            "nackd",
            Login::Failed("530 NOT_ALLOWED (user nackd)".into()),
        );
        record(&metrics, "/", "nackd", Login::Ok);
        let shown: Vec<(String, String)> = metrics
            .republish_logins
            .all()
            .into_iter()
            .map(|(v, l)| (v, l.text().to_string()))
            .collect();
        assert_eq!(
            shown,
            [
                ("/".to_string(), "ok".to_string()),
                (
                    "shop".to_string(),
                    "530 NOT_ALLOWED (user nackd)".to_string()
                )
            ]
        );
        assert!(metrics
            .encode()
            .contains("nackd_republish_login_failed{vhost=\"shop\"} 1"));
    }
}

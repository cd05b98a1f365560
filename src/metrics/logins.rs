//! Whether nackd's own login (`[republish]`) gets into each vhost it
//! intercepts for: what `/readyz` reports under `"republish"`.
//!
//! Two writers: the login check of startup and reload (one login per
//! policy vhost, repeated while it fails), and each republisher's own
//! connects afterwards.

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::VhostLabels;

/// The last login into one vhost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Login {
    /// Not tried yet.
    Checking,
    /// The broker let nackd in.
    Ok,
    /// Refused (`403 ACCESS_REFUSED ...`, `530 NOT_ALLOWED ...`) or not
    /// possible (broker unreachable): the reason, naming the user.
    Failed(String),
}

impl Login {
    /// What `/readyz` shows: `ok`, `checking`, or the reason.
    pub fn text(&self) -> &str {
        match self {
            Self::Checking => "checking",
            Self::Ok => "ok",
            Self::Failed(reason) => reason,
        }
    }
}

/// The last login per vhost, and `nackd_republish_login_failed{vhost}`.
#[derive(Debug, Default)]
pub struct Logins {
    last: Mutex<BTreeMap<String, Login>>,
    pub(super) failed: Family<VhostLabels, Gauge>,
}

impl Logins {
    /// The vhosts policies intercept for are now `vhosts`: a new one is
    /// `checking`, one no policy names any more is forgotten (its
    /// republisher, if it still has messages to publish, reports again).
    pub fn expect<'a>(&self, vhosts: impl IntoIterator<Item = &'a str>) {
        let mut last = self.lock();
        let old = std::mem::take(&mut *last);
        for vhost in vhosts {
            let login = old.get(vhost).cloned().unwrap_or(Login::Checking);
            last.insert(vhost.to_string(), login);
        }
        for vhost in old.keys().filter(|v| !last.contains_key(*v)) {
            self.gauge(vhost).set(0);
        }
    }

    /// Records a login into `vhost`; returns the one before.
    pub fn set(&self, vhost: &str, login: Login) -> Option<Login> {
        self.gauge(vhost)
            .set(i64::from(matches!(login, Login::Failed(_))));
        self.lock().insert(vhost.to_string(), login)
    }

    /// The last login into `vhost`.
    pub fn get(&self, vhost: &str) -> Option<Login> {
        self.lock().get(vhost).cloned()
    }

    /// Every vhost's last login.
    pub fn all(&self) -> BTreeMap<String, Login> {
        self.lock().clone()
    }

    fn gauge(&self, vhost: &str) -> Gauge {
        self.failed.get_or_create_owned(&VhostLabels {
            vhost: vhost.to_string(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Login>> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_vhost_is_checking_a_known_one_keeps_its_login_a_dropped_one_goes() {
        let logins = Logins::default();
        logins.expect(["/", "shop"]);
        assert_eq!(logins.get("/"), Some(Login::Checking));
        logins.set("/", Login::Ok);
        logins.set("shop", Login::Failed("403 ACCESS_REFUSED".into()));
        assert_eq!(logins.gauge("shop").get(), 1);
        logins.expect(["/", "billing"]);
        let all = logins.all();
        assert_eq!(
            all.iter()
                .map(|(v, l)| (v.as_str(), l.text()))
                .collect::<Vec<_>>(),
            [("/", "ok"), ("billing", "checking")]
        );
        assert_eq!(
            logins.gauge("shop").get(),
            0,
            "no longer failing: not counted"
        );
    }

    #[test]
    fn set_returns_the_login_before() {
        let logins = Logins::default();
        assert_eq!(logins.set("/", Login::Failed("530".into())), None);
        assert_eq!(
            logins.set("/", Login::Ok),
            Some(Login::Failed("530".into()))
        );
        assert_eq!(logins.gauge("/").get(), 0);
    }
}

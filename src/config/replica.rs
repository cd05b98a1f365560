//! `[replica]`: held messages mirrored in a stream of the broker cluster
//! (off unless the section is there).

use std::time::Duration;

use nackd_core::schema::Duration as DurationText;
use schemars::JsonSchema;
use serde::Deserialize;

/// `[replica]`
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Replica {
    /// This instance's id (default: the host name). Two processes with the
    /// same id are one holder and a standby. 1 to 128 of `A-Z a-z 0-9 - _ .`.
    #[schemars(pattern(ID_PATTERN), example = "nackd-1")]
    pub instance: Option<String>,
    /// Instances of one group adopt each other's messages, and only those:
    /// separate deployments on one cluster (environments, teams, policies)
    /// use separate groups. 1 to 128 of `A-Z a-z 0-9 - _ .`.
    #[serde(default = "default_group")]
    #[schemars(pattern(ID_PATTERN))]
    pub group: String,
    /// Virtual host of the streams and the lease.
    #[serde(default = "default_vhost")]
    pub vhost: String,
    /// An instance whose lease stays free this long is adopted by another
    /// (at least three `heartbeat`s).
    #[serde(default = "default_adopt_after", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub adopt_after: Duration,
    /// An adoption commits the messages it took in parts of this many
    /// (up to 32768), the soonest due first: each part fires once
    /// committed, while the rest is still being taken. Smaller parts fire
    /// sooner and write more records to the adopted instance's directory
    /// (16 bytes a message). 0: in one step, all at the end (as 0.1.0
    /// did, but with two reads of the adopted stream; for a group that
    /// still runs 0.1.0, which cannot read the parts' records).
    #[serde(default = "default_adopt_part")]
    #[schemars(range(min = 0, max = 32768))]
    pub adopt_part: usize,
    /// Heartbeat of the replica connection: a holder that loses the broker
    /// stops acting after about one interval, the broker frees its lease
    /// after about two. At least 1s.
    #[serde(default = "default_heartbeat", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub heartbeat: Duration,
    /// Completed messages are written to the stream at least this often.
    #[serde(default = "default_completions_every", with = "humantime_serde")]
    #[schemars(with = "DurationText")]
    pub completions_every: Duration,
    /// Replicas of each stream (`x-initial-cluster-size`); the broker's default when absent.
    #[schemars(range(min = 1), example = 3)]
    pub cluster_size: Option<u32>,
    /// A replica stream is replaced by one holding only the live messages
    /// once it holds more than twice their bytes plus this many bytes.
    #[serde(default = "default_generation_slack")]
    pub generation_slack: u64,
    /// For a change of `upstream.addresses` only: the list as it was. The
    /// lease's registers are named by their place in that list, so every
    /// process of an id must list the same nodes in the same order; a
    /// process whose list differs from the one its id's last holder
    /// recorded does not take the lease (and logs both). Once every
    /// process with the old list has stopped, start them with the new
    /// list and the old one here (nothing checks that none still runs);
    /// remove it once every process runs with the new list.
    #[serde(default)]
    #[schemars(example = ["10.0.0.1:5672", "10.0.0.2:5672", "10.0.0.3:5672"])]
    pub previous_addresses: Vec<String>,
}

/// What `instance` and `group` may be, for the JSON Schema.
const ID_PATTERN: &str = "^[A-Za-z0-9._-]{1,128}$";

fn default_generation_slack() -> u64 {
    64 * 1024 * 1024
}

fn default_group() -> String {
    "default".into()
}

fn default_vhost() -> String {
    "/".into()
}

fn default_adopt_after() -> Duration {
    Duration::from_secs(60)
}

fn default_adopt_part() -> usize {
    20_000
}

fn default_heartbeat() -> Duration {
    Duration::from_secs(5)
}

fn default_completions_every() -> Duration {
    Duration::from_millis(200)
}

impl Replica {
    /// The instance id to use.
    pub fn instance(&self) -> String {
        self.instance
            .clone()
            .unwrap_or_else(crate::replica::hostname)
    }

    pub(super) fn check(&self) -> Result<(), (String, String)> {
        let id = self.instance();
        let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
        if id.is_empty() || id.len() > 128 || !id.chars().all(allowed) {
            return Err((
                "replica.instance".into(),
                format!("{id:?}: use 1 to 128 of A-Z a-z 0-9 - _ ."),
            ));
        }
        if self.group.is_empty() || self.group.len() > 128 || !self.group.chars().all(allowed) {
            return Err((
                "replica.group".into(),
                format!("{:?}: use 1 to 128 of A-Z a-z 0-9 - _ .", self.group),
            ));
        }
        if self.heartbeat < Duration::from_secs(1) {
            return Err(("replica.heartbeat".into(), "must be at least 1s".into()));
        }
        if self.adopt_after < self.heartbeat * 3 {
            return Err((
                "replica.adopt_after".into(),
                "must be at least three heartbeats".into(),
            ));
        }
        if self.adopt_part > crate::replica::PART_MAX {
            return Err((
                "replica.adopt_part".into(),
                format!("{}: use 0 to {}", self.adopt_part, crate::replica::PART_MAX),
            ));
        }
        if self.cluster_size == Some(0) {
            return Err(("replica.cluster_size".into(), "must be at least 1".into()));
        }
        super::host_ports(&self.previous_addresses, |i| {
            format!("replica.previous_addresses[{i}]")
        })
    }
}

//! What the local store last agreed with the cluster on: the instance it
//! belongs to, the generation stream it mirrors, and the lease epoch it
//! held. A process that takes the lease and finds a newer epoch in the
//! directory knows another holder acted in between: its local copy is
//! stale and is rebuilt from the stream.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

const FILE: &str = "replica.state";
/// Present while an adoption of this process parks messages that are not
/// committed yet: a start on this store then rebuilds it from the stream,
/// where those parks count only once committed.
const ADOPTING: &str = "replica.adopting";

/// The local store's last agreement with the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Synced {
    /// The instance id.
    pub instance: String,
    /// The generation stream it mirrors.
    pub generation: u64,
    /// The lease epoch it held.
    pub epoch: u64,
    /// Who wrote that epoch (`pid N on HOST`): two processes that both
    /// wrote the same epoch number (one of them after it lost the lease)
    /// tell their stores apart by it. `None` in a file of an earlier
    /// release.
    pub holder: Option<String>,
}

fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// The state saved in `dir`, if any (unreadable counts as none: stale).
pub(super) fn load(dir: &Path) -> Option<Synced> {
    let text = std::fs::read_to_string(path(dir)).ok()?;
    let mut lines = text.lines();
    if lines.next()? != "nackd-replica 1" {
        return None;
    }
    let mut field = |name: &str| {
        lines
            .next()?
            .strip_prefix(name)?
            .strip_prefix(' ')
            .map(str::to_string)
    };
    Some(Synced {
        instance: field("instance")?,
        generation: field("generation")?.parse().ok()?,
        epoch: field("epoch")?.parse().ok()?,
        holder: field("holder"),
    })
}

/// Saves `state` durably (write, fsync, rename, fsync the directory).
pub(super) fn save(dir: &Path, state: &Synced) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    write!(
        f,
        "nackd-replica 1\ninstance {}\ngeneration {}\nepoch {}\n",
        state.instance, state.generation, state.epoch
    )?;
    if let Some(holder) = &state.holder {
        writeln!(f, "holder {holder}")?;
    }
    f.sync_all()?;
    std::fs::rename(&tmp, path(dir))?;
    std::fs::File::open(dir)?.sync_all()
}

/// The marker of an adoption of `from`: one per adopted instance, since
/// two can be under way (one cut off and resumed later, another done).
fn marker(dir: &Path, from: &str) -> PathBuf {
    dir.join(format!("{ADOPTING}.{}", from.replace(['/', '\\'], "_")))
}

fn markers(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(ADOPTING))
        })
        .collect()
}

/// Marks an adoption of `from` under way, durably (again when resumed).
pub(super) fn begin_adoption(dir: &Path, from: &str) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut f = std::fs::File::create(marker(dir, from))?;
    writeln!(f, "{from}")?;
    f.sync_all()?;
    std::fs::File::open(dir)?.sync_all()
}

/// Whether an adoption was under way when this store was last written:
/// its parks may not all count, so the store is rebuilt from the stream.
pub(super) fn adoption_under_way(dir: &Path) -> bool {
    !markers(dir).is_empty()
}

/// The adoption of `from` ended: committed (its parks count) or given up
/// (they were completed). Best effort: a marker left behind costs a
/// rebuild at the next start.
pub(super) fn end_adoption(dir: &Path, from: &str) {
    let _ = std::fs::remove_file(marker(dir, from));
}

/// At a process's first sync: a rebuild dropped every park of an
/// uncommitted adoption, and no adoption of this process is under way yet.
pub(super) fn end_adoptions_at_start(dir: &Path) {
    for marker in markers(dir) {
        let _ = std::fs::remove_file(marker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_state_reads_back_and_garbage_reads_as_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()), None);
        let s = Synced {
            instance: "host-a".into(),
            generation: 3,
            epoch: 12,
            holder: Some("pid 7 on host-a".into()),
        };
        save(dir.path(), &s).unwrap();
        assert_eq!(load(dir.path()), Some(s));
        // A file of an earlier release, without the holder, still reads.
        std::fs::write(
            dir.path().join(FILE),
            "nackd-replica 1\ninstance x\ngeneration 1\nepoch 2\n",
        )
        .unwrap();
        assert_eq!(load(dir.path()).unwrap().holder, None);
        std::fs::write(dir.path().join(FILE), "nackd-replica 1\ninstance x\n").unwrap();
        assert_eq!(load(dir.path()), None);
    }

    #[test]
    fn an_adoption_under_way_is_marked_until_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!adoption_under_way(dir.path()));
        begin_adoption(dir.path(), "host-a").unwrap();
        assert!(adoption_under_way(dir.path()));
        end_adoption(dir.path(), "host-a");
        assert!(!adoption_under_way(dir.path()));
    }

    /// Review of issue 21, item 5: an adoption of X cut off (to be resumed)
    /// while one of Y is committed: the end of Y's leaves X's marked.
    #[test]
    fn the_end_of_one_adoption_leaves_another_marked() {
        let dir = tempfile::tempdir().unwrap();
        begin_adoption(dir.path(), "x").unwrap();
        begin_adoption(dir.path(), "y").unwrap();
        end_adoption(dir.path(), "y");
        assert!(adoption_under_way(dir.path()), "x is still under way");
        end_adoption(dir.path(), "x");
        assert!(!adoption_under_way(dir.path()));
        begin_adoption(dir.path(), "x").unwrap();
        end_adoptions_at_start(dir.path());
        assert!(!adoption_under_way(dir.path()));
    }
}

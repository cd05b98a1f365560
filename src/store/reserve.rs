//! The store's reserve: a file of [`RESERVE_BYTES`] kept in the store's
//! directory, so that the completions of messages already fired can be
//! written when another process fills the disk.
//!
//! The free space the log keeps for deletes (`room_for`) only holds while
//! nackd is the one filling the disk: anyone else can take it. Blocks
//! that belong to a file of nackd's cannot be taken. When deletes do not
//! fit, the writer removes the file and writes them into the space it
//! frees; firing pauses meanwhile, so what needs that space is bounded by
//! what was already handed to the republishers. The reserve is made again
//! once the disk has room for it and the log's headroom; until then firing
//! stays paused and puts are refused.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Size of the reserve: the deletes of about 50 000 messages (21 bytes
/// each), well above what the republishers of a few vhosts can have in
/// flight (`2 × republish.confirm_window` each), plus a new segment's
/// first blocks.
pub const RESERVE_BYTES: u64 = 1024 * 1024;
/// Its file in the store directory.
const RESERVE: &str = "RESERVE";

/// The reserve file, and whether it is on disk.
pub(super) struct Reserve {
    dir: PathBuf,
    kept: bool,
    /// A simulated disk shared with a test: the reserve's bytes come from
    /// it and go back to it (see `log::faults`).
    #[cfg(test)]
    pub(super) disk: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

impl Reserve {
    /// The reserve of the store in `dir`: the file left by an earlier run
    /// is kept if it is whole (written, not sparse), else dropped.
    pub(super) fn adopt(dir: &Path) -> Self {
        let _ = std::fs::remove_file(dir.join(format!("{RESERVE}.tmp")));
        let whole = std::fs::metadata(dir.join(RESERVE))
            .is_ok_and(|m| m.len() == RESERVE_BYTES && m.blocks() * 512 >= RESERVE_BYTES);
        if !whole {
            let _ = std::fs::remove_file(dir.join(RESERVE));
        }
        Self {
            dir: dir.to_owned(),
            kept: whole,
            #[cfg(test)]
            disk: None,
        }
    }

    /// Whether the reserve is on disk.
    pub(super) fn kept(&self) -> bool {
        self.kept
    }

    /// Writes the reserve (random bytes, so that its blocks are allocated),
    /// makes it durable, and only then names it: a crash never leaves a
    /// partial reserve that looks whole.
    pub(super) fn make(&mut self) -> io::Result<()> {
        #[cfg(test)]
        if let Some(disk) = &self.disk {
            use std::sync::atomic::Ordering;
            let taken = disk.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |free| {
                free.checked_sub(RESERVE_BYTES)
            });
            if taken.is_err() {
                return Err(io::Error::from_raw_os_error(28)); // ENOSPC
            }
        }
        let tmp = self.dir.join(format!("{RESERVE}.tmp"));
        let written = write_reserve(&tmp)
            .and_then(|()| std::fs::rename(&tmp, self.dir.join(RESERVE)))
            .and_then(|()| sync_dir(&self.dir));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written?;
        self.kept = true;
        Ok(())
    }

    /// Removes the reserve, durably (the file system may hand its blocks
    /// out only once the removal is committed); `false` if there was none.
    pub(super) fn release(&mut self) -> bool {
        if !self.kept {
            return false;
        }
        self.kept = false;
        let _ = std::fs::remove_file(self.dir.join(RESERVE));
        let _ = sync_dir(&self.dir);
        #[cfg(test)]
        if let Some(disk) = &self.disk {
            disk.fetch_add(RESERVE_BYTES, std::sync::atomic::Ordering::SeqCst);
        }
        true
    }
}

fn write_reserve(path: &Path) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)?;
    // Random, not zeros: a compressing file system (btrfs, ZFS) would
    // store zeros in next to no blocks, and removing them would free none.
    let mut chunk = vec![0u8; 64 * 1024];
    fastrand::fill(&mut chunk);
    for _ in 0..RESERVE_BYTES / chunk.len() as u64 {
        file.write_all(&chunk)?;
    }
    file.sync_all()
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_reserve_is_kept_across_runs_a_partial_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut reserve = Reserve::adopt(dir.path());
        assert!(!reserve.kept(), "none yet");
        reserve.make().unwrap();
        assert!(reserve.kept());
        assert!(Reserve::adopt(dir.path()).kept(), "the next run keeps it");
        // A crash while it was written leaves the temporary file only.
        std::fs::write(dir.path().join("RESERVE.tmp"), b"partial").unwrap();
        // A sparse file of the right length holds no blocks: not a reserve.
        std::fs::remove_file(dir.path().join(RESERVE)).unwrap();
        File::create(dir.path().join(RESERVE))
            .unwrap()
            .set_len(RESERVE_BYTES)
            .unwrap();
        let mut reserve = Reserve::adopt(dir.path());
        assert!(!reserve.kept());
        assert!(!dir.path().join(RESERVE).exists());
        assert!(!dir.path().join("RESERVE.tmp").exists());
        reserve.make().unwrap();
        assert!(reserve.release());
        assert!(!reserve.release(), "released once");
        assert!(!dir.path().join(RESERVE).exists());
    }
}

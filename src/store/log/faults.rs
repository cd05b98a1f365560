//! Injected I/O failures for the store's tests: a write that stops part way
//! with ENOSPC, an fsync that fails with EIO.

use std::fs::File;
use std::io::{self, Write};

/// Failures armed for the next commit.
#[derive(Debug, Default)]
pub struct Faults {
    /// The next write puts this many bytes in the file, then fails.
    pub write_then_fail: Option<usize>,
    /// The next fsync fails (after the write went through).
    pub fail_sync: bool,
    /// Free disk space every commit finds from now on.
    pub free_bytes: Option<u64>,
}

impl Faults {
    pub fn before_write(&mut self, mut file: &File, pending: &[u8]) -> Option<io::Error> {
        let n = self.write_then_fail.take()?.min(pending.len());
        let _ = file.write_all(&pending[..n]);
        Some(io::Error::from_raw_os_error(28)) // ENOSPC
    }

    pub fn before_sync(&mut self) -> Option<io::Error> {
        std::mem::take(&mut self.fail_sync).then(|| io::Error::from_raw_os_error(5))
        // EIO
    }
}

//! The Linux scheduling policy of the session threads (`runtime.scheduling`).
//!
//! With `batch`, the session workers run under `SCHED_BATCH`: a frame that
//! arrives while the CPU is busy (with the broker or the client, on a shared
//! host) waits for the running task's turn to end instead of preempting it,
//! so each wakeup finds more frames. On an idle CPU nothing changes. The
//! retry engine and the store writer keep the default policy.

use std::io;

/// Puts the calling thread under `SCHED_BATCH` (its nice value is kept).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn batch_current_thread() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 names the calling thread; `param` outlives the call.
    match unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// Puts the calling thread under `SCHED_BATCH` (Linux only).
#[cfg(not(target_os = "linux"))]
pub fn batch_current_thread() -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "SCHED_BATCH exists on Linux only",
    ))
}

#[cfg(all(test, target_os = "linux"))]
#[allow(unsafe_code)]
mod tests {
    #[test]
    fn a_thread_can_be_put_under_sched_batch() {
        std::thread::spawn(|| {
            // SAFETY: querying the calling thread's policy.
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
            super::batch_current_thread().unwrap();
            assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_BATCH);
        })
        .join()
        .unwrap();
        // Only that thread changed.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
    }
}

//! The engine's alarm: wakes it at the next grid point at which a held
//! message is due (the engine fires on a 1 ms grid), within tens of
//! microseconds of that point.
//!
//! tokio's timers tick in whole milliseconds: a sleep until `t` rounds `t`
//! up to the driver's next tick, and the driver's `epoll_wait` rounds its
//! timeout up again, so a message fired by one is 0–2 ms late before it
//! even leaves nackd. On Linux the alarm is a `timerfd` (a kernel
//! high-resolution timer) registered with the engine's own reactor, so it
//! costs no thread. Elsewhere, or if the kernel refuses one, it falls back
//! to tokio's sleep.

use std::time::Instant;

use nackd_core::clock::Clock;

/// Wakes the engine at the instant it was set to.
pub(super) struct Alarm {
    clock: Clock,
    #[cfg(target_os = "linux")]
    fd: Option<tokio::io::unix::AsyncFd<linux::TimerFd>>,
    /// What the timer is set to.
    at: Option<Instant>,
}

impl Alarm {
    /// An unset alarm on `clock`. Must be called inside the engine's runtime.
    pub(super) fn new(clock: Clock) -> Self {
        #[cfg(target_os = "linux")]
        let fd = match linux::TimerFd::registered() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!("no timerfd ({e}): due messages wake the engine by the millisecond");
                None
            }
        };
        Self {
            clock,
            #[cfg(target_os = "linux")]
            fd,
            at: None,
        }
    }

    /// Sets the alarm to `at`, or unsets it.
    pub(super) fn set(&mut self, at: Option<Instant>) {
        if self.at == at {
            return;
        }
        self.at = at;
        #[cfg(target_os = "linux")]
        if let Some(fd) = &self.fd {
            let after = at.map(|at| at.saturating_duration_since(self.clock.now()));
            if after.is_some_and(|after| after.is_zero()) {
                // `rings` answers at once without it (a leftover expiry of
                // an earlier time only costs the engine one look).
                return;
            }
            if let Err(e) = fd.get_ref().arm(after) {
                tracing::warn!(
                    "timerfd refused a time ({e}): due messages wake the engine by the millisecond"
                );
                self.fd = None;
            }
        }
    }

    /// Resolves once the time it was set to has come; never while unset.
    pub(super) async fn rings(&mut self) {
        let Some(at) = self.at else {
            return std::future::pending().await;
        };
        if at <= self.clock.now() {
            return;
        }
        #[cfg(target_os = "linux")]
        if let Some(fd) = &self.fd {
            loop {
                let Ok(mut guard) = fd.readable().await else {
                    break; // the reactor is gone: fall back below
                };
                if guard.get_inner().expired() {
                    return;
                }
                guard.clear_ready();
                if at <= self.clock.now() {
                    return;
                }
            }
        }
        tokio::time::sleep_until(at.into()).await
    }
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
mod linux {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::time::Duration;

    use tokio::io::unix::AsyncFd;
    use tokio::io::Interest;

    /// A non-blocking `CLOCK_MONOTONIC` timerfd (the clock of `Instant`).
    pub(super) struct TimerFd(OwnedFd);

    impl TimerFd {
        pub(super) fn new() -> io::Result<Self> {
            let flags = libc::TFD_NONBLOCK | libc::TFD_CLOEXEC;
            // SAFETY: plain syscall; the result is checked before use.
            let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, flags) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` was just created and is owned by nobody else.
            Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
        }

        /// A new one, registered with the current runtime's reactor.
        pub(super) fn registered() -> io::Result<AsyncFd<Self>> {
            // SAFETY: the fd is owned by the `TimerFd` moved into the
            // `AsyncFd`, which never replaces or closes it while registered.
            unsafe { AsyncFd::register_with_interest(Self::new()?, Interest::READABLE) }
                .map_err(io::Error::other)
        }

        /// Expires once, `after` from now (at once for zero); `None` disarms.
        pub(super) fn arm(&self, after: Option<Duration>) -> io::Result<()> {
            let value = match after {
                // A zero time would disarm it: one nanosecond is "at once".
                Some(d) => libc::timespec {
                    tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
                    tv_nsec: d.subsec_nanos().max(u32::from(d.is_zero())) as libc::c_long,
                },
                None => libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
            };
            let spec = libc::itimerspec {
                it_interval: libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
                it_value: value,
            };
            // SAFETY: `spec` is a valid itimerspec; the old value is not asked for.
            match unsafe {
                libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut())
            } {
                0 => Ok(()),
                _ => Err(io::Error::last_os_error()),
            }
        }

        /// Whether it expired since last asked (reading resets it).
        pub(super) fn expired(&self) -> bool {
            let mut count = 0u64;
            // SAFETY: reads at most 8 bytes into `count`, which has 8.
            let n = unsafe {
                libc::read(
                    self.0.as_raw_fd(),
                    (&mut count as *mut u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            n == 8 && count > 0
        }
    }

    impl AsRawFd for TimerFd {
        fn as_raw_fd(&self) -> RawFd {
            self.0.as_raw_fd()
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests {
    use std::time::{Duration, Instant};

    use super::{Alarm, Clock};

    #[tokio::test(flavor = "current_thread")]
    async fn rings_at_its_time_never_before() {
        let mut alarm = Alarm::new(Clock::start());
        for ms in [0u64, 1, 3, 7] {
            let at = Instant::now() + Duration::from_millis(ms);
            alarm.set(Some(at));
            alarm.rings().await;
            assert!(Instant::now() >= at, "rang early");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_reset_time_replaces_the_old_one() {
        let mut alarm = Alarm::new(Clock::start());
        let start = Instant::now();
        alarm.set(Some(start + Duration::from_secs(3600)));
        let soon = start + Duration::from_millis(5);
        alarm.set(Some(soon));
        tokio::time::timeout(Duration::from_secs(10), alarm.rings())
            .await
            .expect("the earlier time rang");
        assert!(Instant::now() >= soon);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn an_unset_alarm_never_rings() {
        let mut alarm = Alarm::new(Clock::start());
        alarm.set(Some(Instant::now() + Duration::from_millis(1)));
        alarm.set(None);
        let rang = tokio::time::timeout(Duration::from_millis(30), alarm.rings()).await;
        assert!(rang.is_err());
    }

    #[cfg(target_os = "linux")]
    #[tokio::test(flavor = "current_thread")]
    async fn the_kernel_timer_is_in_use() {
        assert!(Alarm::new(Clock::start()).fd.is_some());
    }
}

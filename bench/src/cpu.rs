//! CPU accounting from /proc: how busy the machine was during a measurement
//! and how much CPU the client (this process), the broker and nackd spent.
//! On a small machine the three share the CPUs, so a rate means little
//! without the CPU it cost each of them.

/// Clock ticks per second of /proc (USER_HZ, 100 on Linux' usual targets).
const TICKS_PER_SECOND: f64 = 100.0;

/// The processes whose CPU time is counted; `None` = not known or not there.
#[derive(Clone, Copy, Debug, Default)]
pub struct Processes {
    /// The benchmark itself (lapin clients).
    pub client: Option<u32>,
    /// RabbitMQ's Erlang VM.
    pub broker: Option<u32>,
    /// The nackd in the path.
    pub nackd: Option<u32>,
}

/// Counters at one instant, in clock ticks.
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    busy: u64,
    total: u64,
    client: Option<u64>,
    broker: Option<u64>,
    nackd: Option<u64>,
}

/// CPU use between two samples.
#[derive(Clone, Copy, Debug)]
pub struct CpuUse {
    /// Fraction of all CPUs that was busy (0–1).
    pub machine_busy: f64,
    /// CPU seconds per second (1.0 = one core) of the client.
    pub client: Option<f64>,
    /// Same, of the broker.
    pub broker: Option<f64>,
    /// Same, of nackd.
    pub nackd: Option<f64>,
}

impl CpuSample {
    /// Reads /proc/stat and the stat file of each known process.
    pub fn now(processes: &Processes) -> Self {
        let (busy, total) = machine_ticks().unwrap_or((0, 0));
        Self {
            busy,
            total,
            client: processes.client.and_then(process_ticks),
            broker: processes.broker.and_then(process_ticks),
            nackd: processes.nackd.and_then(process_ticks),
        }
    }

    /// Use from `self` to `later`, `seconds` apart.
    pub fn until(&self, later: &CpuSample, seconds: f64) -> CpuUse {
        let cores = |a: Option<u64>, b: Option<u64>| {
            Some(b?.saturating_sub(a?) as f64 / TICKS_PER_SECOND / seconds)
        };
        let total = later.total.saturating_sub(self.total);
        CpuUse {
            machine_busy: match total {
                0 => f64::NAN,
                t => later.busy.saturating_sub(self.busy) as f64 / t as f64,
            },
            client: cores(self.client, later.client),
            broker: cores(self.broker, later.broker),
            nackd: cores(self.nackd, later.nackd),
        }
    }
}

/// The pid of the only `beam.smp` running, if exactly one runs (the local
/// RabbitMQ); `None` when there is none or several.
pub fn broker_pid() -> Option<u32> {
    let mut found = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if std::fs::read_to_string(entry.path().join("comm")).is_ok_and(|c| c.trim() == "beam.smp")
        {
            if found.is_some() {
                return None;
            }
            found = Some(pid);
        }
    }
    found
}

/// Busy and total ticks of all CPUs (first line of /proc/stat); idle and
/// iowait count as not busy, guest time is already inside user time.
fn machine_ticks() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = text
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|t| t.parse().ok())
        .collect::<Option<_>>()?;
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle, total))
}

/// utime + stime of `pid` (fields 14 and 15 of /proc/pid/stat, counted
/// after the parenthesised command name, which may contain spaces).
fn process_ticks(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_comm = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // after_comm starts at field 3 (state): utime is field 14, stime 15.
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_this_process_and_the_machine() {
        let me = Processes {
            client: Some(std::process::id()),
            ..Processes::default()
        };
        let before = CpuSample::now(&me);
        let began = std::time::Instant::now();
        // Spin long enough for many clock ticks of CPU time, even on a
        // loaded machine.
        let mut x = 0u64;
        while began.elapsed() < std::time::Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let used = before.until(&CpuSample::now(&me), began.elapsed().as_secs_f64());
        let client = used.client.expect("own stat file");
        // Wrong fields would read 0 (children's time) or far more than a core.
        assert!(
            client > 0.0 && client < 1.5,
            "one spinning thread is at most about one core: {client}"
        );
        assert!(
            used.machine_busy > 0.0 && used.machine_busy <= 1.0,
            "{}",
            used.machine_busy
        );
        assert_eq!(used.nackd, None);
    }
}

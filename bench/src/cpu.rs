//! CPU accounting from /proc: how busy the machine was during a measurement
//! and how much CPU the client (this process), the broker and the proxy in
//! the path (nackd or HAProxy) spent. On a small machine they share the
//! CPUs, so a rate means little without the CPU it cost each of them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Instant;

/// Clock ticks per second of /proc (USER_HZ, 100 on Linux' usual targets).
const TICKS_PER_SECOND: f64 = 100.0;

/// The processes whose CPU time is counted; `None` = not known or not there.
#[derive(Clone, Copy, Debug, Default)]
pub struct Processes {
    /// The benchmark itself (lapin clients).
    pub client: Option<u32>,
    /// RabbitMQ's Erlang VM.
    pub broker: Option<u32>,
    /// The proxy in the path (nackd or HAProxy); `None` direct.
    pub proxy: Option<u32>,
}

/// Counters at one instant, in clock ticks.
#[derive(Clone, Copy, Debug)]
pub struct CpuSample {
    at: Instant,
    busy: u64,
    total: u64,
    client: Option<u64>,
    broker: Option<u64>,
    proxy: Option<u64>,
}

/// CPU use between two samples.
#[derive(Clone, Copy, Debug)]
pub struct CpuUse {
    /// The seconds between the two samples.
    pub seconds: f64,
    /// Fraction of all CPUs that was busy (0–1).
    pub machine_busy: f64,
    /// CPU seconds per second (1.0 = one core) of the client.
    pub client: Option<f64>,
    /// Same, of the broker.
    pub broker: Option<f64>,
    /// Same, of the proxy in the path.
    pub proxy: Option<f64>,
}

impl CpuSample {
    /// Reads /proc/stat and the stat file of each known process.
    pub fn now(processes: &Processes) -> Self {
        let (busy, total) = machine_ticks().unwrap_or((0, 0));
        Self {
            at: Instant::now(),
            busy,
            total,
            client: processes.client.and_then(process_ticks),
            broker: processes.broker.and_then(process_ticks),
            proxy: processes.proxy.and_then(process_ticks),
        }
    }

    /// Use from `self` to `later`, over the time that passed between the two
    /// readings (not the time asked of a sleep, which a loaded machine
    /// overshoots), so CPU and message rates cover the same span.
    pub fn until(&self, later: &CpuSample) -> CpuUse {
        let seconds = later.at.duration_since(self.at).as_secs_f64();
        let cores = |a: Option<u64>, b: Option<u64>| {
            Some(b?.saturating_sub(a?) as f64 / TICKS_PER_SECOND / seconds)
        };
        let total = later.total.saturating_sub(self.total);
        CpuUse {
            seconds,
            machine_busy: match total {
                0 => f64::NAN,
                t => later.busy.saturating_sub(self.busy) as f64 / t as f64,
            },
            client: cores(self.client, later.client),
            broker: cores(self.broker, later.broker),
            proxy: cores(self.proxy, later.proxy),
        }
    }
}

/// CPU µs per message of a process that used `cores` (CPU seconds per
/// second: user + system time of all its threads, whatever direction they
/// worked for) while `msgs_per_sec` messages went through.
pub fn us_per_message(cores: f64, msgs_per_sec: f64) -> f64 {
    cores / msgs_per_sec * 1e6
}

/// The pid of the broker at `addr`: the process that owns its listening
/// socket, else, for a broker on this host whose fds cannot be read (no
/// permission), the only `beam.smp` running; never a local process for a
/// remote broker. Returns the pid and how it was found.
pub fn broker_pid(addr: &str) -> Option<(u32, &'static str)> {
    use std::net::ToSocketAddrs;
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().ok()?.collect();
    if let Some(pid) = addrs.iter().copied().find_map(listener_pid) {
        return Some((pid, "owns the listening socket"));
    }
    if !addrs.iter().all(|a| a.ip().is_loopback()) {
        return None;
    }
    only_beam().map(|pid| (pid, "the only beam.smp running"))
}

/// The only `beam.smp` running, if exactly one runs.
fn only_beam() -> Option<u32> {
    let mut found = None;
    for (pid, dir) in pids()? {
        if std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.trim() == "beam.smp") {
            if found.is_some() {
                return None;
            }
            found = Some(pid);
        }
    }
    found
}

/// Every process: its pid and /proc directory.
fn pids() -> Option<impl Iterator<Item = (u32, std::path::PathBuf)>> {
    let entries = std::fs::read_dir("/proc").ok()?.flatten();
    Some(entries.filter_map(|e| {
        let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
        Some((pid, e.path()))
    }))
}

/// The pid of a process holding a TCP socket that listens on `addr` (on
/// its address, or on a wildcard address that takes it: `0.0.0.0`, or
/// `::` and IPv4-mapped addresses for an IPv4 `addr`).
pub fn listener_pid(addr: SocketAddr) -> Option<u32> {
    let tables: &[&str] = match addr {
        SocketAddr::V4(_) => &["/proc/net/tcp", "/proc/net/tcp6"],
        SocketAddr::V6(_) => &["/proc/net/tcp6"],
    };
    let inode = tables.iter().find_map(|table| {
        let text = std::fs::read_to_string(table).ok()?;
        listening_inode(&text, addr)
    })?;
    let link = format!("socket:[{inode}]");
    pids()?.find_map(|(pid, dir)| {
        let fds = std::fs::read_dir(dir.join("fd")).ok()?;
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == link.as_str()))
            .then_some(pid)
    })
}

/// The inode of the socket listening on `addr` in the text of
/// /proc/net/tcp or tcp6 (`sl local_address rem_address st ... inode`,
/// addresses as hex words in the kernel's byte order, state 0A = LISTEN).
fn listening_inode(table: &str, addr: SocketAddr) -> Option<u64> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
        let (ip, port) = local.split_once(':')?;
        let port = u16::from_str_radix(port, 16).ok()?;
        let matches = *state == "0A" && port == addr.port() && takes(hex_ip(ip)?, addr.ip());
        matches.then(|| inode.parse().ok()).flatten()
    })
}

/// Whether a socket bound to `bound` receives connections to `to`.
fn takes(bound: IpAddr, to: IpAddr) -> bool {
    let mapped = match bound {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    bound == to || mapped == Some(to) || bound.is_unspecified()
}

/// An address of /proc/net/tcp{,6}: 32-bit words in hex, each in the
/// kernel's (native) byte order.
fn hex_ip(hex: &str) -> Option<IpAddr> {
    let words: Vec<[u8; 4]> = (0..hex.len() / 8)
        .map(|i| u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok())
        .map(|w| w.map(u32::to_ne_bytes))
        .collect::<Option<_>>()?;
    match words.as_slice() {
        [a] => Some(IpAddr::V4(Ipv4Addr::from(*a))),
        [a, b, c, d] if hex.len() == 32 => {
            let mut octets = [0u8; 16];
            for (i, w) in [a, b, c, d].into_iter().enumerate() {
                octets[i * 4..i * 4 + 4].copy_from_slice(w);
            }
            Some(IpAddr::V6(Ipv6Addr::from(octets)))
        }
        _ => None,
    }
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
        let used = before.until(&CpuSample::now(&me));
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
        assert_eq!(used.proxy, None);
    }

    #[test]
    fn cpu_per_message_is_cores_over_rate_in_microseconds() {
        // 0.3 of a core moving 20 000 msg/s: 15 µs each.
        assert!((us_per_message(0.3, 20_000.0) - 15.0).abs() < 1e-9);
        assert!((us_per_message(1.0, 1_000_000.0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn proc_net_tcp_addresses_in_kernel_byte_order() {
        // What /proc/net/tcp shows on a little-endian machine for
        // 127.0.0.1 and 0.0.0.0, and tcp6 for ::1.
        if cfg!(target_endian = "little") {
            assert_eq!(hex_ip("0100007F"), Some(IpAddr::from([127, 0, 0, 1])));
            assert_eq!(
                hex_ip("00000000000000000000000001000000"),
                Some(IpAddr::V6(Ipv6Addr::LOCALHOST))
            );
        }
        assert_eq!(hex_ip("00000000"), Some(IpAddr::from([0, 0, 0, 0])));
        assert_eq!(hex_ip("0100"), None);
    }

    #[test]
    fn finds_the_listening_row_only() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1628 00000000:0000 0A 00000000:00000000 00:00000000 00000000   107        0 1111 1 0 100 0 0 10 0
   1: 0100007F:1628 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000   107        0 2222 1 0 20 4 30 10 -1
   2: 00000000:162B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3333 1 0 100 0 0 10 0
";
        if cfg!(target_endian = "little") {
            let at = |s: &str| s.parse::<SocketAddr>().unwrap();
            assert_eq!(listening_inode(table, at("127.0.0.1:5672")), Some(1111));
            assert_eq!(listening_inode(table, at("127.0.0.2:5672")), None);
            // A wildcard listener serves every address of its family.
            assert_eq!(listening_inode(table, at("127.0.0.1:5675")), Some(3333));
            assert_eq!(listening_inode(table, at("127.0.0.1:5999")), None);
        }
    }

    #[test]
    fn which_bound_addresses_take_a_connection() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(takes(ip("127.0.0.1"), ip("127.0.0.1")));
        assert!(takes(ip("0.0.0.0"), ip("127.0.0.1")));
        assert!(takes(ip("::"), ip("127.0.0.1")), "dual-stack wildcard");
        assert!(takes(ip("::ffff:127.0.0.1"), ip("127.0.0.1")));
        assert!(!takes(ip("127.0.0.2"), ip("127.0.0.1")));
        assert!(!takes(ip("::1"), ip("127.0.0.1")));
    }

    #[test]
    fn a_remote_broker_is_never_a_local_process() {
        // Nothing on this host listens for 192.0.2.1 (TEST-NET-1), and the
        // local beam.smp, if any, is not that broker.
        assert_eq!(broker_pid("192.0.2.1:5672"), None);
    }

    #[test]
    fn the_owner_of_a_listening_socket_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        assert_eq!(listener_pid(addr), Some(std::process::id()));
        drop(listener);
        assert_eq!(listener_pid(addr), None, "nobody listens any more");
    }
}

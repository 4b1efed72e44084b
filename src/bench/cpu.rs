//! CPU accounting from `/proc`: server processes, this process, and everything else.
//!
//! A benchmark on a 2-core machine shares the cores with its load generator, so throughput
//! alone says little: every run reports the server's CPU per operation, and how much CPU
//! *other* processes used meanwhile ("foreign" load), so noisy runs can be thrown away.

use std::time::Instant;

/// Linux reports `/proc` CPU times in USER_HZ ticks, which is 100 on every mainstream build.
const TICKS_PER_SECOND: f64 = 100.0;

/// utime + stime of a process (all its threads), in seconds; `None` if it is gone.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    stat_cpu_seconds(&format!("/proc/{pid}/stat"))
}

/// utime + stime of this process, in seconds. Read through `/proc/self`, which names this
/// process even where `/proc` was mounted for another PID namespace than ours.
pub fn own_cpu_seconds() -> Option<f64> {
    stat_cpu_seconds("/proc/self/stat")
}

fn stat_cpu_seconds(path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name (field 2) may contain spaces; fields after the closing paren are fixed.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_SECOND)
}

/// Busy CPU time of the whole machine (every state but idle and iowait), in seconds.
pub fn machine_busy_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<f64> = line.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal ...
    let busy: f64 = v.iter().enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, x)| x).take(8).sum();
    Some(busy / TICKS_PER_SECOND)
}

/// A CPU sample of the servers, this process and the machine.
#[derive(Debug, Clone)]
pub struct CpuSample {
    at: Instant,
    servers: f64,
    own: f64,
    machine: f64,
}

impl CpuSample {
    /// Samples now.
    pub fn take(server_pids: &[u32]) -> Self {
        CpuSample {
            at: Instant::now(),
            servers: server_pids.iter().filter_map(|&p| process_cpu_seconds(p)).sum(),
            own: own_cpu_seconds().unwrap_or(0.0),
            machine: machine_busy_seconds().unwrap_or(0.0),
        }
    }
}

/// CPU used between two samples.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct CpuUse {
    /// CPU seconds of the server processes.
    pub server_seconds: f64,
    /// Cores the servers used on average.
    pub server_cores: f64,
    /// Cores this load generator used.
    pub client_cores: f64,
    /// Cores everything else used: a run with more than 0.1 should be repeated.
    pub foreign_cores: f64,
}

impl CpuUse {
    /// The use between `start` and `end`.
    pub fn between(start: &CpuSample, end: &CpuSample) -> Self {
        let wall = end.at.duration_since(start.at).as_secs_f64().max(1e-9);
        let server = end.servers - start.servers;
        let own = end.own - start.own;
        let machine = end.machine - start.machine;
        CpuUse {
            server_seconds: server,
            server_cores: server / wall,
            client_cores: own / wall,
            foreign_cores: (machine - server - own) / wall,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cpu_time() {
        // The kernel counts CPU time in whole ticks: burn until one shows (a fixed loop may end
        // before the first tick on a fast machine), bounded by a deadline.
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let mut x = 0u64;
        let mut i = 0u64;
        while own_cpu_seconds().is_none_or(|s| s == 0.0) && Instant::now() < deadline {
            for _ in 0..1_000_000 {
                i += 1;
                x = std::hint::black_box(x.wrapping_add(i * i));
            }
        }
        // (No assertion on `x`: when other tests of this process already took a tick, the loop
        // never runs.)
        std::hint::black_box(x);
        assert!(own_cpu_seconds().is_some_and(|s| s > 0.0));
        assert!(machine_busy_seconds().is_some_and(|s| s > 0.0));
        assert_eq!(process_cpu_seconds(u32::MAX), None);
    }
}

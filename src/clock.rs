//! The clock the latency figures read once per round trip.
//!
//! `ucx_perftest` and perftest read the CPU's time-stamp counter (`rdtsc`, ~10 ns on the
//! development host); `std::time::Instant::now` goes through the vDSO's `clock_gettime`,
//! which under a hypervisor costs ~25 ns there (and steps in 10 ns). At an 8-byte
//! shared-memory round trip of ~300 ns that difference is ~5 % of the figure and belongs to
//! the harness, not to the transport: timing with the same kind of clock as the reference
//! keeps the comparison like for like.
//!
//! [`Clock::new`] uses the counter only where the kernel keeps its own time with it
//! (`/sys/devices/system/clocksource/clocksource0/current_clocksource` is `tsc`: the kernel
//! found it constant-rate and synchronised across CPUs), calibrated against `Instant` for
//! 20 ms; elsewhere, or with `FABRIC_PERF_CLOCK=std`, it reads `Instant`.

use std::time::{Duration, Instant};

/// A stamp source and the conversion of stamp differences to microseconds.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    source: Source,
}

#[derive(Debug, Clone, Copy)]
enum Source {
    /// The time-stamp counter, at this many ticks per microsecond.
    Tsc { ticks_per_us: f64 },
    /// `Instant`, as nanoseconds since `base`.
    Std { base: Instant },
}

impl Clock {
    /// The time-stamp counter where the kernel trusts it (see the module docs), else
    /// `Instant`; `FABRIC_PERF_CLOCK=std` forces `Instant`.
    pub fn new() -> Self {
        let want_std = std::env::var("FABRIC_PERF_CLOCK").is_ok_and(|v| v == "std");
        if !want_std && kernel_uses_tsc() {
            if let Some(ticks_per_us) = calibrate() {
                return Clock {
                    source: Source::Tsc { ticks_per_us },
                };
            }
        }
        Clock::standard()
    }

    /// Always `Instant`.
    pub fn standard() -> Self {
        Clock {
            source: Source::Std {
                base: Instant::now(),
            },
        }
    }

    /// What the figures are timed with, for a report's header.
    pub fn name(&self) -> &'static str {
        match self.source {
            Source::Tsc { .. } => "time-stamp counter",
            Source::Std { .. } => "clock_gettime",
        }
    }

    /// A stamp: only differences of two stamps of one clock mean anything.
    #[inline]
    pub fn now(&self) -> u64 {
        match self.source {
            Source::Tsc { .. } => tsc(),
            Source::Std { base } => base.elapsed().as_nanos() as u64,
        }
    }

    /// Microseconds from stamp `from` to stamp `to` (zero if `to` is earlier).
    pub fn micros(&self, from: u64, to: u64) -> f64 {
        let d = to.saturating_sub(from) as f64;
        match self.source {
            Source::Tsc { ticks_per_us } => d / ticks_per_us,
            Source::Std { .. } => d / 1e3,
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

fn kernel_uses_tsc() -> bool {
    cfg!(target_arch = "x86_64")
        && std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .is_ok_and(|s| s.trim() == "tsc")
}

/// Counter ticks per microsecond, measured against `Instant` over 20 ms; `None` when the
/// counter does not move forward at a plausible rate (0.1–100 GHz).
fn calibrate() -> Option<f64> {
    let (t0, c0) = (Instant::now(), tsc());
    std::thread::sleep(Duration::from_millis(20));
    let (c1, t1) = (tsc(), Instant::now());
    let us = (t1 - t0).as_secs_f64() * 1e6;
    let rate = c1.checked_sub(c0)? as f64 / us;
    (100.0..=100_000.0).contains(&rate).then_some(rate)
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[allow(unsafe_code)]
fn tsc() -> u64 {
    // SAFETY: `rdtsc` reads a register; it has no memory effects and every x86_64 CPU has
    // it (the kernel using it as its clocksource was checked before this is called).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn tsc() -> u64 {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sources measure a sleep as at least its length and not wildly more (the
    /// counter's calibration would be off by its ratio otherwise).
    #[test]
    fn both_sources_time_a_sleep() {
        for c in [Clock::new(), Clock::standard()] {
            let a = c.now();
            std::thread::sleep(Duration::from_millis(30));
            let us = c.micros(a, c.now());
            assert!(
                (29_000.0..3_000_000.0).contains(&us),
                "{}: a 30 ms sleep timed as {us} us",
                c.name()
            );
        }
    }

    #[test]
    fn an_earlier_stamp_is_zero_not_negative() {
        let c = Clock::new();
        let a = c.now();
        let b = c.now();
        assert_eq!(c.micros(b.max(a) + 1, a.min(b)), 0.0);
    }
}

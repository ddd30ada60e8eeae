//! The README's main job, end to end: `pingpong` with no peer arguments spawns its own
//! peer and prints the table (shm, then tcp via `FABRIC_TRANSPORT`); `bandwidth` and
//! `fabric_info` run to completion. `cargo test` builds the examples next to the test
//! binaries (`target/<profile>/examples/`).

mod support;
use std::path::PathBuf;
use std::process::Command;
use support::skip;

fn example(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join(name);
    p.exists().then_some(p)
}

fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> Option<String> {
    let Some(path) = example(name) else {
        skip(
            "examples",
            format_args!("example binary {name} not built next to this test"),
        );
        return None;
    };
    let mut cmd = Command::new(path);
    cmd.args(args).env_remove("FABRIC_TRANSPORT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run example");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Some(stdout)
}

fn rows(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

#[test]
fn pingpong_main_job_over_shm_and_tcp() {
    for (transport, expect) in [
        ("", "transport shm on the transport"),
        ("tcp", "transport tcp on the transport"),
    ] {
        let env: Vec<(&str, &str)> = if transport.is_empty() {
            vec![]
        } else {
            vec![("FABRIC_TRANSPORT", transport)]
        };
        let Some(out) = run("pingpong", &["--max-size", "65536", "--iters", "200"], &env) else {
            return;
        };
        assert!(out.contains(expect), "{out}");
        let r = rows(&out);
        let sizes: Vec<&str> = r.iter().map(|r| r[0].as_str()).collect();
        assert_eq!(sizes.first(), Some(&"8"), "{out}");
        assert_eq!(sizes.last(), Some(&"65536"), "{out}");
        for row in &r {
            let lat: f64 = row[2].parse().expect("latency figure");
            let bw: f64 = row[4].parse().expect("bandwidth figure");
            assert!(lat > 0.0 && bw >= 0.0, "{row:?}");
        }
    }
}

/// `bandwidth` over 64 KiB – 1 MiB, 50 iterations, one trial, with `extra` arguments.
fn bandwidth_small(extra: &[&str]) -> Option<String> {
    let mut args = vec![
        "--min-size",
        "65536",
        "--max-size",
        "1048576",
        "--iters",
        "50",
        "--trials",
        "1",
    ];
    args.extend_from_slice(extra);
    run("bandwidth", &args, &[])
}

#[test]
fn bandwidth_all_modes() {
    let Some(out) = bandwidth_small(&[]) else {
        return;
    };
    // send, bisend, write, read, the responder's memcpy, send / memcpy.
    assert_positive_figures(&out, 6);
}

/// Five sizes (64 KiB – 1 MiB), each row `figures` positive numbers after the size.
fn assert_positive_figures(out: &str, figures: usize) {
    let r = rows(out);
    assert_eq!(r.len(), 5, "{out}");
    for row in &r {
        assert_eq!(row.len(), 1 + figures, "{row:?}");
        for v in &row[1..] {
            assert!(v.parse::<f64>().expect("figure") > 0.0, "{row:?}");
        }
    }
}

/// `--streaming-receives` marks both sides' receive buffers streaming for the send phases
/// (the responder learns it from the phase's control message): the run says so and
/// measures every size.
#[test]
fn bandwidth_with_streaming_receives() {
    let Some(out) = bandwidth_small(&["--modes", "send,bisend", "--streaming-receives"]) else {
        return;
    };
    assert!(out.contains("receives streaming"), "{out}");
    // send, bisend, the responder's memcpy, send / memcpy.
    assert_positive_figures(&out, 4);
}

#[test]
fn fabric_info_reports_without_panicking() {
    let Some(out) = run("fabric_info", &[], &[]) else {
        return;
    };
    assert!(out.contains("== transports"), "{out}");
    assert!(out.contains("shm       usable"), "{out}");
    assert!(out.contains("tcp       usable"), "{out}");
    // Each listed NIC shows its GPU-memory probe, and each active port its speed.
    let nics = fabric_core::topology::nics().unwrap_or_default();
    for n in &nics {
        assert!(out.contains(&format!("  {}: pci", n.name)), "{out}");
    }
    if !nics.is_empty() {
        assert!(out.contains("GPU memory (DMA-BUF): "), "{out}");
    }
    if nics
        .iter()
        .any(|n| n.ports.iter().any(|p| p.active && p.gbps().is_some()))
    {
        assert!(out.contains(" Gb/s ("), "{out}");
    }
}

/// The main job over RDMA when this machine has an active RDMA port (the Soft-RoCE guest).
#[test]
fn pingpong_over_verbs_when_available() {
    if let Err(e) = (fabric_core::backend::verbs::ENTRY.probe)() {
        skip(
            "rdma",
            format_args!("pingpong_over_verbs_when_available: {e}"),
        );
        return;
    }
    let Some(out) = run(
        "pingpong",
        &["--max-size", "65536", "--iters", "50", "--no-bw"],
        &[("FABRIC_TRANSPORT", "verbs")],
    ) else {
        return;
    };
    assert!(out.contains("transport verbs on the transport"), "{out}");
    assert_eq!(
        rows(&out).last().map(|r| r[0].as_str()),
        Some("65536"),
        "{out}"
    );
    // The same through a worker on both sides (the shared completion queue's path).
    let Some(out) = run(
        "pingpong",
        &["--max-size", "4096", "--iters", "50", "--no-bw", "--worker"],
        &[("FABRIC_TRANSPORT", "verbs")],
    ) else {
        return;
    };
    assert!(out.contains("transport verbs on the worker"), "{out}");
    assert_eq!(
        rows(&out).last().map(|r| r[0].as_str()),
        Some("4096"),
        "{out}"
    );
}

/// `--worker`: both sides drive their connection through a `Worker` (one endpoint each);
/// every figure comes out and every phase (echo, streams both ways, one-sided) completes.
#[test]
fn pingpong_and_bandwidth_on_a_worker() {
    for transport in ["shm", "tcp"] {
        let env = [("FABRIC_TRANSPORT", transport)];
        let args = ["--max-size", "65536", "--iters", "200", "--worker"];
        let Some(out) = run("pingpong", &args, &env) else {
            return;
        };
        assert!(
            out.contains(&format!("transport {transport} on the worker")),
            "{out}"
        );
        let r = rows(&out);
        assert_eq!(r.first().map(|r| r[0].as_str()), Some("8"), "{out}");
        assert_eq!(r.last().map(|r| r[0].as_str()), Some("65536"), "{out}");
        for row in &r {
            let lat: f64 = row[2].parse().expect("latency figure");
            let bw: f64 = row[4].parse().expect("bandwidth figure");
            assert!(lat > 0.0 && bw > 0.0, "{row:?}");
        }
        let args = [
            "--min-size",
            "65536",
            "--max-size",
            "262144",
            "--iters",
            "50",
            "--trials",
            "1",
            "--worker",
        ];
        let Some(out) = run("bandwidth", &args, &env) else {
            return;
        };
        assert!(out.contains("on the worker"), "{out}");
        let r = rows(&out);
        assert_eq!(r.len(), 3, "{out}");
        for row in &r {
            for v in &row[1..6] {
                assert!(v.parse::<f64>().expect("figure") > 0.0, "{row:?}");
            }
        }
    }
}

/// `pingpong | head -1`: the reader goes away after the first line; the example ends the way
/// a C tool does (killed by `SIGPIPE`, or done), with nothing on stderr — no "failed printing
/// to stdout" panic, and no error from its spawned peer, whose initiator is gone.
#[test]
fn output_into_a_pipe_that_closes_ends_quietly() {
    use std::io::{BufRead, BufReader, Read};
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    // Many sizes, each measured before its row: the examples are still printing well after
    // the reader left (a run that ended before would prove nothing).
    for (name, args) in [
        (
            "pingpong",
            &["--no-bw", "--max-size", "1048576", "--iters", "2000"][..],
        ),
        ("bandwidth", &["--modes", "send", "--iters", "200"][..]),
    ] {
        let Some(path) = example(name) else {
            skip(
                "examples",
                format_args!("example binary {name} not built next to this test"),
            );
            return;
        };
        let mut child = Command::new(path)
            .args(args)
            .env_remove("FABRIC_TRANSPORT")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut first = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut first)
            .expect("first line");
        // The reader (and with it the pipe's only read end) is gone here.
        assert!(!first.is_empty(), "{name}: no output");
        let mut err = String::new();
        child
            .stderr
            .take()
            .expect("stderr")
            .read_to_string(&mut err)
            .expect("stderr");
        let st = child.wait().expect("wait");
        assert!(
            st.success() || st.signal() == Some(libc::SIGPIPE),
            "{name}: {st}, stderr:\n{err}"
        );
        assert!(err.is_empty(), "{name}: stderr:\n{err}");
    }
}

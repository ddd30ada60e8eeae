//! `examples/allreduce` end to end: 2, 3 and 4 processes over shm and tcp (and verbs
//! where an RDMA port is active), both algorithms forced over small sizes with tiny chunks
//! (uneven segments, more chunks than slots), recursive doubling by two-sided sends and by
//! one-sided puts with flag words (below, across and above the put threshold), the ring's
//! reduce-scatter by sends and by one-sided writes with credits, the one-sided all-gather,
//! and a deliberately wrong input that the example's check must catch (non-zero exit).

mod support;
use std::path::PathBuf;
use std::process::{Command, Output};
use support::skip;

fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join("allreduce");
    p.exists().then_some(p)
}

fn run(args: &[&str]) -> Option<Output> {
    let Some(path) = example() else {
        skip(
            "examples",
            format_args!("example binary allreduce not built next to this test"),
        );
        return None;
    };
    let out = Command::new(path)
        .args(args)
        .env_remove("FABRIC_TRANSPORT")
        // Not under a launcher, whatever the test's environment says.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("PMI_RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .expect("run allreduce");
    Some(out)
}

/// Runs and requires success; returns the table rows (size, count, iters, algo, time,
/// algbw, busbw, check).
fn rows_of(args: &[&str]) -> Option<Vec<Vec<String>>> {
    Some(rows_in(args, &run(args)?))
}

/// The table rows of a finished run of `args` (which must have succeeded).
fn rows_in(args: &[&str], out: &Output) -> Vec<Vec<String>> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "allreduce {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// Runs `args` (ring sizes `min` to `max`), requires its header to contain `says` and every
/// size to be there and checked.
fn ring_run_says(args: &[&str], says: &str, min: usize, max: usize, ctx: &str) {
    let Some(out) = run(args) else {
        return;
    };
    let rows = rows_in(args, &out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(says),
        "{ctx}: header without {says:?}:\n{stdout}"
    );
    assert_table(&rows, min, max, "ring", ctx);
}

/// Every size from `min` to `max` appears once, checked, with the algorithm asked for.
fn assert_table(rows: &[Vec<String>], min: usize, max: usize, algo: &str, ctx: &str) {
    let mut want = Vec::new();
    let mut s = min;
    while s <= max {
        want.push(s.to_string());
        s *= 2;
    }
    let sizes: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(sizes, want, "{ctx}: sizes");
    for r in rows {
        assert_eq!(r.len(), 8, "{ctx}: {r:?}");
        assert_eq!(r[3], algo, "{ctx}: {r:?}");
        assert_eq!(r[7], "ok", "{ctx}: unchecked row {r:?}");
        let t: f64 = r[4].parse().expect("time");
        assert!(t > 0.0, "{ctx}: {r:?}");
    }
}

fn correctness(transport: &str) {
    for ranks in ["2", "3", "4"] {
        let ctx = format!("{transport}, {ranks} ranks");
        // Recursive doubling (folding in the extra ranks of 3), by two-sided sends and by
        // one-sided puts (a write into the partner's slot and a fetch-add on its flag word;
        // 4 bytes in the flag word alone); 2 iterations per size plus warm-up, check and
        // barriers: both slot and flag parities are reused many times.
        let common = [
            "--ranks",
            ranks,
            "--transport",
            transport,
            "--iters",
            "2",
            "--warmup",
            "1",
        ];
        for mode in ["send", "put"] {
            let mut a = common.to_vec();
            a.extend([
                "--algo",
                "rd",
                "--rd-mode",
                mode,
                "--min-bytes",
                "4",
                "--max-bytes",
                "256",
            ]);
            let Some(rows) = rows_of(&a) else { return };
            assert_table(&rows, 4, 256, "rd", &format!("{ctx}, rd by {mode}"));
        }
        // Puts of vectors as long as one copy block (16 KiB) and longer, and (on shm,
        // which stores them through remote windows by default) posted puts as well.
        for window in ["true", "false"] {
            let mut a = common.to_vec();
            a.extend([
                "--algo",
                "rd",
                "--rd-mode",
                "put",
                "--put-max-bytes",
                "32768",
                "--window",
                window,
                "--min-bytes",
                "4",
                "--max-bytes",
                "32768",
            ]);
            let rows = rows_of(&a).expect("built");
            assert_table(
                &rows,
                4,
                32768,
                "rd",
                &format!("{ctx}, rd by put, window {window}"),
            );
        }
        // Across the put threshold: puts up to 1 KiB, sends above, in one run (every rank
        // makes the same choice per size).
        let mut a = common.to_vec();
        a.extend([
            "--algo",
            "rd",
            "--rd-mode",
            "put",
            "--put-max-bytes",
            "1024",
            "--min-bytes",
            "512",
            "--max-bytes",
            "4096",
        ]);
        let rows = rows_of(&a).expect("built");
        assert_table(
            &rows,
            512,
            4096,
            "rd",
            &format!("{ctx}, rd by put then send"),
        );
        // The ring with 64-byte chunks and 2 slots: many chunks per segment, uneven
        // segments (counts not divisible by 3), segments shorter than a chunk; with the
        // reduce-scatter by two-sided sends and by one-sided writes with credits (2 slots:
        // every slot is reused many times per operation, so a credit that came too early
        // would corrupt a sum and fail the check). With 4 slots the write ring's operations
        // of 2 to 7 chunks per segment use the first 2, the others all 4: a slot handed
        // out before the neighbour finished with it (across operations of either kind), or
        // read at another place than it was written, fails the check (the checked
        // operation runs on a changed input).
        for (rs, slots) in [("send", "2"), ("write", "2"), ("write", "4")] {
            let mut a = common.to_vec();
            a.extend([
                "--algo",
                "ring",
                "--rs",
                rs,
                "--min-bytes",
                "4",
                "--max-bytes",
                "4096",
                "--chunk-bytes",
                "64",
                "--slots",
                slots,
            ]);
            let rows = rows_of(&a).expect("built");
            assert_table(
                &rows,
                4,
                4096,
                "ring",
                &format!("{ctx}, reduce-scatter by {rs}, {slots} slots"),
            );
        }
        // The default choice across the threshold.
        let mut a = common.to_vec();
        a.extend([
            "--rd-max-bytes",
            "64",
            "--min-bytes",
            "32",
            "--max-bytes",
            "256",
        ]);
        let rows = rows_of(&a).expect("built");
        assert_eq!(rows.len(), 4, "{ctx}");
        assert!(rows.iter().all(|r| r[7] == "ok"), "{ctx}: {rows:?}");
        assert_eq!(rows[0][3], "rd", "{ctx}");
        assert_eq!(rows[3][3], "ring", "{ctx}");
    }
}

#[test]
fn correct_for_2_3_4_ranks_over_shm() {
    correctness("shm");
}

#[test]
fn correct_for_2_3_4_ranks_over_tcp() {
    correctness("tcp");
}

/// Over tcp the send ring's default chunks with 2 slots, on both sides of their rule: a 4 MiB
/// vector on 2 ranks goes in two 1 MiB chunks per 2 MiB segment (as many as the slots), an
/// 8 MiB one in 256 KiB chunks, sixteen per 4 MiB segment (more chunks than slots, so slots
/// are reused within a segment); 3 ranks give uneven segments and a last chunk shorter than
/// the others. The header names the rule, and every size is checked.
#[test]
fn tcp_send_ring_reuses_its_slots_within_a_segment() {
    for ranks in ["2", "3"] {
        let args = [
            "--slots",
            "2",
            "--ranks",
            ranks,
            "--transport",
            "tcp",
            "--min-bytes",
            "4194304",
            "--max-bytes",
            "8388608",
            "--iters",
            "2",
            "--warmup",
            "1",
        ];
        ring_run_says(
            &args,
            "ring chunk a segment up to 1048576 B, 262144 B past 2 MiB segments, 2 slots",
            4 << 20,
            8 << 20,
            &format!("tcp, {ranks} ranks"),
        );
    }
}

#[test]
fn one_sided_all_gather_over_tcp() {
    for ranks in ["2", "3"] {
        for rs in ["send", "write"] {
            let Some(rows) = rows_of(&[
                "--ranks",
                ranks,
                "--transport",
                "tcp",
                "--one-sided",
                "--rs",
                rs,
                "--algo",
                "ring",
                "--min-bytes",
                "4",
                "--max-bytes",
                "8192",
                "--chunk-bytes",
                "256",
                "--slots",
                "4",
                "--iters",
                "2",
            ]) else {
                return;
            };
            assert_table(
                &rows,
                4,
                8192,
                "ring-1s",
                &format!("tcp one-sided, {ranks} ranks, reduce-scatter by {rs}"),
            );
        }
    }
}

/// The check can fail: one rank's input is off by one behind the check's back, and the run
/// must exit non-zero naming the wrong element (for both algorithms, recursive doubling by
/// sends and by puts, 4 bytes riding in the flag word and 64 in a slot).
#[test]
fn a_wrong_sum_fails_the_run() {
    for (algo, mode, bytes, element) in [
        ("rd", "send", "64", "8"),
        ("rd", "put", "64", "8"),
        ("rd", "put", "4", "0"),
        ("ring", "send", "64", "8"),
    ] {
        for ranks in ["2", "3"] {
            let Some(out) = run(&[
                "--ranks",
                ranks,
                "--transport",
                "shm",
                "--algo",
                algo,
                "--rd-mode",
                mode,
                "--min-bytes",
                bytes,
                "--max-bytes",
                bytes,
                "--iters",
                "2",
                "--inject-error",
            ]) else {
                return;
            };
            let stderr = String::from_utf8_lossy(&out.stderr);
            let ctx = format!("{algo} by {mode}, {ranks} ranks, {bytes} B");
            assert!(
                !out.status.success(),
                "{ctx}: a wrong sum passed:\n{stderr}"
            );
            assert!(
                stderr.contains(&format!("wrong result at {bytes} B, element {element}")),
                "{ctx}: {stderr}"
            );
        }
    }
}

#[test]
fn bad_arguments_fail_cleanly() {
    let Some(out) = run(&["--ranks", "0"]) else {
        return;
    };
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--ranks"));
}

/// The launcher path: two processes started by "mpirun" (its environment, faked here)
/// find each other through `FABRIC_BOOTSTRAP`; rank 0 prints the table, both exit 0.
#[test]
fn ranks_from_a_launchers_environment() {
    let Some(path) = example() else {
        skip(
            "examples",
            format_args!("example binary allreduce not built next to this test"),
        );
        return;
    };
    // A free loopback port for rank 0's rendezvous.
    let port = support::free_port("127.0.0.1");
    let bootstrap = format!("127.0.0.1:{port}");
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&path)
                .args(["--max-bytes", "256", "--iters", "2", "--transport", "tcp"])
                .env_remove("FABRIC_TRANSPORT")
                .env("OMPI_COMM_WORLD_RANK", r.to_string())
                .env("OMPI_COMM_WORLD_SIZE", "2")
                .env("FABRIC_BOOTSTRAP", &bootstrap)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start a rank")
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait"))
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r}: {}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let table = String::from_utf8_lossy(&outs[0].stdout);
    assert!(table.contains("2 ranks, transport tcp"), "{table}");
    let rows = table
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert_eq!(rows, 7, "{table}");
    assert!(
        outs[1].stdout.is_empty(),
        "only rank 0 prints the table: {}",
        String::from_utf8_lossy(&outs[1].stdout)
    );
}

/// Over verbs where this machine has an active RDMA port (the Soft-RoCE guest).
#[test]
fn correct_over_verbs_when_available() {
    if let Err(e) = (fabric_core::backend::verbs::ENTRY.probe)() {
        skip("rdma", format_args!("allreduce over verbs: {e}"));
        return;
    }
    for ranks in ["2", "3", "4"] {
        for (algo, rs) in [("rd", "send"), ("ring", "send"), ("ring", "write")] {
            let Some(rows) = rows_of(&[
                "--ranks",
                ranks,
                "--transport",
                "verbs",
                "--algo",
                algo,
                "--rs",
                rs,
                "--min-bytes",
                "4",
                "--max-bytes",
                "16384",
                "--chunk-bytes",
                "1024",
                "--iters",
                "2",
            ]) else {
                return;
            };
            assert_table(
                &rows,
                4,
                16384,
                algo,
                &format!("verbs, {ranks} ranks, reduce-scatter by {rs}"),
            );
        }
    }
    // Figures for the record (the guest emulates its CPUs: not a speed result).
    let Some(out) = run(&[
        "--transport",
        "verbs",
        "--max-bytes",
        "1048576",
        "--iters",
        "20",
        "--warmup",
        "2",
    ]) else {
        return;
    };
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("allreduce over verbs, 2 ranks:\n{table}");
}

/// On shm recursive doubling's puts go through remote windows unless told otherwise; over
/// tcp (no windows) they are posted.
#[test]
fn puts_use_remote_windows_where_the_transport_maps_peers() {
    for (transport, window, want) in [
        ("shm", "true", "stored through windows"),
        ("shm", "false", "posted"),
        ("tcp", "true", "posted"),
    ] {
        let args = [
            "--transport",
            transport,
            "--rd-mode",
            "put",
            "--window",
            window,
            "--min-bytes",
            "4",
            "--max-bytes",
            "64",
        ];
        let Some(head) = header(&args) else { return };
        assert!(
            head.contains(want),
            "{args:?}: header {head:?}, want {want:?}"
        );
    }
}

/// Runs (requiring success) and returns the table's first line, its header.
fn header(args: &[&str]) -> Option<String> {
    let out = run(args)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{args:?}: {stdout}");
    Some(stdout.lines().next().unwrap_or_default().to_owned())
}

/// Ranks that have a CPU each spin while they wait; more ranks than CPUs yield at once.
/// (A rank pinned to its CPU sees only that one: counting CPUs after pinning once made
/// every 2-rank run on a 2-CPU host "oversubscribed", and its 4-byte all-reduce took 4x
/// as long, each wait a `sched_yield`.)
#[test]
fn waits_spin_when_every_rank_has_a_cpu() {
    let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
    let mut cases = Vec::new();
    if cpus >= 2 {
        cases.push((2, "waits spin"));
    } else {
        skip(
            "cpus",
            format_args!("one CPU: no run gives every rank a CPU (checking the yield only)"),
        );
    }
    if cpus < 8 {
        cases.push((cpus + 1, "waits yield"));
    }
    for (ranks, want) in cases {
        let ranks = ranks.to_string();
        let args = ["--ranks", &ranks, "--min-bytes", "4", "--max-bytes", "4"];
        let Some(head) = header(&args) else { return };
        assert!(
            head.contains(want),
            "{args:?} on {cpus} CPUs: header {head:?}, want {want:?}"
        );
    }
}

/// `--stream-output always` marks every output region streaming, so over shm the
/// all-gather's receives of 64 KiB and more land with non-temporal stores (fabric-core's
/// `copy` tests check those copies byte by byte); here every element of the sums is checked
/// on 2 and 3 ranks (uneven segments, a last chunk shorter than the others) with both
/// reduce-scatters, and the header says which sizes stream.
#[test]
fn streaming_output_sums_right_over_shm() {
    for ranks in ["2", "3"] {
        for rs in ["write", "send"] {
            let args = [
                "--ranks",
                ranks,
                "--transport",
                "shm",
                "--rs",
                rs,
                "--stream-output",
                "always",
                "--min-bytes",
                "131072",
                "--max-bytes",
                "2097152",
                "--iters",
                "3",
                "--warmup",
                "1",
            ];
            ring_run_says(
                &args,
                "output streams at every size",
                128 << 10,
                2 << 20,
                &format!("shm, {ranks} ranks, --rs {rs}, streaming output"),
            );
        }
    }
}

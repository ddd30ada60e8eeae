//! Bad peers against the `rc_pingpong` example's server (the `ibv_rc_pingpong` TCP
//! handshake of `fabric::pingpong_wire`): garbage, a truncated address, a flood of bytes and
//! a wrong final "done" message. Like rdma-core's `ibv_rc_pingpong`, the server serves one
//! client and exits; each bad client must make it exit with a clear error (status 1, the
//! reason on stderr) within a bounded time — never a panic (status 101), a signal or a hang.
//! The well-formed peer is the interop suite's job (`ci/softroce/guest-suite.sh` pairs our
//! server with rdma-core's client and ours).
//!
//! The server opens an RDMA device before it listens, so these tests need one: on a host
//! without RDMA they print `skipped: ...`; they run for real in the Soft-RoCE guest
//! (`ci/softroce/suite.sh` runs every workspace test executable there).
//! (The protocol has no shared secret, so there is no wrong-secret case here; the bootstrap
//! listener's wrong-secret case is in `tests/fabric_bootstrap.rs`.)

mod support;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::skip;

use fabric::pingpong_wire::{Destination, MESSAGE_LEN};

fn example() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("examples").join("rc_pingpong");
    p.exists().then_some(p)
}

/// The first RDMA device, or why there is none.
fn device() -> Result<String, String> {
    match ibverbs_safe::devices() {
        Ok(d) if !d.is_empty() => Ok(d[0].name.clone()),
        Ok(_) => Err("no RDMA device".into()),
        Err(e) => Err(format!("no RDMA device ({e})")),
    }
}

struct Server {
    child: Child,
    port: u16,
}

fn start_server(test: &str, port: u16) -> Option<Server> {
    let dev = match device() {
        Ok(d) => d,
        Err(why) => {
            skip(
                "rdma",
                format_args!("{test}: {why}; runs in the Soft-RoCE guest (ci/softroce/suite.sh)"),
            );
            return None;
        }
    };
    let Some(bin) = example() else {
        skip(
            "examples",
            format_args!("{test}: example binary rc_pingpong not built next to this test"),
        );
        return None;
    };
    let child = Command::new(bin)
        .args(["-p", &port.to_string(), "-d", &dev, "-g", "0", "-n", "10"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rc_pingpong server");
    Some(Server { child, port })
}

impl Server {
    fn connect(&mut self) -> TcpStream {
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(s) = TcpStream::connect(("127.0.0.1", self.port)) {
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                return s;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("server exited before listening: {st}: {}", self.stderr());
            }
            assert!(Instant::now() < end, "server never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stderr(&mut self) -> String {
        let mut e = String::new();
        if let Some(mut s) = self.child.stderr.take() {
            let _ = s.read_to_string(&mut e);
        }
        e
    }

    /// Waits (bounded) for the server to exit; returns (status code, stderr).
    fn finish(mut self) -> (Option<i32>, String) {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let err = self.stderr();
                return (st.code(), err);
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("server still running 30 s after a bad client: hang");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn expect_clean_refusal(test: &str, port: u16, client: impl FnOnce(TcpStream), reason: &[&str]) {
    let Some(mut srv) = start_server(test, port) else {
        return;
    };
    let s = srv.connect();
    client(s);
    let (code, err) = srv.finish();
    assert_eq!(
        code,
        Some(1),
        "{test}: expected an error exit (1), got {code:?}: {err}"
    );
    assert!(
        err.contains("rc_pingpong:"),
        "{test}: no error message: {err}"
    );
    assert!(
        reason.iter().any(|r| err.contains(r)),
        "{test}: error does not say why ({reason:?}): {err}"
    );
    assert!(!err.contains("panicked"), "{test}: panicked: {err}");
}

#[test]
fn garbage_address_is_refused() {
    expect_clean_refusal(
        "garbage_address_is_refused",
        18711,
        |mut s| {
            let mut junk = b"GET / HTTP/1.1\r\nHost: example\r\n\r\n".to_vec();
            junk.resize(MESSAGE_LEN, b'x');
            s.write_all(&junk).unwrap();
            let _ = s.read_to_end(&mut Vec::new());
        },
        &["handshake"],
    );
}

#[test]
fn truncated_address_is_refused() {
    expect_clean_refusal(
        "truncated_address_is_refused",
        18712,
        |mut s| {
            let msg = Destination {
                lid: 1,
                qpn: 0x11,
                psn: 0x22,
                gid: [0; 16],
            }
            .encode()
            .unwrap();
            s.write_all(&msg[..20]).unwrap();
            s.shutdown(Shutdown::Write).unwrap();
            let _ = s.read_to_end(&mut Vec::new());
        },
        &["couldn't read remote address"],
    );
}

#[test]
fn flood_is_refused_after_one_message() {
    expect_clean_refusal(
        "flood_is_refused_after_one_message",
        18713,
        |mut s| {
            // A peer that never stops sending (a 4 GiB "message"): the server reads its
            // fixed-size message, refuses it, and closes; our writes then fail.
            let chunk = vec![b'A'; 64 << 10];
            for _ in 0..(4u64 << 30) / chunk.len() as u64 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
        },
        &["handshake"],
    );
}

#[test]
fn wrong_done_message_is_refused() {
    expect_clean_refusal(
        "wrong_done_message_is_refused",
        18714,
        |mut s| {
            // A well-formed address (IPv4-mapped 127.0.0.1 GID), then not "done".
            let mut gid = [0u8; 16];
            gid[10] = 0xff;
            gid[11] = 0xff;
            gid[12..].copy_from_slice(&[127, 0, 0, 1]);
            let msg = Destination {
                lid: 0,
                qpn: 0x12,
                psn: 0x34,
                gid,
            }
            .encode()
            .unwrap();
            s.write_all(&msg).unwrap();
            let mut theirs = [0u8; MESSAGE_LEN];
            if s.read_exact(&mut theirs).is_ok() {
                let _ = s.write_all(b"nope\0");
            }
            let _ = s.read_to_end(&mut Vec::new());
        },
        // The server may already refuse to connect its QP to the made-up peer; either way
        // it must say why.
        &["done", "modify", "connect", "QP", "qp"],
    );
}

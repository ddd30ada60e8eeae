//! The bindgen proof of ibverbs-safe's `#[repr(C)]` mirrors (see the crate docs), and tests
//! that it fails, naming type and field, when mirror and header disagree.
use fabric_ffi_check::{check, header, include_dirs_from_env, mirror, Header, Report, Unavailable};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::OnceLock;

/// `FABRIC_REQUIRE` (comma-separated capabilities) names `libclang`: a skip is a failure.
fn required() -> bool {
    std::env::var("FABRIC_REQUIRE")
        .map(|v| v.split(',').any(|c| c.trim() == "libclang"))
        .unwrap_or(false)
}

fn skip(test: &str, why: &str) {
    assert!(
        !required(),
        "ffi-check {test}: FABRIC_REQUIRE contains libclang, but {why}"
    );
    let _ = writeln!(std::io::stdout().lock(), "skipped: ffi-check {test}: {why}");
}

type Generated = Result<Result<String, String>, Unavailable>;

/// bindgen's view of `verbs.h` (include dirs searched first), or a skip naming what is missing.
fn header_or_skip(test: &str, dirs: &[PathBuf]) -> Option<Header> {
    parse_or_skip(test, header::generate(dirs))
}

/// As [`header_or_skip`] for the installed header (and `FABRIC_VERBS_INCLUDE`), running
/// bindgen once for all the tests that use it.
fn installed_or_skip(test: &str) -> Option<Header> {
    static INSTALLED: OnceLock<Generated> = OnceLock::new();
    parse_or_skip(
        test,
        INSTALLED
            .get_or_init(|| header::generate(&include_dirs_from_env()))
            .clone(),
    )
}

fn parse_or_skip(test: &str, generated: Generated) -> Option<Header> {
    match generated.map(|g| g.and_then(|src| header::parse(&src))) {
        Ok(Ok(h)) => Some(h),
        Ok(Err(e)) => panic!("ffi-check {test}: {e}"),
        Err(Unavailable(why)) => {
            skip(test, &why);
            None
        }
    }
}

fn say(r: &Report) {
    let _ = write!(std::io::stdout().lock(), "ffi-check: {r}");
}

#[test]
fn mirrors_match_installed_verbs_h() {
    let test = "mirrors_match_installed_verbs_h";
    let Some(h) = installed_or_skip(test) else {
        return;
    };
    let r = check(&mirror(), &h);
    let dirs = include_dirs_from_env();
    if !dirs.is_empty() {
        let _ = writeln!(
            std::io::stdout().lock(),
            "ffi-check: FABRIC_VERBS_INCLUDE={dirs:?}"
        );
    }
    say(&r);
    assert!(r.problems.is_empty(), "mirrors disagree with verbs.h:\n{r}");
    // The op table's five data-path entries are compared as signatures.
    assert!(r.signatures >= 5, "{r}");
}

/// The directory holding `infiniband/verbs.h` that clang would use.
fn installed_include_dir() -> Option<PathBuf> {
    include_dirs_from_env()
        .into_iter()
        .chain([
            PathBuf::from("/usr/include"),
            PathBuf::from("/usr/local/include"),
        ])
        .find(|d| d.join("infiniband/verbs.h").is_file())
}

/// A copy of the installed `infiniband/` headers with `edit` applied to verbs.h.
fn patched_headers(name: &str, edit: impl Fn(&str) -> String) -> Option<PathBuf> {
    let src = installed_include_dir()?;
    let dir = std::env::temp_dir().join(format!("ffi-check-{name}-{}", std::process::id()));
    let ib = dir.join("infiniband");
    std::fs::create_dir_all(&ib).unwrap();
    for e in std::fs::read_dir(src.join("infiniband")).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), ib.join(e.file_name())).unwrap();
        }
    }
    let verbs = ib.join("verbs.h");
    let text = std::fs::read_to_string(&verbs).unwrap();
    // Whether the patch took is asserted by each test on the parsed result.
    std::fs::write(&verbs, edit(&text)).unwrap();
    Some(dir)
}

fn with_patched(test: &str, edit: impl Fn(&str) -> String, f: impl FnOnce(&Header)) {
    let Some(dir) = patched_headers(test, edit) else {
        skip(
            test,
            "infiniband/verbs.h not found (install libibverbs-dev)",
        );
        return;
    };
    if let Some(h) = header_or_skip(test, std::slice::from_ref(&dir)) {
        f(&h);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Insert `line` after the first line of verbs.h that contains `anchor`.
fn insert_after(text: &str, anchor: &str, line: &str) -> String {
    let mut out = String::new();
    let mut done = false;
    for l in text.lines() {
        out.push_str(l);
        out.push('\n');
        if !done && l.contains(anchor) {
            out.push_str(line);
            out.push('\n');
            done = true;
        }
    }
    out
}

/// Issue 9: newer rdma-core appends `active_speed_ex` to `ibv_port_attr`. The mirror is the
/// compat prefix the versioned `ibv_query_port` writes, so it passes on both headers.
#[test]
fn newer_header_with_active_speed_ex_passes() {
    let test = "newer_header_with_active_speed_ex_passes";
    let edit = |t: &str| {
        if t.contains("active_speed_ex;") {
            t.to_string() // already a newer header (FABRIC_VERBS_INCLUDE)
        } else {
            insert_after(t, "port_cap_flags2;", "\tuint32_t\t\tactive_speed_ex;")
        }
    };
    with_patched(test, edit, |h| {
        let pa = &h.types["ibv_port_attr"];
        assert!(pa.fields.iter().any(|f| f.name == "active_speed_ex"));
        assert_eq!(pa.size, Some(56), "the patched header grew the struct");
        let r = check(&mirror(), h);
        say(&r);
        assert!(r.problems.is_empty(), "{r}");
        assert!(r.notes.is_empty(), "active_speed_ex is present now: {r}");
    });
}

/// A header change in the middle of a mirrored struct is named by type and field.
#[test]
fn header_change_is_named_by_type_and_field() {
    let test = "header_change_is_named_by_type_and_field";
    let edit = |t: &str| {
        let sge = t.find("struct ibv_sge {").expect("ibv_sge in verbs.h");
        let (a, b) = t.split_at(sge);
        format!(
            "{a}{}",
            insert_after(b, "uint64_t", "\tuint32_t\t\tinserted;")
        )
    };
    with_patched(test, edit, |h| {
        let r = check(&mirror(), h);
        let has = |s: &str| r.problems.iter().any(|p| p.contains(s));
        assert!(
            has("ibv_sge.length: offset 8 in the mirror, 12 in verbs.h"),
            "{r}"
        );
        assert!(has("ibv_sge.inserted: in verbs.h"), "{r}");
        assert!(has("ibv_sge: size 16 in the mirror, 24 in verbs.h"), "{r}");
    });
}

/// Every kind of disagreement planted in the mirror is reported, naming what it is about.
#[test]
fn planted_mirror_errors_are_named() {
    let test = "planted_mirror_errors_are_named";
    let Some(h) = installed_or_skip(test) else {
        return;
    };
    type Plant = fn(&mut fabric_ffi_check::Mirror);
    let cases: Vec<(&str, Plant)> = vec![
        (
            "ibv_qp_attr.rq_psn: offset 24 in the mirror, 20 in verbs.h",
            |m| {
                let t = m
                    .types
                    .iter_mut()
                    .find(|x| x.name == "ibv_qp_attr")
                    .unwrap();
                t.fields
                    .iter_mut()
                    .find(|x| x.name == "rq_psn")
                    .unwrap()
                    .offset += 4;
            },
        ),
        ("ibv_wc.slid: size 4 in the mirror, 2 in verbs.h", |m| {
            let t = m.types.iter_mut().find(|x| x.name == "ibv_wc").unwrap();
            t.fields.iter_mut().find(|x| x.name == "slid").unwrap().size = 4;
        }),
        (
            "ibv_send_wr.next: type `*mut ibv_recv_wr` in the mirror, `*mut ibv_send_wr`",
            |m| {
                let t = m
                    .types
                    .iter_mut()
                    .find(|x| x.name == "ibv_send_wr")
                    .unwrap();
                t.fields.iter_mut().find(|x| x.name == "next").unwrap().ty = "*mut ibv_recv_wr";
            },
        ),
        ("ibv_context_ops.post_send: type", |m| {
            let a = m.aliases.iter_mut().find(|x| x.0 == "PostSendFn").unwrap();
            a.1 = "unsafe extern \"C\" fn(qp: *mut ibv_qp, wr: *mut ibv_send_wr) -> c_int";
        }),
        ("ibv_context_ops.poll_cq: type", |m| {
            let a = m.aliases.iter_mut().find(|x| x.0 == "PollCqFn").unwrap();
            a.1 = "unsafe extern \"C\" fn(cq: *mut ibv_cq, n: c_uint, wc: *mut ibv_wc) -> c_int";
        }),
        ("loader.rs Verbs.query_port (ibv_query_port): type", |m| {
            let e = m.loader.iter_mut().find(|e| e.field == "query_port").unwrap();
            e.ty = "unsafe extern \"C\" fn(*mut ibv_context, u32, *mut ibv_port_attr) -> c_int";
        }),
        ("loader.rs Verbs.ack_cq_events (ibv_ack_cq_events): type", |m| {
            let e = m.loader.iter_mut().find(|e| e.field == "ack_cq_events").unwrap();
            e.ty = "unsafe extern \"C\" fn(*mut ibv_cq, c_int)";
        }),
        ("in ibverbs-safe, `extern \"C\" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> i32` in verbs.h", |m| {
            // Without its `C alias:` line the mirror no longer stands for the compat struct.
            let t = m.types.iter_mut().find(|t| t.name == "ibv_port_attr").unwrap();
            t.doc = "";
        }),
        (
            "ibv_wc.dlid_path_bits: in verbs.h (offset 45) but neither mirrored nor listed",
            |m| {
                let t = m.types.iter_mut().find(|x| x.name == "ibv_wc").unwrap();
                t.fields.retain(|f| f.name != "dlid_path_bits");
            },
        ),
        ("ibv_cq.mutex: in verbs.h", |m| {
            let o: Vec<_> = m
                .omitted
                .iter()
                .filter(|o| !(o.c_type == "ibv_cq" && o.field == "mutex"))
                .copied()
                .collect();
            m.omitted = Box::leak(o.into_boxed_slice());
        }),
        ("ibv_ah_attr: size 40 in the mirror, 32 in verbs.h", |m| {
            m.types
                .iter_mut()
                .find(|x| x.name == "ibv_ah_attr")
                .unwrap()
                .size = 40;
        }),
        ("ibv_gid: alignment 1 in the mirror, 8 in verbs.h", |m| {
            m.types
                .iter_mut()
                .find(|x| x.name == "ibv_gid")
                .unwrap()
                .align = 1;
        }),
        ("IBV_WR_RDMA_READ: 5 in the mirror, 4 in verbs.h", |m| {
            m.consts
                .iter_mut()
                .find(|c| c.name == "IBV_WR_RDMA_READ")
                .unwrap()
                .value = 5;
        }),
        ("IBV_MTU_1024: 4 in the mirror, 3 in verbs.h", |m| {
            m.enum_values
                .iter_mut()
                .find(|c| c.0 == "IBV_MTU_1024")
                .unwrap()
                .1 = 4;
        }),
        (
            "GRH_LEN: 48 in the mirror, sizeof(struct ibv_grh) = 40",
            |m| {
                m.consts
                    .iter_mut()
                    .find(|c| c.name == "GRH_LEN")
                    .unwrap()
                    .value = 48;
            },
        ),
        (
            "ibv_send_wr_rdma (verbs.h ibv_send_wr__bindgen_ty_2__bindgen_ty_1).rkey: offset 12",
            |m| {
                let t = m
                    .types
                    .iter_mut()
                    .find(|x| x.name == "ibv_send_wr_rdma")
                    .unwrap();
                t.fields
                    .iter_mut()
                    .find(|x| x.name == "rkey")
                    .unwrap()
                    .offset = 12;
            },
        ),
    ];
    for (want, plant) in cases {
        let mut m = mirror();
        plant(&mut m);
        let r = check(&m, &h);
        assert!(
            r.problems.iter().any(|p| p.contains(want)),
            "planted `{want}` was not reported:\n{r}"
        );
    }
}

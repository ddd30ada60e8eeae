//! Proves `ibverbs-safe`'s hand-written `#[repr(C)]` mirrors of `<infiniband/verbs.h>` and
//! `<rdma/rdma_cma.h>` (the rdma_cm mirrors in `sys/cm.rs`) field by field against the
//! installed headers, with `bindgen`.
//!
//! Dev-only: no library crate depends on this one. `bindgen` is built with its `runtime`
//! feature, so libclang is opened with `dlopen` when the check runs, never at build time:
//! `cargo build` / `cargo test --workspace` work without libclang or rdma-core headers, and
//! the test then prints `skipped: ffi-check ...` naming what is missing. Where
//! `FABRIC_REQUIRE` (comma-separated) contains `libclang` — CI — that skip is a failure.
//!
//! # What is compared
//!
//! Both sides are derived, nothing is hand-listed here:
//! * the **mirror** side is read by `build.rs` from `ibverbs-safe/src/sys/*.rs` with `syn`
//!   (every `#[repr(C)]` struct/union, every field, every integer constant, every type
//!   alias), and laid out by rustc (`size_of`, `align_of`, `offset_of!`);
//! * the **header** side is bindgen's output for `verbs.h`, read back with `syn`: its fields
//!   and types, and the sizes, alignments and offsets clang computed (bindgen's layout
//!   assertions).
//!
//! For every mirrored type: size, alignment, and each field's offset, size and type (pointer
//! targets, arrays, integer widths; function pointers with their full signature, which covers
//! the op table's `post_send`, `post_recv`, `poll_cq`, `req_notify_cq`, `post_srq_recv`).
//! The prototypes of the entry points `ibverbs-safe/src/loader.rs` resolves with dlsym are
//! compared with the header's declarations of those functions the same way.
//! Every header field must be mirrored or listed, with its reason, in
//! `ibverbs_safe::ffi_mirror::OMITTED_FIELDS`. Every constant must exist in the header with
//! the same value, as must the Rust enums' values in `ffi_mirror::enum_values()`. The
//! conventions the mirrors follow are in the docs of `ibverbs-safe/src/sys/mod.rs`.
//!
//! # Another rdma-core version
//!
//! `FABRIC_VERBS_INCLUDE=/dir[:/dir...]` puts directories before the system ones (for this
//! check and for the C layout test of `ibverbs-safe`). CI uses it with
//! `ci/newer-verbs-headers.sh`, which downloads a newer Debian's `libibverbs-dev` (trixie:
//! rdma-core 56.1) with apt on a private state directory and unpacks it without installing:
//! `FABRIC_VERBS_INCLUDE=$(ci/newer-verbs-headers.sh) cargo test -p fabric-ffi-check`. An
//! rdma-core source tree works the same way once configured with its `build.sh` (cmake puts
//! `infiniband/verbs.h` under `build/include`). Where neither is reachable, the test suite
//! still runs the check on a copy of the installed header with the newest known change
//! applied (`ibv_port_attr` growing `active_speed_ex`).

pub mod header;

pub use header::Header;
use header::{array_len, first_generic, last_segment, primitive, CType};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

pub use header::Unavailable;

/// One `#[repr(C)]` struct or union of the mirrors.
#[derive(Debug, Clone)]
pub struct MirrorType {
    /// Its Rust name.
    pub name: &'static str,
    /// A `union`.
    pub is_union: bool,
    /// No public field: an opaque handle type (only its existence is checked).
    pub opaque: bool,
    /// Its doc comment.
    pub doc: &'static str,
    /// `size_of`.
    pub size: usize,
    /// `align_of`.
    pub align: usize,
    /// Public fields in declaration order.
    pub fields: Vec<MirrorField>,
}

/// One field of a [`MirrorType`].
#[derive(Debug, Clone)]
pub struct MirrorField {
    /// Its name.
    pub name: &'static str,
    /// Its type, as source tokens.
    pub ty: &'static str,
    /// Its doc comment (holds a `C field:` line when the name differs from the header's).
    pub doc: &'static str,
    /// `offset_of!`.
    pub offset: usize,
    /// `size_of` of its type.
    pub size: usize,
}

/// One integer constant of the mirrors.
#[derive(Debug, Clone)]
pub struct MirrorConst {
    /// Its name (the C enumerator or macro it mirrors).
    pub name: &'static str,
    /// Its doc comment (holds a `C:` line when the header has no constant of that name).
    pub doc: &'static str,
    /// Its value.
    pub value: i128,
}

/// An entry point `ibverbs-safe/src/loader.rs` resolves with dlsym.
#[derive(Debug, Clone)]
pub struct LoaderEntry {
    /// The field of `struct Verbs`.
    pub field: &'static str,
    /// The C symbol (empty when loader.rs names none for this field).
    pub symbol: &'static str,
    /// The field's function-pointer type, as source tokens.
    pub ty: &'static str,
}

/// Everything the mirrors declare.
#[derive(Debug, Clone)]
pub struct Mirror {
    /// Structs and unions.
    pub types: Vec<MirrorType>,
    /// Type aliases (`PostSendFn`, ...) as `(name, source tokens)`.
    pub aliases: Vec<(&'static str, &'static str)>,
    /// Integer constants.
    pub consts: Vec<MirrorConst>,
    /// The dlsym'd entry points of `loader.rs`.
    pub loader: Vec<LoaderEntry>,
    /// The header fields the mirrors leave out on purpose.
    pub omitted: &'static [ibverbs_safe::ffi_mirror::OmittedField],
    /// Enum values the crate keeps outside `sys` (`(C name, value)`).
    pub enum_values: Vec<(&'static str, i128)>,
}

/// `size_of` the type a field-access closure returns (the closure is never called).
fn field_size<S, F>(_: fn(&S) -> &F) -> usize {
    std::mem::size_of::<F>()
}

include!(concat!(env!("OUT_DIR"), "/mirror.rs"));

/// The result of a check that ran.
#[derive(Debug, Default)]
pub struct Report {
    /// Every disagreement, each naming the type and field (or constant).
    pub problems: Vec<String>,
    /// Things worth saying that are not failures (a `newer` omission the header lacks).
    pub notes: Vec<String>,
    /// Mirrored types compared.
    pub types: usize,
    /// Fields compared (offset, size and type).
    pub fields: usize,
    /// Function-pointer fields whose signatures were compared.
    pub signatures: usize,
    /// Constants and enum values compared.
    pub constants: usize,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} types, {} fields, {} function signatures, {} constants checked; {} problem(s)",
            self.types,
            self.fields,
            self.signatures,
            self.constants,
            self.problems.len()
        )?;
        for p in &self.problems {
            writeln!(f, "  MISMATCH {p}")?;
        }
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        Ok(())
    }
}

/// Include directories from `FABRIC_VERBS_INCLUDE` (`:`-separated).
pub fn include_dirs_from_env() -> Vec<PathBuf> {
    std::env::var_os("FABRIC_VERBS_INCLUDE")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

/// Runs bindgen (searching `include_dirs` first) and checks [`mirror()`] against it.
///
/// # Errors
/// `Err(Unavailable)` when libclang or the header is missing; `Ok(Err(message))` when
/// bindgen or the parse of its output failed.
pub fn run(include_dirs: &[PathBuf]) -> Result<Result<Report, String>, Unavailable> {
    Ok(load_header(include_dirs)?.map(|h| check(&mirror(), &h)))
}

/// Runs bindgen (searching `include_dirs` first) and reads its output.
///
/// # Errors
/// As [`run`].
pub fn load_header(include_dirs: &[PathBuf]) -> Result<Result<Header, String>, Unavailable> {
    Ok(header::generate(include_dirs)?.and_then(|src| header::parse(&src)))
}

/// A type reduced to what matters for the ABI, with mirror names mapped to header names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shape {
    Int {
        bytes: usize,
        signed: bool,
    },
    Float(usize),
    Void,
    Ptr {
        mutable: bool,
        to: Box<Shape>,
    },
    Named(String),
    Array(Box<Shape>, usize),
    Fn {
        c_abi: bool,
        args: Vec<Shape>,
        ret: Box<Shape>,
    },
    Opt(Box<Shape>),
    Other(String),
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Shape::Int { bytes, signed } => {
                write!(f, "{}{}", if *signed { "i" } else { "u" }, bytes * 8)
            }
            Shape::Float(b) => write!(f, "f{}", b * 8),
            Shape::Void => write!(f, "void"),
            Shape::Ptr { mutable, to } => {
                write!(f, "*{} {to}", if *mutable { "mut" } else { "const" })
            }
            Shape::Named(n) => write!(f, "{n}"),
            Shape::Array(e, n) => write!(f, "[{e}; {n}]"),
            Shape::Fn { c_abi, args, ret } => {
                write!(f, "{}fn(", if *c_abi { "extern \"C\" " } else { "" })?;
                for (i, a) in args.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{a}")?;
                }
                write!(f, ") -> {ret}")
            }
            Shape::Opt(s) => write!(f, "Option<{s}>"),
            Shape::Other(s) => write!(f, "?{s}"),
        }
    }
}

/// Turns a type into a [`Shape`]; `named` maps a type name (after aliases) to a header name.
fn shape(
    ty: &syn::Type,
    aliases: &dyn Fn(&str) -> Option<syn::Type>,
    named: &dyn Fn(&str) -> Option<String>,
    depth: usize,
) -> Shape {
    if depth > 32 {
        return Shape::Other("(alias loop)".into());
    }
    let rec = |t: &syn::Type| shape(t, aliases, named, depth + 1);
    match ty {
        syn::Type::Ptr(p) => Shape::Ptr {
            mutable: p.mutability.is_some(),
            to: Box::new(rec(&p.elem)),
        },
        syn::Type::Array(a) => {
            Shape::Array(Box::new(rec(&a.elem)), array_len(a).unwrap_or(usize::MAX))
        }
        syn::Type::Paren(p) => rec(&p.elem),
        syn::Type::Tuple(t) if t.elems.is_empty() => Shape::Void,
        syn::Type::BareFn(f) => Shape::Fn {
            c_abi: f
                .abi
                .as_ref()
                .is_some_and(|a| a.name.as_ref().is_none_or(|n| n.value() == "C")),
            args: f.inputs.iter().map(|a| rec(&a.ty)).collect(),
            ret: Box::new(match &f.output {
                syn::ReturnType::Default => Shape::Void,
                syn::ReturnType::Type(_, t) => rec(t),
            }),
        },
        syn::Type::Path(p) => {
            let Some(seg) = last_segment(p) else {
                return Shape::Other(String::new());
            };
            let name = seg.ident.to_string();
            if name == "Option" {
                return match first_generic(seg) {
                    Some(t) => Shape::Opt(Box::new(rec(t))),
                    None => Shape::Other(name),
                };
            }
            if name == "c_void" {
                return Shape::Void;
            }
            if let Some((bytes, signed)) = primitive(&name) {
                return if name.starts_with('f') {
                    Shape::Float(bytes)
                } else {
                    Shape::Int { bytes, signed }
                };
            }
            if let Some(h) = named(&name) {
                return Shape::Named(h);
            }
            match aliases(&name) {
                Some(t) => rec(&t),
                None => Shape::Other(name),
            }
        }
        other => Shape::Other(quote::ToTokens::to_token_stream(other).to_string()),
    }
}

/// Equal for the ABI. `strict`: integer signedness counts too (signatures); fields accept a
/// C enum mirrored as `c_int` or `c_uint` alike.
fn same(a: &Shape, b: &Shape, strict: bool) -> bool {
    match (a, b) {
        (
            Shape::Int {
                bytes: x,
                signed: s,
            },
            Shape::Int {
                bytes: y,
                signed: t,
            },
        ) => x == y && (!strict || s == t),
        (Shape::Ptr { mutable: m, to: x }, Shape::Ptr { mutable: n, to: y }) => {
            m == n && same(x, y, strict)
        }
        (Shape::Array(x, n), Shape::Array(y, m)) => n == m && same(x, y, strict),
        (Shape::Opt(x), Shape::Opt(y)) => same(x, y, strict),
        (
            Shape::Fn {
                c_abi: c,
                args: a,
                ret: r,
            },
            Shape::Fn {
                c_abi: d,
                args: b,
                ret: s,
            },
        ) => {
            c == d
                && a.len() == b.len()
                && a.iter().zip(b).all(|(x, y)| same(x, y, true))
                && same(r, s, true)
        }
        _ => a == b,
    }
}

fn is_fn(s: &Shape) -> bool {
    match s {
        Shape::Fn { .. } => true,
        Shape::Opt(x) => is_fn(x),
        _ => false,
    }
}

/// The text between backticks on a doc line starting with `prefix`.
fn annotation<'a>(doc: &'a str, prefix: &str) -> Option<&'a str> {
    doc.lines()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .and_then(|rest| rest.split('`').nth(1))
}

/// Where a mirror field lands in the header type.
struct Target {
    offset: usize,
    size: Option<usize>,
    /// The header field's type when the mirror field is one C field.
    ty: Option<syn::Type>,
    /// The header type's top-level fields the mirror field covers.
    tops: Vec<String>,
}

fn is_anon(name: &str) -> bool {
    name.starts_with("__bindgen_anon_")
}

/// Finds `name` in `t`, directly or inside anonymous members: (offset, field, top-level name).
fn find_member(
    h: &Header,
    t: &CType,
    name: &str,
    depth: usize,
) -> Option<(usize, syn::Type, String)> {
    if depth > 8 {
        return None;
    }
    if let Some(f) = t.fields.iter().find(|f| f.name == name) {
        return Some((f.offset?, f.ty.clone(), f.name.clone()));
    }
    for f in t.fields.iter().filter(|f| is_anon(&f.name)) {
        let inner = h.named_type(&f.ty)?;
        if let Some((off, ty, _)) = find_member(h, inner, name, depth + 1) {
            return Some((f.offset? + off, ty, f.name.clone()));
        }
    }
    None
}

fn resolve(h: &Header, t: &CType, f: &MirrorField) -> Result<Target, String> {
    let spec = annotation(f.doc, "C field:").unwrap_or(f.name).trim();
    if let Some(group) = spec.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
        let want: Vec<&str> = group.split(',').map(str::trim).collect();
        for m in t.fields.iter().filter(|m| is_anon(&m.name)) {
            let Some(inner) = h.named_type(&m.ty) else {
                continue;
            };
            if want
                .iter()
                .all(|w| inner.fields.iter().any(|x| x.name == *w))
            {
                return Ok(Target {
                    offset: m.offset.ok_or("anonymous member without an offset")?,
                    size: h.size_of(&m.ty),
                    ty: None,
                    tops: vec![m.name.clone()],
                });
            }
        }
        return Err(format!(
            "no anonymous member of {} holds {{{group}}}",
            t.name
        ));
    }
    if let Some((first, last)) = spec.split_once("..=") {
        let (first, last) = (first.trim(), last.trim());
        let i = t.fields.iter().position(|x| x.name == first);
        let j = t.fields.iter().position(|x| x.name == last);
        let (Some(i), Some(j)) = (i, j) else {
            return Err(format!("{} has no field `{first}` or `{last}`", t.name));
        };
        if j < i {
            return Err(format!("`{first}..={last}` runs backwards in {}", t.name));
        }
        let start = t.fields[i].offset.ok_or("no offset")?;
        let end = t.fields[j]
            .offset
            .zip(h.size_of(&t.fields[j].ty))
            .map(|(o, s)| o + s);
        return Ok(Target {
            offset: start,
            size: end.map(|e| e - start),
            ty: None,
            tops: t.fields[i..=j].iter().map(|x| x.name.clone()).collect(),
        });
    }
    let mut parts = spec.split('.');
    let first = parts.next().unwrap_or_default();
    let (mut offset, mut ty, top) = find_member(h, t, first, 0)
        .ok_or_else(|| format!("verbs.h's {} has no field `{first}`", t.name))?;
    for p in parts {
        let inner = h
            .named_type(&ty)
            .ok_or_else(|| format!("`{spec}`: `{p}` is not inside a struct or union"))?;
        let (o, t2, _) = find_member(h, inner, p, 0)
            .ok_or_else(|| format!("`{spec}`: {} has no field `{p}`", inner.name))?;
        offset += o;
        ty = t2;
    }
    Ok(Target {
        offset,
        size: h.size_of(&ty),
        ty: Some(ty),
        tops: vec![top],
    })
}

/// Compares the mirrors with the header. Every disagreement becomes one line of
/// [`Report::problems`] naming the type and field (or constant).
pub fn check(m: &Mirror, h: &Header) -> Report {
    let mut r = Report::default();
    let mirror_by_name: BTreeMap<&str, &MirrorType> = m.types.iter().map(|t| (t.name, t)).collect();
    let mirror_aliases: BTreeMap<&str, syn::Type> = m
        .aliases
        .iter()
        .filter_map(|(n, t)| syn::parse_str::<syn::Type>(t).ok().map(|t| (*n, t)))
        .collect();

    // Mirror type -> header type: by name, else through the mapped field that holds it.
    let mut map: BTreeMap<&str, String> = BTreeMap::new();
    for t in &m.types {
        if h.types.contains_key(t.name) {
            map.insert(t.name, t.name.to_string());
        }
    }
    loop {
        let mut added = false;
        for t in &m.types {
            let Some(hname) = map.get(t.name).cloned() else {
                continue;
            };
            let ht = &h.types[&hname];
            for f in &t.fields {
                let Ok(fty) = syn::parse_str::<syn::Type>(f.ty) else {
                    continue;
                };
                let syn::Type::Path(p) = &fty else { continue };
                let Some(seg) = last_segment(p) else { continue };
                let inner = seg.ident.to_string();
                let Some(mt) = mirror_by_name.get(inner.as_str()) else {
                    continue;
                };
                if map.contains_key(mt.name) {
                    continue;
                }
                if let Ok(Target { ty: Some(cty), .. }) = resolve(h, ht, f) {
                    if let Some(ct) = h.named_type(&cty) {
                        map.insert(mt.name, ct.name.clone());
                        added = true;
                    }
                }
            }
        }
        if !added {
            break;
        }
    }

    let maliases = |n: &str| mirror_aliases.get(n).cloned();
    let mnamed = |n: &str| {
        if mirror_by_name.contains_key(n) {
            Some(
                map.get(n)
                    .cloned()
                    .unwrap_or_else(|| format!("{n} (unmapped)")),
            )
        } else {
            None
        }
    };
    let haliases = |n: &str| h.aliases.get(n).cloned();
    // A mirror may stand for a second header type in prototypes (`C alias:` doc line), as
    // `ibv_port_attr` does for `_compat_ibv_port_attr`.
    let header_alias: BTreeMap<&str, String> = m
        .types
        .iter()
        .filter_map(|t| {
            let a = annotation(t.doc, "C alias:")?.trim();
            Some((a, map.get(t.name)?.clone()))
        })
        .collect();
    let hnamed = |n: &str| {
        header_alias
            .get(n)
            .cloned()
            .or_else(|| h.types.get(n).map(|t| t.name.clone()))
    };
    let omitted_of = |mname: &str, hname: &str, field: &str| {
        m.omitted
            .iter()
            .find(|o| (o.c_type == mname || o.c_type == hname) && o.field == field)
    };

    for t in &m.types {
        let Some(hname) = map.get(t.name) else {
            r.problems.push(format!(
                "{}: verbs.h has no type of that name, and no mirrored field holds it",
                t.name
            ));
            continue;
        };
        let ht = &h.types[hname];
        r.types += 1;
        let label = if hname == t.name {
            t.name.to_string()
        } else {
            format!("{} (verbs.h {hname})", t.name)
        };
        if t.opaque {
            continue;
        }
        let (Some(hsize), Some(halign)) = (ht.size, ht.align) else {
            r.problems
                .push(format!("{label}: bindgen gave no size/alignment"));
            continue;
        };
        if t.align != halign {
            r.problems.push(format!(
                "{label}: alignment {} in the mirror, {halign} in verbs.h",
                t.align
            ));
        }
        let mut covered: BTreeSet<String> = BTreeSet::new();
        let mut covered_end = 0;
        for f in &t.fields {
            r.fields += 1;
            let target = match resolve(h, ht, f) {
                Ok(x) => x,
                Err(e) => {
                    r.problems.push(format!("{label}.{}: {e}", f.name));
                    continue;
                }
            };
            covered.extend(target.tops.iter().cloned());
            covered_end = covered_end.max(f.offset + f.size);
            if f.offset != target.offset {
                r.problems.push(format!(
                    "{label}.{}: offset {} in the mirror, {} in verbs.h",
                    f.name, f.offset, target.offset
                ));
            }
            match target.size {
                Some(s) if s != f.size => r.problems.push(format!(
                    "{label}.{}: size {} in the mirror, {s} in verbs.h",
                    f.name, f.size
                )),
                Some(_) => {}
                None => r.problems.push(format!(
                    "{label}.{}: cannot size the header's field",
                    f.name
                )),
            }
            if f.name.starts_with('_') {
                continue; // opaque storage: offset and size only
            }
            let Some(cty) = target.ty else { continue };
            let Ok(mty) = syn::parse_str::<syn::Type>(f.ty) else {
                r.problems
                    .push(format!("{label}.{}: cannot parse `{}`", f.name, f.ty));
                continue;
            };
            let ms = shape(&mty, &maliases, &mnamed, 0);
            let hs = shape(&cty, &haliases, &hnamed, 0);
            let sig = is_fn(&ms) || is_fn(&hs);
            if sig {
                r.signatures += 1;
            }
            if !same(&ms, &hs, sig) {
                r.problems.push(format!(
                    "{label}.{}: type `{ms}` in the mirror, `{hs}` in verbs.h",
                    f.name
                ));
            }
        }
        // Header fields the mirror does not cover must be listed, with a reason.
        let mut trailing_omitted = false;
        for hf in &ht.fields {
            if covered.contains(&hf.name) {
                if omitted_of(t.name, hname, &hf.name).is_some() {
                    r.problems.push(format!(
                        "{label}.{}: listed in OMITTED_FIELDS but mirrored",
                        hf.name
                    ));
                }
                continue;
            }
            if omitted_of(t.name, hname, &hf.name).is_some() {
                if hf.offset.is_some_and(|off| off >= covered_end) {
                    trailing_omitted = true;
                }
                continue;
            }
            r.problems.push(format!(
                "{label}.{}: in verbs.h (offset {}) but neither mirrored nor listed in \
                 OMITTED_FIELDS",
                hf.name,
                hf.offset.map_or("?".into(), |o| o.to_string())
            ));
        }
        if t.size > hsize || (t.size < hsize && !trailing_omitted) {
            r.problems.push(format!(
                "{label}: size {} in the mirror, {hsize} in verbs.h{}",
                t.size,
                if t.size < hsize {
                    " (a shorter mirror must list the fields it leaves off in OMITTED_FIELDS)"
                } else {
                    ""
                }
            ));
        }
    }

    // Stale or misplaced omission entries.
    for o in m.omitted {
        if o.reason.trim().is_empty() {
            r.problems.push(format!(
                "OMITTED_FIELDS: {}.{} gives no reason",
                o.c_type, o.field
            ));
        }
        let Some(t) = mirror_by_name.get(o.c_type) else {
            r.problems.push(format!(
                "OMITTED_FIELDS: `{}` is not a mirrored type",
                o.c_type
            ));
            continue;
        };
        let Some(ht) = map.get(t.name).and_then(|n| h.types.get(n)) else {
            continue;
        };
        if !ht.fields.iter().any(|f| f.name == o.field) {
            if o.newer {
                r.notes.push(format!(
                    "{}.{} (newer rdma-core) is not in this verbs.h",
                    o.c_type, o.field
                ));
            } else {
                r.problems.push(format!(
                    "OMITTED_FIELDS: verbs.h's {} has no field `{}` (stale entry?)",
                    ht.name, o.field
                ));
            }
        }
    }

    // Prototypes of the entry points loader.rs resolves by name.
    if m.loader.is_empty() {
        r.problems
            .push("loader.rs: no entry points found in `struct Verbs`".to_string());
    }
    for e in &m.loader {
        r.signatures += 1;
        let what = format!("loader.rs Verbs.{} ({})", e.field, e.symbol);
        if e.symbol.is_empty() {
            r.problems.push(format!(
                "loader.rs Verbs.{}: no \"ibv_{}\" symbol named in loader.rs",
                e.field, e.field
            ));
            continue;
        }
        let Some(cty) = h.functions.get(e.symbol) else {
            r.problems
                .push(format!("{what}: verbs.h declares no such function"));
            continue;
        };
        let Ok(mty) = syn::parse_str::<syn::Type>(e.ty) else {
            r.problems.push(format!("{what}: cannot parse `{}`", e.ty));
            continue;
        };
        let mut ms = shape(&mty, &maliases, &mnamed, 0);
        if let Shape::Opt(inner) = ms {
            ms = *inner; // optional entry points (absent on old libraries)
        }
        let hs = shape(cty, &haliases, &hnamed, 0);
        if !same(&ms, &hs, true) {
            r.problems.push(format!(
                "{what}: type `{ms}` in ibverbs-safe, `{hs}` in verbs.h"
            ));
        }
    }

    // Constants and enum values.
    let consts = m
        .consts
        .iter()
        .map(|c| (c.name, c.doc, c.value))
        .chain(m.enum_values.iter().map(|(n, v)| (*n, "", *v)));
    for (name, doc, value) in consts {
        r.constants += 1;
        if let Some(expr) = annotation(doc, "C:") {
            let inner = expr
                .trim()
                .strip_prefix("sizeof(")
                .and_then(|s| s.strip_suffix(')'))
                .map(|s| {
                    s.trim()
                        .trim_start_matches("struct ")
                        .trim_start_matches("union ")
                        .trim()
                });
            let got = inner.and_then(|n| h.types.get(n)).and_then(|t| t.size);
            match got {
                Some(s) if s as i128 == value => {}
                Some(s) => r
                    .problems
                    .push(format!("{name}: {value} in the mirror, {expr} = {s}")),
                None => r
                    .problems
                    .push(format!("{name}: cannot evaluate `{expr}` from verbs.h")),
            }
            continue;
        }
        match h.consts.get(name) {
            Some(v) if *v == value => {}
            Some(v) => r
                .problems
                .push(format!("{name}: {value} in the mirror, {v} in verbs.h")),
            None => r.problems.push(format!(
                "{name}: not a constant of verbs.h (say what it mirrors with a `C:` doc line)"
            )),
        }
    }
    r
}

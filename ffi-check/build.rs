//! Reads ibverbs-safe's mirrors (`ibverbs-safe/src/sys/*.rs`) with `syn` and writes
//! `$OUT_DIR/mirror.rs`: for every `#[repr(C)]` struct and union, its size, alignment and the
//! offset and size of every field as rustc lays them out, plus every integer constant and
//! every type alias. Nothing is listed by hand, so a newly mirrored type, field or constant
//! is checked without touching this crate. Also the function-pointer types of the entry
//! points `ibverbs-safe/src/loader.rs` resolves with dlsym. Needs no libclang.
use quote::ToTokens;
use std::fmt::Write as _;
use std::path::PathBuf;

const INTEGERS: &[&str] = &[
    "u8",
    "u16",
    "u32",
    "u64",
    "usize",
    "i8",
    "i16",
    "i32",
    "i64",
    "isize",
    "c_char",
    "c_schar",
    "c_uchar",
    "c_short",
    "c_ushort",
    "c_int",
    "c_uint",
    "c_long",
    "c_ulong",
    "c_longlong",
    "c_ulonglong",
];

fn doc_of(attrs: &[syn::Attribute]) -> String {
    let mut out = String::new();
    for a in attrs {
        if let syn::Meta::NameValue(nv) = &a.meta {
            if nv.path.is_ident("doc") {
                if let syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) = &nv.value
                {
                    out.push_str(s.value().trim());
                    out.push('\n');
                }
            }
        }
    }
    out
}

fn is_repr_c(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("repr")
            && a.meta
                .to_token_stream()
                .to_string()
                .split(|c: char| !c.is_alphanumeric())
                .any(|w| w == "C")
    })
}

fn tokens(t: &impl ToTokens) -> String {
    t.to_token_stream().to_string()
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    // Every file of `src/sys` but the C layout test: mirrors added in a new file there (say
    // `cm.rs` for rdma_cm) are checked too, addressed through their module (`sys::cm::…`).
    let sys_dir = dir.join("../ibverbs-safe/src/sys");
    println!("cargo:rerun-if-changed={}", sys_dir.display());
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&sys_dir)
        .expect("read ibverbs-safe/src/sys")
        .map(|e| e.expect("read ibverbs-safe/src/sys").path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "rs")
                && p.file_name().is_some_and(|n| n != "layout_tests.rs")
        })
        .collect();
    paths.sort();
    let mut items = Vec::new();
    for p in &paths {
        println!("cargo:rerun-if-changed={}", p.display());
        let src = std::fs::read_to_string(p).expect("read a file of ibverbs-safe/src/sys");
        let file = syn::parse_file(&src).unwrap_or_else(|e| panic!("parse {}: {e}", p.display()));
        let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let module = if stem == "mod" {
            String::new()
        } else {
            format!("{stem}::")
        };
        items.extend(file.items.into_iter().map(|i| (module.clone(), i)));
    }

    let mut types = String::new();
    let mut aliases = String::new();
    let mut consts = String::new();
    let root = "::ibverbs_safe::ffi_mirror";
    for (module, item) in &items {
        let m = format!("{root}::{module}");
        let m = m.trim_end_matches("::");
        let (name, attrs, fields, is_union) = match item {
            syn::Item::Struct(s) => {
                let f: Vec<syn::Field> = s.fields.iter().cloned().collect();
                (s.ident.to_string(), &s.attrs, f, false)
            }
            syn::Item::Union(u) => {
                let f: Vec<syn::Field> = u.fields.named.iter().cloned().collect();
                (u.ident.to_string(), &u.attrs, f, true)
            }
            syn::Item::Type(t) => {
                writeln!(
                    aliases,
                    "        ({:?}, {:?}),",
                    t.ident.to_string(),
                    tokens(&t.ty)
                )
                .unwrap();
                continue;
            }
            syn::Item::Const(c) => {
                let ty = tokens(&c.ty);
                let public = matches!(c.vis, syn::Visibility::Public(_));
                if public && INTEGERS.contains(&ty.as_str()) {
                    let n = c.ident.to_string();
                    writeln!(
                        consts,
                        "        MirrorConst {{ name: {n:?}, doc: {:?}, value: {m}::{n} as i128 }},",
                        doc_of(&c.attrs)
                    )
                    .unwrap();
                }
                continue;
            }
            _ => continue,
        };
        if !is_repr_c(attrs) {
            continue;
        }
        let public: Vec<&syn::Field> = fields
            .iter()
            .filter(|f| matches!(f.vis, syn::Visibility::Public(_)))
            .collect();
        let opaque = public.is_empty();
        let mut fs = String::new();
        for f in &public {
            let fname = f.ident.as_ref().expect("named field").to_string();
            // The closure is never called: it only names the field's type for `size_of`.
            let access = if is_union {
                format!(
                    "|s: &{m}::{name}| {{\n                // SAFETY: never called; only names the field's type.\n                unsafe {{ &s.{fname} }}\n            }}"
                )
            } else {
                format!("|s: &{m}::{name}| &s.{fname}")
            };
            writeln!(
                fs,
                "            MirrorField {{ name: {fname:?}, ty: {:?}, doc: {:?}, offset: ::std::mem::offset_of!({m}::{name}, {fname}), size: field_size({access}) }},",
                tokens(&f.ty),
                doc_of(&f.attrs)
            )
            .unwrap();
        }
        writeln!(
            types,
            "    MirrorType {{ name: {name:?}, is_union: {is_union}, opaque: {opaque}, doc: {:?}, size: ::std::mem::size_of::<{m}::{name}>(), align: ::std::mem::align_of::<{m}::{name}>(), fields: vec![\n{fs}        ] }},",
            doc_of(attrs)
        )
        .unwrap();
    }
    // The entry points `loader.rs` resolves with dlsym: each field of `struct Verbs` is a
    // function pointer, and its symbol is the string literal `"ibv_<field>"` (or
    // `"_ibv_<field>"`) that loader.rs passes to dlvsym.
    let mut loader = String::new();
    let loader_path = dir.join("../ibverbs-safe/src/loader.rs");
    println!("cargo:rerun-if-changed={}", loader_path.display());
    if let Ok(lsrc) = std::fs::read_to_string(&loader_path) {
        let lfile = syn::parse_file(&lsrc).expect("parse ibverbs-safe/src/loader.rs");
        for item in &lfile.items {
            match item {
                syn::Item::Struct(s) if s.ident == "Verbs" => {
                    for f in &s.fields {
                        let fname = f.ident.as_ref().expect("named field").to_string();
                        let symbol = [format!("ibv_{fname}"), format!("_ibv_{fname}")]
                            .into_iter()
                            .find(|sym| lsrc.contains(&format!("\"{sym}\"")))
                            .unwrap_or_default();
                        writeln!(
                            loader,
                            "        LoaderEntry {{ field: {fname:?}, symbol: {symbol:?}, ty: {:?} }},",
                            tokens(&f.ty)
                        )
                        .unwrap();
                    }
                }
                syn::Item::Type(t) => {
                    writeln!(
                        aliases,
                        "        ({:?}, {:?}),",
                        t.ident.to_string(),
                        tokens(&t.ty)
                    )
                    .unwrap();
                }
                _ => {}
            }
        }
    }
    let out = format!(
        "// Generated by ffi-check/build.rs from ibverbs-safe/src/sys and loader.rs.\n\
         /// The mirrors as rustc lays them out.\n\
         pub fn mirror() -> Mirror {{\n\
         Mirror {{\n    types: vec![\n{types}    ],\n    aliases: vec![\n{aliases}    ],\n    consts: vec![\n{consts}    ],\n    loader: vec![\n{loader}    ],\n    omitted: {root}::OMITTED_FIELDS,\n    enum_values: {root}::enum_values(),\n}}\n}}\n"
    );
    let out_path = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("mirror.rs");
    std::fs::write(out_path, out).unwrap();
}

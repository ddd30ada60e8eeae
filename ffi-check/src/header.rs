//! The header side: run `bindgen` over `infiniband/verbs.h` and read its output back with
//! `syn` (struct and union fields, the layout clang computed, type aliases, constants).
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What stopped the check from running at all (a skip, or a failure where it is required).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

/// One struct or union of the header, as bindgen emitted it.
#[derive(Debug, Clone)]
pub struct CType {
    /// bindgen's name (`ibv_sge`, `ibv_send_wr__bindgen_ty_2` for a nested one).
    pub name: String,
    /// A `union`.
    pub is_union: bool,
    /// `#[repr(C, packed)]`.
    pub packed: bool,
    /// Fields in declaration order.
    pub fields: Vec<CField>,
    /// `sizeof`, from bindgen's layout assertions.
    pub size: Option<usize>,
    /// `_Alignof`, from bindgen's layout assertions.
    pub align: Option<usize>,
}

/// One field of a [`CType`].
#[derive(Debug, Clone)]
pub struct CField {
    /// The field name (`__bindgen_anon_N` for an anonymous member).
    pub name: String,
    /// Its Rust type as bindgen wrote it.
    pub ty: syn::Type,
    /// `offsetof`, from bindgen's assertions or (anonymous members) by the C layout rules.
    pub offset: Option<usize>,
}

/// Everything the check needs from the header.
#[derive(Debug, Default)]
pub struct Header {
    /// Structs and unions by name.
    pub types: BTreeMap<String, CType>,
    /// `typedef`s and enum types (`pub type ibv_wr_opcode = c_uint`).
    pub aliases: BTreeMap<String, syn::Type>,
    /// Enumerators and integer macros.
    pub consts: BTreeMap<String, i128>,
    /// Declared functions, as `unsafe extern "C" fn(..) -> ..` types.
    pub functions: BTreeMap<String, syn::Type>,
}

/// Runs bindgen over `#include <infiniband/verbs.h>` and `<rdma/rdma_cma.h>` (the rdma_cm
/// mirrors of `sys/cm.rs`), searching `include_dirs` before the system directories,
/// and returns the generated Rust source.
///
/// # Errors
/// [`Unavailable`] when libclang cannot be loaded or the header is not found; any other
/// bindgen failure is returned as `Ok(Err(message))`.
pub fn generate(include_dirs: &[PathBuf]) -> Result<Result<String, String>, Unavailable> {
    if !clang_sys::is_loaded() {
        clang_sys::load().map_err(|e| Unavailable(format!("libclang not found ({e})")))?;
    }
    let mut b = bindgen::Builder::default()
        .header_contents(
            "ffi_check.h",
            "#include <infiniband/verbs.h>\n\
             #include <rdma/rdma_cma.h>\n",
        )
        .prepend_enum_name(false)
        .generate_comments(false)
        .derive_debug(false)
        .layout_tests(true)
        .formatter(bindgen::Formatter::None);
    for d in include_dirs {
        b = b.clang_arg(format!("-I{}", d.display()));
    }
    match b.generate() {
        Ok(bindings) => Ok(Ok(bindings.to_string())),
        Err(e) => {
            let msg = e.to_string();
            let missing = msg
                .split("fatal error: '")
                .nth(1)
                .and_then(|rest| rest.split_once("' file not found"))
                .map(|(file, _)| file.to_string());
            if missing.as_deref() == Some("rdma/rdma_cma.h") {
                return Err(Unavailable(
                    "rdma/rdma_cma.h not found (install librdmacm-dev)".to_string(),
                ));
            }
            if let Some(file) = missing.filter(|f| !f.starts_with("infiniband/")) {
                // libclang1 without libclang-common-dev: clang lacks its builtin headers.
                return Err(Unavailable(format!(
                    "libclang cannot find its builtin headers ('{file}' not found; install \
                     libclang-dev)"
                )));
            }
            if msg.contains("verbs.h' file not found") || msg.contains("verbs.h: No such file") {
                Err(Unavailable(format!(
                    "infiniband/verbs.h not found (install libibverbs-dev){}",
                    if include_dirs.is_empty() {
                        String::new()
                    } else {
                        format!(", searched {include_dirs:?} first")
                    }
                )))
            } else {
                Ok(Err(format!("bindgen failed: {msg}")))
            }
        }
    }
}

fn int_lit(e: &syn::Expr) -> Option<i128> {
    match e {
        syn::Expr::Lit(syn::ExprLit {
            lit: syn::Lit::Int(i),
            ..
        }) => i.base10_parse::<i128>().ok(),
        syn::Expr::Unary(syn::ExprUnary {
            op: syn::UnOp::Neg(_),
            expr,
            ..
        }) => int_lit(expr).map(|v| -v),
        syn::Expr::Paren(p) => int_lit(&p.expr),
        syn::Expr::Cast(c) => int_lit(&c.expr),
        _ => None,
    }
}

/// `["Size of X"][size_of::<X>() - 16usize];` -> ("Size of X", 16).
fn layout_assertion(stmt: &syn::Stmt) -> Option<(String, usize)> {
    let syn::Stmt::Expr(syn::Expr::Index(ix), _) = stmt else {
        return None;
    };
    let syn::Expr::Array(arr) = &*ix.expr else {
        return None;
    };
    let Some(syn::Expr::Lit(syn::ExprLit {
        lit: syn::Lit::Str(s),
        ..
    })) = arr.elems.first()
    else {
        return None;
    };
    let syn::Expr::Binary(bin) = &*ix.index else {
        return None;
    };
    let n = int_lit(&bin.right)?;
    Some((s.value(), usize::try_from(n).ok()?))
}

fn is_packed(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("repr")
            && quote::ToTokens::to_token_stream(&a.meta)
                .to_string()
                .replace(['(', ')', ','], " ")
                .split_whitespace()
                .any(|w| w.starts_with("packed"))
    })
}

/// Reads bindgen's output.
///
/// # Errors
/// A message when the text is not Rust `syn` can parse.
pub fn parse(src: &str) -> Result<Header, String> {
    let file = syn::parse_file(src).map_err(|e| format!("cannot parse bindgen output: {e}"))?;
    let mut h = Header::default();
    let mut offsets: BTreeMap<(String, String), usize> = BTreeMap::new();
    for item in &file.items {
        match item {
            syn::Item::Struct(s) => {
                let fields = match &s.fields {
                    syn::Fields::Named(n) => n
                        .named
                        .iter()
                        .map(|f| CField {
                            name: f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default(),
                            ty: f.ty.clone(),
                            offset: None,
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                h.types.insert(
                    s.ident.to_string(),
                    CType {
                        name: s.ident.to_string(),
                        is_union: false,
                        packed: is_packed(&s.attrs),
                        fields,
                        size: None,
                        align: None,
                    },
                );
            }
            syn::Item::Union(u) => {
                let fields = u
                    .fields
                    .named
                    .iter()
                    .map(|f| CField {
                        name: f.ident.as_ref().map(|i| i.to_string()).unwrap_or_default(),
                        ty: f.ty.clone(),
                        offset: Some(0),
                    })
                    .collect();
                h.types.insert(
                    u.ident.to_string(),
                    CType {
                        name: u.ident.to_string(),
                        is_union: true,
                        packed: is_packed(&u.attrs),
                        fields,
                        size: None,
                        align: None,
                    },
                );
            }
            syn::Item::Type(t) => {
                h.aliases.insert(t.ident.to_string(), (*t.ty).clone());
            }
            syn::Item::Const(c) if c.ident == "_" => {
                let syn::Expr::Block(b) = &*c.expr else {
                    continue;
                };
                for stmt in &b.block.stmts {
                    let Some((what, n)) = layout_assertion(stmt) else {
                        continue;
                    };
                    if let Some(t) = what.strip_prefix("Size of ") {
                        if let Some(ct) = h.types.get_mut(t) {
                            ct.size = Some(n);
                        }
                    } else if let Some(t) = what.strip_prefix("Alignment of ") {
                        if let Some(ct) = h.types.get_mut(t) {
                            ct.align = Some(n);
                        }
                    } else if let Some(tf) = what.strip_prefix("Offset of field: ") {
                        if let Some((t, f)) = tf.split_once("::") {
                            offsets.insert((t.to_string(), f.to_string()), n);
                        }
                    }
                }
            }
            syn::Item::Const(c) => {
                if let Some(v) = int_lit(&c.expr) {
                    h.consts.insert(c.ident.to_string(), v);
                }
            }
            syn::Item::ForeignMod(fm) => {
                for fi in &fm.items {
                    let syn::ForeignItem::Fn(f) = fi else {
                        continue;
                    };
                    if f.sig.variadic.is_some() {
                        continue;
                    }
                    let args: Vec<String> = f
                        .sig
                        .inputs
                        .iter()
                        .filter_map(|a| match a {
                            syn::FnArg::Typed(t) => {
                                Some(quote::ToTokens::to_token_stream(&*t.ty).to_string())
                            }
                            syn::FnArg::Receiver(_) => None,
                        })
                        .collect();
                    let ret = quote::ToTokens::to_token_stream(&f.sig.output).to_string();
                    let text = format!("unsafe extern \"C\" fn({}) {ret}", args.join(", "));
                    if let Ok(t) = syn::parse_str::<syn::Type>(&text) {
                        h.functions.insert(f.sig.ident.to_string(), t);
                    }
                }
            }
            _ => {}
        }
    }
    for ((t, f), off) in offsets {
        if let Some(ct) = h.types.get_mut(&t) {
            if let Some(cf) = ct.fields.iter_mut().find(|x| x.name == f) {
                cf.offset = Some(off);
            }
        }
    }
    fill_anonymous_offsets(&mut h);
    Ok(h)
}

/// bindgen asserts no offset for anonymous members (`__bindgen_anon_N`); place them by the
/// C rules (after the previous field, rounded up to their alignment), as clang did.
fn fill_anonymous_offsets(h: &mut Header) {
    let names: Vec<String> = h.types.keys().cloned().collect();
    for n in names {
        let ct = &h.types[&n];
        if ct.is_union || ct.fields.iter().all(|f| f.offset.is_some()) {
            continue;
        }
        let mut end = 0usize;
        let mut placed = Vec::new();
        for f in &ct.fields {
            let off = match f.offset {
                Some(o) => o,
                None => {
                    let a = if ct.packed {
                        Some(1)
                    } else {
                        h.align_of(&f.ty)
                    };
                    match a {
                        Some(a) => end.div_ceil(a) * a,
                        None => break,
                    }
                }
            };
            let Some(sz) = h.size_of(&f.ty) else { break };
            placed.push(off);
            end = off + sz;
        }
        let ct = h.types.get_mut(&n).expect("type just listed");
        for (f, off) in ct.fields.iter_mut().zip(placed) {
            f.offset.get_or_insert(off);
        }
    }
}

/// The last path segment's name and its generic arguments.
pub(crate) fn last_segment(p: &syn::TypePath) -> Option<&syn::PathSegment> {
    p.path.segments.last()
}

pub(crate) fn first_generic(seg: &syn::PathSegment) -> Option<&syn::Type> {
    if let syn::PathArguments::AngleBracketed(a) = &seg.arguments {
        for g in &a.args {
            if let syn::GenericArgument::Type(t) = g {
                return Some(t);
            }
        }
    }
    None
}

pub(crate) fn array_len(a: &syn::TypeArray) -> Option<usize> {
    int_lit(&a.len).and_then(|v| usize::try_from(v).ok())
}

/// Size and alignment of the C primitive types by their Rust names.
pub(crate) fn primitive(name: &str) -> Option<(usize, bool)> {
    use std::ffi::*;
    use std::mem::size_of;
    Some(match name {
        "u8" | "c_uchar" => (1, false),
        "i8" | "c_schar" => (1, true),
        "c_char" => (1, c_char::MIN != 0),
        "u16" | "c_ushort" => (2, false),
        "i16" | "c_short" => (2, true),
        "u32" | "c_uint" => (4, false),
        "i32" | "c_int" => (4, true),
        "u64" | "c_ulonglong" => (8, false),
        "i64" | "c_longlong" => (8, true),
        "u128" => (16, false),
        "i128" => (16, true),
        "usize" => (size_of::<usize>(), false),
        "isize" => (size_of::<isize>(), true),
        "c_ulong" => (size_of::<c_ulong>(), false),
        "c_long" => (size_of::<c_long>(), true),
        "bool" => (1, false),
        "f32" => (4, true),
        "f64" => (8, true),
        _ => return None,
    })
}

impl Header {
    /// `sizeof` of a type as bindgen wrote it.
    pub fn size_of(&self, ty: &syn::Type) -> Option<usize> {
        self.size_align(ty, 0).map(|(s, _)| s)
    }

    /// `_Alignof` of a type as bindgen wrote it.
    pub fn align_of(&self, ty: &syn::Type) -> Option<usize> {
        self.size_align(ty, 0).map(|(_, a)| a)
    }

    fn size_align(&self, ty: &syn::Type, depth: usize) -> Option<(usize, usize)> {
        let ptr = std::mem::size_of::<usize>();
        if depth > 32 {
            return None;
        }
        match ty {
            syn::Type::Ptr(_) | syn::Type::BareFn(_) => Some((ptr, ptr)),
            syn::Type::Array(a) => {
                let (s, al) = self.size_align(&a.elem, depth + 1)?;
                Some((s * array_len(a)?, al))
            }
            syn::Type::Paren(p) => self.size_align(&p.elem, depth + 1),
            syn::Type::Tuple(t) if t.elems.is_empty() => Some((0, 1)),
            syn::Type::Path(p) => {
                let seg = last_segment(p)?;
                let name = seg.ident.to_string();
                if let Some((s, _)) = primitive(&name) {
                    return Some((s, s.max(1)));
                }
                match name.as_str() {
                    "Option" => self.size_align(first_generic(seg)?, depth + 1),
                    "__BindgenBitfieldUnit" => self.size_align(first_generic(seg)?, depth + 1),
                    "__IncompleteArrayField" | "__BindgenUnionField" => {
                        let (_, a) = self.size_align(first_generic(seg)?, depth + 1)?;
                        Some((0, a))
                    }
                    _ => {
                        if let Some(t) = self.types.get(&name) {
                            Some((t.size?, t.align?))
                        } else {
                            self.size_align(self.aliases.get(&name)?, depth + 1)
                        }
                    }
                }
            }
            _ => None,
        }
    }

    /// The struct/union a type names, through aliases.
    pub fn named_type(&self, ty: &syn::Type) -> Option<&CType> {
        let mut ty = ty;
        for _ in 0..32 {
            let syn::Type::Path(p) = ty else { return None };
            let name = last_segment(p)?.ident.to_string();
            if let Some(t) = self.types.get(&name) {
                return Some(t);
            }
            ty = self.aliases.get(&name)?;
        }
        None
    }
}

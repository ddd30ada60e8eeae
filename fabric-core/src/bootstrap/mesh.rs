//! N-rank setup: every rank of a bootstrap all-gather connected to every other in one call
//! (a full mesh), all connections on one [`Domain`].
//!
//! Each rank opens a domain and a listener per candidate transport (only the forced one
//! when a kind is given), publishes the listener addresses through the bootstrap's
//! all-gather ([`Server::run`] on rank 0, [`join`] elsewhere), and — from the same table
//! on every rank, so every rank agrees — picks one kind for the whole job: shm when every
//! rank is on this host, verbs when every rank has an active RDMA port, else tcp. Then
//! rank `i` connects to every rank `j < i` and accepts from every rank `j > i`; all of it
//! runs in one non-blocking loop, so no rank waits on another in a cycle. A connection is
//! named by a 16-byte identity message each side sends first (the job's nonce, chosen by
//! rank 0, and the sender's rank): a stray or duplicate connection to a listener is
//! dropped and recorded, not counted. Every handshake operation has completed before
//! [`connect_mesh`] returns, so the caller's first `poll` sees only its own work.
//!
//! ```no_run
//! use fabric_core::bootstrap::{mesh, Launch};
//! # fn main() -> fabric_core::Result<()> {
//! let launch = Launch::from_env()?.expect("started by a launcher");
//! let m = mesh::mesh_from_launch(&launch, &mesh::MeshOptions::default())?;
//! println!("rank {} of {} over {}", m.rank(), m.size(), m.kind());
//! # Ok(()) }
//! ```

use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use super::wire::{EndpointInfo, PeerEntry};
use super::{host_id, join, local_rdma_active, publishable, resolve_wildcard, Launch, Server};
use crate::backend::{self, Connector, Listener, Options};
use crate::error::{DecodeError, Error, Result};
use crate::region::{Access, Region};
use crate::transport::{Completion, Transport, TransportKind};
use crate::Domain;

/// How this rank reaches the job's rendezvous.
#[derive(Debug)]
pub enum Rendezvous {
    /// This process is rank 0 and serves the all-gather on this bound server (bind it
    /// with [`Server::bind`] and the job's size and secret).
    Serve(Server),
    /// Join the rendezvous at `HOST:PORT`.
    Join(String),
}

/// How to build the mesh.
#[derive(Debug, Clone)]
pub struct MeshOptions {
    /// Transport for every connection; `None` picks one for the whole job (see the module
    /// docs).
    pub transport: Option<TransportKind>,
    /// Shared secret of the bootstrap (and of the tcp transport's handshake).
    pub secret: Option<Vec<u8>>,
    /// Backend options of the domain. `tcp_bind` is set here from the rendezvous address
    /// (loopback when it is loopback, all interfaces otherwise).
    pub options: Options,
    /// Deadline of the whole setup (bootstrap and connections).
    pub timeout: Duration,
}

impl Default for MeshOptions {
    fn default() -> Self {
        MeshOptions {
            transport: None,
            secret: None,
            options: Options::default(),
            timeout: Duration::from_secs(60),
        }
    }
}

/// Every rank's connection, on one domain.
#[derive(Debug)]
pub struct Mesh {
    rank: u32,
    size: u32,
    domain: Domain,
    peers: Vec<Option<Box<dyn Transport>>>,
    /// Connections refused by the listener during setup (stray or duplicate), with the
    /// reason.
    pub refused: Vec<String>,
}

impl Mesh {
    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The transport every connection uses.
    pub fn kind(&self) -> TransportKind {
        self.domain.kind()
    }

    /// The domain every connection belongs to (register memory here).
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// The connection to `rank` (`None` for this rank itself or a rank out of range).
    pub fn peer(&mut self, rank: u32) -> Option<&mut (dyn Transport + 'static)> {
        self.peers.get_mut(rank as usize)?.as_deref_mut()
    }

    /// The domain and the connections, indexed by rank (`None` at this rank).
    pub fn into_parts(self) -> (Domain, Vec<Option<Box<dyn Transport>>>) {
        (self.domain, self.peers)
    }
}

const BLOB_MAGIC: u32 = 0x534d_4246; // "FBMS"
const BLOB_VERSION: u8 = 1;
const IDENT_MAGIC: u32 = 0x4449_4d46; // "FMID"
const IDENT_LEN: usize = 16;
const WR_SEND: u64 = 1;
/// Unnamed accepted connections kept beyond twice the ranks still missing.
const MAX_STRAYS: usize = 8;
const WR_RECV: u64 = 2;

/// What each rank publishes: the job nonce (rank 0's; ignored from others) and its
/// endpoint info.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MeshBlob {
    nonce: u64,
    info: EndpointInfo,
}

impl MeshBlob {
    fn encode(&self) -> Vec<u8> {
        let mut v = BLOB_MAGIC.to_le_bytes().to_vec();
        v.push(BLOB_VERSION);
        v.extend_from_slice(&self.nonce.to_le_bytes());
        v.extend_from_slice(&self.info.encode());
        v
    }

    fn decode(b: &[u8]) -> std::result::Result<Self, DecodeError> {
        const W: &str = "mesh endpoint blob";
        if b.len() < 13 {
            return Err(DecodeError::Truncated {
                what: W,
                need: 13,
                got: b.len(),
            });
        }
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != BLOB_MAGIC {
            return Err(DecodeError::BadMagic {
                what: W,
                found: magic as u64,
            });
        }
        if b[4] != BLOB_VERSION {
            return Err(DecodeError::Version {
                what: W,
                found: b[4] as u32,
                expected: BLOB_VERSION as u32,
            });
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&b[5..13]);
        Ok(MeshBlob {
            nonce: u64::from_le_bytes(n),
            info: EndpointInfo::decode(&b[13..])?,
        })
    }
}

/// The identity message: `magic u32, rank u32, nonce u64` (little-endian).
fn ident(rank: u32, nonce: u64) -> [u8; IDENT_LEN] {
    let mut b = [0u8; IDENT_LEN];
    b[0..4].copy_from_slice(&IDENT_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&rank.to_le_bytes());
    b[8..16].copy_from_slice(&nonce.to_le_bytes());
    b
}

fn parse_ident(b: &[u8], nonce: u64) -> std::result::Result<u32, String> {
    if b.len() != IDENT_LEN {
        return Err(format!(
            "identity of {} bytes, expected {IDENT_LEN}",
            b.len()
        ));
    }
    let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if magic != IDENT_MAGIC {
        return Err(format!("identity with bad magic {magic:#x}"));
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&b[8..16]);
    if u64::from_le_bytes(n) != nonce {
        return Err("identity of another job (nonce differs)".into());
    }
    Ok(u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
}

/// Picks the job's transport from every rank's info (the same answer on every rank).
fn choose(infos: &[EndpointInfo], forced: Option<TransportKind>) -> Result<TransportKind> {
    let offered_by_all = |k: TransportKind| infos.iter().all(|i| address_of(i, k).is_some());
    let order: Vec<TransportKind> = match forced {
        Some(k) => vec![k],
        None => {
            let mut v = Vec::new();
            let host = &infos[0].host;
            if !host.is_empty() && infos.iter().all(|i| &i.host == host) {
                v.push(TransportKind::Shm);
            }
            if infos.iter().all(|i| i.rdma) {
                v.push(TransportKind::Verbs);
            }
            v.push(TransportKind::Tcp);
            v
        }
    };
    for k in &order {
        if offered_by_all(*k) {
            return Ok(*k);
        }
    }
    let missing = infos
        .iter()
        .position(|i| address_of(i, order[0]).is_none())
        .unwrap_or(0);
    Err(Error::Unavailable {
        transport: order[0],
        reason: format!(
            "rank {missing} offers only {:?}, not a transport every rank has",
            infos[missing].addrs
        ),
    })
}

fn address_of(info: &EndpointInfo, k: TransportKind) -> Option<&str> {
    info.addrs.iter().map(String::as_str).find(|a| {
        a.split_once(':')
            .and_then(|(p, _)| p.parse::<TransportKind>().ok())
            == Some(k)
    })
}

fn is_loopback(addr: &str) -> bool {
    addr.to_socket_addrs()
        .map(|mut a| a.all(|a| a.ip().is_loopback()))
        .unwrap_or(true)
}

/// A connection being named: both sides send their identity and receive the peer's.
#[derive(Debug)]
struct Naming {
    conn: Box<dyn Transport>,
    /// The rank we dialled (connector side); `None` on the accepting side.
    expect: Option<u32>,
    got: Option<u32>,
    sent: bool,
    cq: Vec<Completion>,
    // Keeps the identity regions alive while their operations run (the buffers hold them
    // too; these are for clarity of ownership).
    _regions: [Region; 2],
}

impl Naming {
    fn start(
        mut conn: Box<dyn Transport>,
        expect: Option<u32>,
        me: u32,
        nonce: u64,
    ) -> Result<Self> {
        let out = conn.domain().register(IDENT_LEN, Access::empty())?;
        out.write_at(0, &ident(me, nonce))?;
        let inb = conn.domain().register(IDENT_LEN, Access::empty())?;
        conn.post_recv(inb.full(), WR_RECV).map_err(|e| e.error)?;
        conn.post_send(out.full(), WR_SEND).map_err(|e| e.error)?;
        Ok(Naming {
            conn,
            expect,
            got: None,
            sent: false,
            cq: (0..2).map(|_| Completion::default()).collect(),
            _regions: [out, inb],
        })
    }

    /// Moves the exchange on: `Ok(true)` once both operations completed and the peer
    /// named itself (its rank is in `got`).
    fn step(&mut self, nonce: u64) -> std::result::Result<bool, String> {
        let n = self
            .conn
            .poll(&mut self.cq)
            .map_err(|e| format!("poll: {e}"))?;
        for c in self.cq.iter_mut().take(n) {
            if !c.status.is_ok() {
                return Err(format!("identity {:?} completed with {:?}", c.op, c.status));
            }
            match c.wr_id {
                WR_SEND => self.sent = true,
                WR_RECV => {
                    let b = c.buf.take().map(|b| {
                        let mut v = b.to_vec();
                        v.truncate(c.len);
                        v
                    });
                    let r = parse_ident(b.as_deref().unwrap_or(&[]), nonce)?;
                    if let Some(want) = self.expect {
                        if r != want {
                            return Err(format!("dialled rank {want}, rank {r} answered"));
                        }
                    }
                    self.got = Some(r);
                }
                other => return Err(format!("unexpected completion id {other}")),
            }
        }
        Ok(self.sent && self.got.is_some())
    }
}

/// Connects this rank to every other rank of the job (see the module docs).
///
/// # Errors
/// [`Error::InvalidArgument`] for `rank >= size`, a `Serve` rendezvous on a rank other
/// than 0 or a `Join` on rank 0; [`Error::RanksLost`] (naming them) when ranks never join
/// the bootstrap or leave it before taking the table; [`Error::Timeout`] when the
/// bootstrap or a connection does not finish within `cfg.timeout`; [`Error::Unavailable`] when no transport is
/// offered by every rank (or the forced one is not); [`Error::Decode`] for a malformed
/// peer blob; [`Error::Bootstrap`] when a dialled rank names itself wrongly; the
/// bootstrap's and backends' own errors.
pub fn connect_mesh(
    rank: u32,
    size: u32,
    rendezvous: Rendezvous,
    cfg: &MeshOptions,
) -> Result<Mesh> {
    if rank >= size {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} not below size {size}"
        )));
    }
    let end = Instant::now() + cfg.timeout;
    let loopback = match &rendezvous {
        Rendezvous::Serve(s) if rank == 0 => s.local_addr()?.ip().is_loopback(),
        Rendezvous::Join(a) if rank != 0 => is_loopback(a),
        _ => {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: rank 0 serves the rendezvous and every other rank joins it"
            )))
        }
    };
    let mut opts = cfg.options.clone();
    opts.tcp_bind = if loopback { "127.0.0.1:0" } else { "0.0.0.0:0" }.into();
    if let Some(s) = &cfg.secret {
        opts.tcp_secret = Some(s.clone());
    }

    // A domain and listener per candidate kind.
    let kinds: Vec<TransportKind> = match cfg.transport {
        Some(k) => vec![k],
        None => {
            let mut v = vec![TransportKind::Shm];
            if local_rdma_active() {
                v.push(TransportKind::Verbs);
            }
            v.push(TransportKind::Tcp);
            v
        }
    };
    let mut candidates: Vec<(Domain, Box<dyn Listener>)> = Vec::new();
    for k in kinds {
        let opened = backend::entry(k)
            .and_then(|e| (e.probe)())
            .and_then(|()| Domain::open(k, &opts))
            .and_then(|d| d.listen().map(|l| (d, l)));
        match opened {
            Ok(c) => candidates.push(c),
            Err(e) if cfg.transport.is_some() => return Err(e),
            Err(_) => {}
        }
    }
    let nonce = if rank == 0 {
        let mut b = [0u8; 8];
        crate::sys::random_bytes(&mut b)?;
        u64::from_le_bytes(b)
    } else {
        0
    };
    let blob = MeshBlob {
        nonce,
        info: EndpointInfo {
            host: host_id(),
            rdma: candidates
                .iter()
                .any(|(d, _)| d.kind() == TransportKind::Verbs),
            addrs: candidates
                .iter()
                .map(|(_, l)| publishable(l.address()))
                .collect(),
        },
    };

    // The all-gather.
    let secret = cfg.secret.as_deref();
    let (table, server_ip): (Vec<PeerEntry>, String) = match rendezvous {
        Rendezvous::Serve(mut s) => (s.run(&blob.encode(), cfg.timeout)?, String::new()),
        Rendezvous::Join(addr) => {
            let table = join(&addr, rank, size, secret, &blob.encode(), cfg.timeout)?;
            let ip = addr
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .map(|a| a.ip().to_string())
                .unwrap_or_else(|| "127.0.0.1".into());
            (table, ip)
        }
    };
    if table.len() != size as usize {
        return Err(Error::Bootstrap(format!(
            "table of {} ranks, expected {size}",
            table.len()
        )));
    }
    let mut blobs = Vec::with_capacity(table.len());
    for (i, e) in table.iter().enumerate() {
        if e.rank as usize != i {
            return Err(Error::Bootstrap(format!(
                "table entry {i} names rank {}",
                e.rank
            )));
        }
        blobs.push(MeshBlob::decode(&e.blob)?);
    }
    let nonce = blobs[0].nonce;
    let infos: Vec<EndpointInfo> = blobs.into_iter().map(|b| b.info).collect();
    let kind = choose(&infos, cfg.transport)?;
    let (domain, mut listener) = candidates
        .into_iter()
        .find(|(d, _)| d.kind() == kind)
        .ok_or_else(|| Error::Unavailable {
            transport: kind,
            reason: format!("rank {rank} could not open it"),
        })?;
    let ip_of = |j: usize| -> &str {
        if j == 0 && rank != 0 {
            &server_ip
        } else {
            &table[j].ip
        }
    };

    // Dial every lower rank, accept every higher one, in one loop.
    let mut dialing: Vec<(u32, Box<dyn Connector>)> = Vec::new();
    for j in 0..rank {
        let a = address_of(&infos[j as usize], kind).unwrap_or_default();
        let a = resolve_wildcard(a, ip_of(j as usize));
        dialing.push((j, domain.connect(&a)?));
    }
    let mut naming: Vec<Naming> = Vec::new();
    let mut peers: Vec<Option<Box<dyn Transport>>> = (0..size).map(|_| None).collect();
    let mut refused = Vec::new();
    let mut done = 0usize;
    let mut spins = 0u32;
    while done < size as usize - 1 {
        let mut moved = false;
        let mut i = 0;
        while i < dialing.len() {
            match dialing[i].1.poll_connect() {
                Ok(Some(c)) => {
                    let (j, _) = dialing.swap_remove(i);
                    naming.push(Naming::start(c, Some(j), rank, nonce)?);
                    moved = true;
                }
                Ok(None) => i += 1,
                Err(e) => {
                    return Err(Error::Bootstrap(format!(
                        "mesh: connecting rank {rank} to rank {}: {e}",
                        dialing[i].0
                    )))
                }
            }
        }
        // Accept while a higher rank is missing (a stray connection that never names
        // itself takes no rank's place; the oldest unnamed one goes when too many wait).
        let missing = peers[rank as usize + 1..]
            .iter()
            .filter(|p| p.is_none())
            .count();
        if missing > 0 {
            if let Some(c) = listener.accept()? {
                let accepted = naming.iter().filter(|n| n.expect.is_none()).count();
                if accepted >= 2 * missing + MAX_STRAYS {
                    if let Some(i) = naming.iter().position(|n| n.expect.is_none()) {
                        naming.remove(i);
                        refused.push("an accepted connection that never named itself".into());
                    }
                }
                naming.push(Naming::start(c, None, rank, nonce)?);
                moved = true;
            }
        }
        let mut i = 0;
        while i < naming.len() {
            let dialled = naming[i].expect.is_some();
            match naming[i].step(nonce) {
                Ok(false) => i += 1,
                Ok(true) => {
                    let n = naming.swap_remove(i);
                    let r = n.got.unwrap_or(u32::MAX);
                    let ok = r < size
                        && r != rank
                        && (dialled || r > rank)
                        && peers[r as usize].is_none();
                    if ok {
                        peers[r as usize] = Some(n.conn);
                        done += 1;
                    } else if dialled {
                        return Err(Error::Bootstrap(format!(
                            "mesh: rank {r} answered twice or out of range"
                        )));
                    } else {
                        refused.push(format!("a connection named itself rank {r}: refused"));
                    }
                    moved = true;
                }
                Err(why) if dialled => {
                    return Err(Error::Bootstrap(format!(
                        "mesh: rank {rank} naming its connection to rank {}: {why}",
                        naming[i].expect.unwrap_or_default()
                    )))
                }
                Err(why) => {
                    naming.swap_remove(i);
                    refused.push(format!("an accepted connection: {why}"));
                    moved = true;
                }
            }
        }
        if Instant::now() > end {
            return Err(Error::Timeout("mesh: not every rank connected"));
        }
        if moved {
            spins = 0;
        } else {
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(if spins < 1000 { 50 } else { 500 }));
            }
        }
    }
    Ok(Mesh {
        rank,
        size,
        domain,
        peers,
        refused,
    })
}

/// [`connect_mesh`] from a launcher's values: rank 0 binds `launch.server` (or
/// `0.0.0.0:PORT` when that address is not local), the others join it.
///
/// # Errors
/// [`Error::InvalidArgument`] when the launch names no rendezvous address (set
/// `FABRIC_BOOTSTRAP=HOST:PORT`, or torchrun's `MASTER_ADDR`/`MASTER_PORT`); as
/// [`connect_mesh`].
pub fn mesh_from_launch(launch: &Launch, cfg: &MeshOptions) -> Result<Mesh> {
    let server = launch.server.clone().ok_or_else(|| {
        Error::InvalidArgument(
            "no rendezvous address: set FABRIC_BOOTSTRAP=HOST:PORT (rank 0's host)".into(),
        )
    })?;
    let rv = if launch.rank == 0 {
        let secret = cfg.secret.as_deref();
        let s = match Server::bind(&server, launch.size, secret) {
            Ok(s) => s,
            Err(first) => {
                let port = server.rsplit_once(':').map(|(_, p)| p).unwrap_or("0");
                Server::bind(&format!("0.0.0.0:{port}"), launch.size, secret).map_err(|_| first)?
            }
        };
        Rendezvous::Serve(s)
    } else {
        Rendezvous::Join(server)
    };
    connect_mesh(launch.rank, launch.size, rv, cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `size` ranks on threads; returns each rank's result.
    fn run_job(
        size: u32,
        kind: Option<TransportKind>,
        timeout: Duration,
        check: fn(&mut Mesh),
    ) -> Vec<Result<TransportKind>> {
        let server = Server::bind("127.0.0.1:0", size, None).unwrap();
        let addr = server.local_addr().unwrap().to_string();
        let mut server = Some(server);
        let handles: Vec<_> = (0..size)
            .map(|r| {
                let rv = match r {
                    0 => Rendezvous::Serve(server.take().unwrap()),
                    _ => Rendezvous::Join(addr.clone()),
                };
                let cfg = MeshOptions {
                    transport: kind,
                    timeout,
                    ..MeshOptions::default()
                };
                std::thread::spawn(move || {
                    let mut m = connect_mesh(r, size, rv, &cfg)?;
                    check(&mut m);
                    Ok(m.kind())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Every rank sends its rank to every peer and checks what each peer sent: the
    /// connection at index `j` really leads to rank `j`.
    fn exchange_ranks(m: &mut Mesh) {
        let me = m.rank();
        let size = m.size();
        let d = m.domain().clone();
        let mut live = Vec::new();
        for j in 0..size {
            if j == me {
                assert!(m.peer(j).is_none(), "rank {me} has a connection to itself");
                continue;
            }
            let out = d.register(8, Access::empty()).unwrap();
            out.write_at(0, &u64::from(me).to_le_bytes()).unwrap();
            let inb = d.register(8, Access::empty()).unwrap();
            let c = m.peer(j).unwrap();
            c.post_recv(inb.full(), 10).unwrap();
            c.post_send(out.full(), 11).unwrap();
            live.push((j, out, inb));
        }
        for (j, _out, inb) in &live {
            let c = m.peer(*j).unwrap();
            let mut cq: Vec<Completion> = (0..2).map(|_| Completion::default()).collect();
            let (mut got_send, mut got_recv) = (false, false);
            let end = Instant::now() + Duration::from_secs(20);
            while !(got_send && got_recv) {
                let n = c.poll(&mut cq).unwrap();
                for x in cq.iter().take(n) {
                    assert!(x.status.is_ok(), "{x:?}");
                    match x.wr_id {
                        10 => got_recv = true,
                        11 => got_send = true,
                        w => panic!("rank {me}: stray completion {w} from the setup"),
                    }
                }
                for x in cq.iter_mut() {
                    x.buf = None;
                }
                assert!(Instant::now() < end, "rank {me}: no reply from rank {j}");
                if n == 0 {
                    std::thread::yield_now();
                }
            }
            assert_eq!(
                inb.load_u64(0).unwrap(),
                u64::from(*j),
                "rank {me}'s connection {j} leads elsewhere"
            );
        }
    }

    #[test]
    fn full_mesh_of_2_to_4_ranks_over_shm_and_tcp() {
        for kind in [TransportKind::Shm, TransportKind::Tcp] {
            for size in 2..=4 {
                let rs = run_job(size, Some(kind), Duration::from_secs(30), exchange_ranks);
                for (r, res) in rs.into_iter().enumerate() {
                    let got = res.unwrap_or_else(|e| panic!("{kind} size {size} rank {r}: {e}"));
                    assert_eq!(got, kind);
                }
            }
        }
    }

    #[test]
    fn automatic_choice_on_one_host_is_shm() {
        let rs = run_job(3, None, Duration::from_secs(30), exchange_ranks);
        for res in rs {
            assert_eq!(res.unwrap(), TransportKind::Shm);
        }
    }

    #[test]
    fn one_rank_is_a_mesh_of_nothing() {
        let rs = run_job(1, Some(TransportKind::Tcp), Duration::from_secs(5), |m| {
            assert!(m.peer(0).is_none());
        });
        assert_eq!(rs.len(), 1);
        assert!(rs[0].is_ok());
    }

    #[test]
    fn a_missing_rank_is_a_timeout_not_a_hang() {
        // A job of 3 where only ranks 0 and 1 start.
        let server = Server::bind("127.0.0.1:0", 3, None).unwrap();
        let addr = server.local_addr().unwrap().to_string();
        let cfg = MeshOptions {
            transport: Some(TransportKind::Tcp),
            timeout: Duration::from_millis(800),
            ..MeshOptions::default()
        };
        let c2 = cfg.clone();
        let t0 = Instant::now();
        let h = std::thread::spawn(move || connect_mesh(1, 3, Rendezvous::Join(addr), &c2));
        let r0 = connect_mesh(0, 3, Rendezvous::Serve(server), &cfg);
        let r1 = h.join().unwrap();
        // The bootstrap names the rank that never came.
        assert!(
            matches!(&r0, Err(Error::RanksLost { ranks, .. }) if ranks == &[2]),
            "{r0:?}"
        );
        assert!(r1.is_err(), "rank 1 must fail too: {r1:?}");
        assert!(t0.elapsed() < Duration::from_secs(15));
    }

    /// A stranger that connects to a rank's listener with another job's nonce is refused
    /// and recorded; the real rank still gets its place.
    #[test]
    fn a_stray_connection_is_refused_and_the_real_rank_connects() {
        let server = Server::bind("127.0.0.1:0", 2, None).unwrap();
        let addr = server.local_addr().unwrap().to_string();
        let cfg = MeshOptions {
            transport: Some(TransportKind::Tcp),
            timeout: Duration::from_secs(20),
            ..MeshOptions::default()
        };
        let h = std::thread::spawn(move || {
            let mut m = connect_mesh(0, 2, Rendezvous::Serve(server), &cfg)?;
            let refused = m.refused.clone();
            // Receive one message from rank 1 over the mesh's connection.
            let r = m.domain().register(8, Access::empty())?;
            let c = m.peer(1).expect("rank 1");
            c.post_recv(r.full(), 5).map_err(|e| e.error)?;
            let mut cq: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
            let end = Instant::now() + Duration::from_secs(10);
            while c.poll(&mut cq)? == 0 {
                assert!(Instant::now() < end, "no message from rank 1");
                std::thread::yield_now();
            }
            cq[0].buf = None;
            Ok::<_, Error>((refused, r.load_u64(0)?))
        });
        // This thread plays rank 1 by hand.
        let opts = Options {
            tcp_bind: "127.0.0.1:0".into(),
            ..Options::default()
        };
        let d = Domain::open(TransportKind::Tcp, &opts).unwrap();
        let l = d.listen().unwrap();
        let blob = MeshBlob {
            nonce: 0,
            info: EndpointInfo {
                host: host_id(),
                rdma: false,
                addrs: vec![publishable(l.address())],
            },
        };
        let table = join(&addr, 1, 2, None, &blob.encode(), Duration::from_secs(20)).unwrap();
        let zero = MeshBlob::decode(&table[0].blob).unwrap();
        let target = address_of(&zero.info, TransportKind::Tcp)
            .unwrap()
            .to_string();
        let dial = |nonce: u64| {
            let mut c = d.connect(&target).unwrap();
            let t = backend::connect_timeout(c.as_mut(), Duration::from_secs(10)).unwrap();
            Naming::start(t, Some(0), 1, nonce).unwrap()
        };
        // The stranger: another job's nonce. Rank 0 refuses it; we drop it.
        let mut stray = dial(zero.nonce ^ 1);
        let end = Instant::now() + Duration::from_secs(10);
        while !stray.sent && Instant::now() < end {
            if stray.step(zero.nonce ^ 1).is_err() {
                break; // rank 0's identity does not carry the stranger's nonce
            }
        }
        // The real rank 1.
        let mut real = dial(zero.nonce);
        let end = Instant::now() + Duration::from_secs(10);
        while !real.step(zero.nonce).unwrap() {
            assert!(Instant::now() < end, "rank 0 never named itself");
            std::thread::yield_now();
        }
        assert_eq!(real.got, Some(0));
        let msg = d.register(8, Access::empty()).unwrap();
        msg.store_u64(0, 0x5eed).unwrap();
        real.conn.post_send(msg.full(), 6).unwrap();
        let (refused, got) = h.join().unwrap().unwrap();
        drop(stray);
        assert_eq!(
            got, 0x5eed,
            "the mesh's rank-1 connection is not the real one"
        );
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert!(refused[0].contains("another job"), "{refused:?}");
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        let cfg = MeshOptions::default();
        assert!(matches!(
            connect_mesh(2, 2, Rendezvous::Join("127.0.0.1:1".into()), &cfg),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            connect_mesh(0, 2, Rendezvous::Join("127.0.0.1:1".into()), &cfg),
            Err(Error::InvalidArgument(_))
        ));
        let s = Server::bind("127.0.0.1:0", 2, None).unwrap();
        assert!(matches!(
            connect_mesh(1, 2, Rendezvous::Serve(s), &cfg),
            Err(Error::InvalidArgument(_))
        ));
        let l = Launch::explicit(0, 2, None).unwrap();
        assert!(matches!(
            mesh_from_launch(&l, &cfg),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn blobs_and_identities_decode_with_typed_errors() {
        let b = MeshBlob {
            nonce: 7,
            info: EndpointInfo {
                host: "h".into(),
                rdma: false,
                addrs: vec!["tcp:*:1".into()],
            },
        };
        let e = b.encode();
        assert_eq!(MeshBlob::decode(&e), Ok(b));
        assert!(matches!(
            MeshBlob::decode(&e[..5]),
            Err(DecodeError::Truncated { .. })
        ));
        let mut bad = e.clone();
        bad[0] ^= 1;
        assert!(matches!(
            MeshBlob::decode(&bad),
            Err(DecodeError::BadMagic { .. })
        ));
        let mut bad = e.clone();
        bad[4] = 9;
        assert!(matches!(
            MeshBlob::decode(&bad),
            Err(DecodeError::Version { .. })
        ));
        assert!(MeshBlob::decode(&e[..e.len() - 1]).is_err());
        assert_eq!(parse_ident(&ident(3, 5), 5), Ok(3));
        assert!(parse_ident(&ident(3, 5), 6).is_err(), "nonce not checked");
        assert!(parse_ident(&ident(3, 5)[..8], 5).is_err());
        let mut x = ident(3, 5);
        x[1] ^= 1;
        assert!(parse_ident(&x, 5).is_err());
    }

    #[test]
    fn the_choice_needs_every_rank() {
        let i = |host: &str, rdma, addrs: &[&str]| EndpointInfo {
            host: host.into(),
            rdma,
            addrs: addrs.iter().map(|s| s.to_string()).collect(),
        };
        let same = [
            i("a", false, &["shm:@x", "tcp:*:1"]),
            i("a", false, &["shm:@y", "tcp:*:2"]),
        ];
        assert_eq!(choose(&same, None).unwrap(), TransportKind::Shm);
        let two_hosts = [
            i("a", true, &["shm:@x", "verbs:*:1", "tcp:*:1"]),
            i("b", true, &["shm:@y", "verbs:*:2", "tcp:*:2"]),
        ];
        assert_eq!(choose(&two_hosts, None).unwrap(), TransportKind::Verbs);
        let one_without_rdma = [
            i("a", true, &["verbs:*:1", "tcp:*:1"]),
            i("b", false, &["tcp:*:2"]),
        ];
        assert_eq!(choose(&one_without_rdma, None).unwrap(), TransportKind::Tcp);
        assert!(matches!(
            choose(&one_without_rdma, Some(TransportKind::Verbs)),
            Err(Error::Unavailable { .. })
        ));
    }
}

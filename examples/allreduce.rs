//! All-reduce (sum of `f32`) across N processes over fabric-core, on the caller's own
//! memory, checked and timed like nccl-tests' `all_reduce_perf`.
//!
//! ```text
//! cargo run --release --example allreduce                          # 2 ranks it starts itself, shm
//! cargo run --release --example allreduce -- --ranks 4 --transport tcp
//! FABRIC_BOOTSTRAP=node1:18600 srun -n 8 target/release/examples/allreduce
//! ```
//! Under a launcher (Slurm, mpirun, PMI, torchrun) each process takes its rank and size from
//! the launcher's environment; rank 0 serves the rendezvous at `FABRIC_BOOTSTRAP` (or
//! torchrun's `MASTER_ADDR:MASTER_PORT`, or `--bootstrap`), which must name rank 0's host.
//! By hand: `--rank R --ranks N --bootstrap HOST:PORT` on every host.
//! ```text
//! ```
//!
//! Every rank connects to every other through [`fabric_core::bootstrap::mesh`] (one domain,
//! one connection per peer) and hands the connections to one [`fabric_core::Worker`]: one
//! poll and one wait fd serve every peer. The input (`Vec<f32>`) and the output (`Vec<f32>`) are the
//! caller's, registered in place with `Domain::register_memory`; the library's own scratch
//! (the ring's chunk slots) comes from `Domain::register`, whose memory shm can hand to a
//! peer by rendezvous (one copy instead of two).
//!
//! Algorithms: messages up to `--rd-max-bytes` use recursive doubling (log2 N exchanges of
//! the whole vector; a non-power-of-two N folds its extra ranks in first and out last). On
//! shm its rounds up to `--put-max-bytes` are one-sided puts (`--rd-mode put`): the vector
//! is written into a slot the partner registered once and a remote fetch-add on the
//! partner's flag word says which operation it belongs to (a 4-byte vector rides in that
//! word); the partner spins on its own word, so no receive is posted, nothing is matched
//! and no poll sits on the critical path (see [`PutRd`]). Larger messages use a ring:
//! reduce-scatter then all-gather, each segment split into
//! `--chunk-bytes` chunks so that a chunk travels while the previous one is reduced. With
//! `--one-sided` (transports that let peers write caller memory: tcp, verbs) the
//! all-gather writes straight into the right neighbour's output with `post_write`, each
//! chunk followed by an 8-byte notice (connections deliver in post order).
//!
//! The ring's reduce-scatter moves its chunks in one of two ways (`--rs`):
//! * `write` (the default on shm): each rank writes a chunk straight into one of the right
//!   neighbour's remotely writable slots (`post_write` + an 8-byte notice): one copy,
//!   whatever memory the chunk comes from — on shm the caller's input cannot be shared, so
//!   a two-sided send of it goes eagerly through the channel ring (two copies). The
//!   receiver adds its input block by block into the chunk as it reads it out of the slot
//!   (fused, no separate copy pass), and the finished segment stays in the slot, from where
//!   the all-gather's first send goes by rendezvous (one copy into the neighbour's output).
//!   Slots are reused under credits: the receiver writes into the sender's 8-byte credit
//!   word how many chunks it finished with. An operation with more than one and fewer than
//!   twice as many chunks per segment as slots uses the first half of them, which keeps a
//!   few-MiB all-reduce's working set in cache.
//! * `send` (the default elsewhere): two-sided sends into posted receives. Its chunk
//!   follows the size (`send_ring_chunk`): whole segments of up to 1 MiB, 256 KiB chunks
//!   for segments larger than 2 MiB.
//!
//! The output is the caller's memory and the operation does not read what the all-gather
//! copies into it: for vectors whose inputs and outputs on this host fill half the L3, the
//! output region is marked streaming (`Region::set_streaming`, `--stream-output`), so shm
//! copies those receives with non-temporal stores and leaves the cache to the inputs and
//! the ring's slots.
//!
//! Columns (nccl-tests): `time` is the mean over `--iters` operations on rank 0, `algbw`
//! = bytes / time, `busbw` = algbw × 2(N-1)/N, in GB/s (10^9 B/s). The result is checked
//! against exact values (small integers in `f32`) after each size; a wrong element makes
//! the process exit with status 1.

use std::io::IsTerminal;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{ArgAction, Parser, ValueEnum};
use fabric_core::bootstrap::{
    mesh::{connect_mesh, mesh_from_launch, MeshOptions, Rendezvous},
    Launch, Server,
};
use fabric_core::{
    Access, Buf, Domain, EndpointId, Event, PostResult, RemoteKey, RemoteWindow, Status, Transport,
    TransportKind, Worker,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "All-reduce (f32 sum) across N processes over fabric-core (nccl-tests-style table)"
)]
struct Args {
    /// Ranks to start on this host (ignored under a launcher or with --rank).
    #[arg(long, default_value_t = 2)]
    ranks: u32,
    /// Transport: shm, tcp or verbs (default: one every rank has, shm on one host; env
    /// FABRIC_TRANSPORT).
    #[arg(long)]
    transport: Option<TransportKind>,
    /// Smallest message in bytes.
    #[arg(long, default_value_t = 4)]
    min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Timed operations per size (default: scaled with the size).
    #[arg(long)]
    iters: Option<usize>,
    /// Untimed operations before each size (default: a tenth of the iterations).
    #[arg(long)]
    warmup: Option<usize>,
    /// Check the result of each size (`--check false` to skip).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    check: bool,
    /// Force an algorithm (default: recursive doubling up to --rd-max-bytes, else ring).
    #[arg(long)]
    algo: Option<Algo>,
    /// Largest message for recursive doubling.
    #[arg(long, default_value_t = 32 << 10)]
    rd_max_bytes: usize,
    /// Ring pipeline chunk (default: 512 KiB for the write ring; for the send ring a whole
    /// segment of up to 1 MiB where segments are at most 2 MiB, 256 KiB chunks beyond).
    #[arg(long)]
    chunk_bytes: Option<usize>,
    /// Ring chunk slots (scratch per rank = slots × chunk; the write ring's operations with
    /// 2 to 2 × slots - 1 chunks per segment use half of them, so that they stay in cache).
    #[arg(long, default_value_t = 8)]
    slots: usize,
    /// How the ring's reduce-scatter moves chunks: `write` (one-sided writes into the
    /// neighbour's slots, one copy) or `send` (two-sided). Default: write on shm, whose
    /// two-sided path would copy the caller's input twice (through the ring); send
    /// elsewhere.
    #[arg(long)]
    rs: Option<RsMode>,
    /// How recursive doubling moves each round's vector: `put` (a one-sided write into
    /// the partner's pre-registered slot and a remote fetch-add on its flag word, which the
    /// partner spins on; 4 bytes ride in the flag word itself) or `send` (two-sided).
    /// Default: put on shm (whose one-sided operations are copies made by the poster),
    /// send elsewhere.
    #[arg(long)]
    rd_mode: Option<RdMode>,
    /// Largest message recursive doubling puts (larger ones go by sends): on the 2-CPU
    /// host puts were faster than sends at every size up to 32 KiB, with 2 ranks and with
    /// 3-4 (oversubscribed) (BENCHMARKS).
    #[arg(long, default_value_t = 32768)]
    put_max_bytes: usize,
    /// Recursive doubling's puts store straight into the partner's slot and flag word
    /// through a remote window (`Transport::map_remote`) where the transport maps peers'
    /// memory (shm): no operation, completion or poll per put. `--window false` posts
    /// them (one-sided write + fetch-add) instead.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    window: bool,
    /// All-gather by one-sided writes where the transport allows peers to write caller
    /// memory.
    #[arg(long)]
    one_sided: bool,
    /// Mark the output region streaming (`Region::set_streaming`: shm copies received
    /// messages of 64 KiB and more into it with non-temporal stores). `auto`: for vectors
    /// whose inputs and outputs on this host (2 × ranks × size) fill half the L3 or more;
    /// elsewhere the output stays in the cache for whoever reads it next.
    #[arg(long, value_enum, default_value_t = StreamOut::Auto)]
    stream_output: StreamOut,
    /// Do not pin the ranks this process starts to CPUs of their own.
    #[arg(long)]
    no_pin: bool,
    /// Shared secret of the bootstrap and tcp (env FABRIC_SECRET).
    #[arg(long)]
    secret: Option<String>,
    /// This process's rank (with --bootstrap; set for the ranks a run starts itself).
    #[arg(long, requires = "bootstrap")]
    rank: Option<u32>,
    /// Rendezvous HOST:PORT (rank 0 binds it; env FABRIC_BOOTSTRAP under a launcher).
    #[arg(long)]
    bootstrap: Option<String>,
    /// Internal: the CPU to pin to.
    #[arg(long, hide = true)]
    pin_cpu: Option<usize>,
    /// Internal (tests): the last rank adds 1 to one element of its input behind the
    /// check's back, so the check must fail.
    #[arg(long, hide = true)]
    inject_error: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RsMode {
    /// One-sided writes into the right neighbour's receive slots, with credits.
    Write,
    /// Two-sided sends into posted receives.
    Send,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StreamOut {
    /// Streaming where this host's inputs and outputs fill half the L3 or more.
    Auto,
    /// Every size.
    Always,
    /// No size.
    Never,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RdMode {
    /// One-sided writes into the partner's slots and fetch-adds on its flag words.
    Put,
    /// Two-sided sends into posted receives.
    Send,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Algo {
    /// Recursive doubling (latency-optimal).
    Rd,
    /// Pipelined ring reduce-scatter + all-gather (bandwidth-optimal).
    Ring,
}

impl Algo {
    fn name(self, one_sided: bool) -> &'static str {
        match (self, one_sided) {
            (Algo::Rd, _) => "rd",
            (Algo::Ring, false) => "ring",
            (Algo::Ring, true) => "ring-1s",
        }
    }
}

fn main() {
    fabric::cli::die_on_broken_pipe();
    let mut args = Args::parse();
    if args.transport.is_none() {
        match std::env::var("FABRIC_TRANSPORT") {
            Ok(v) if !v.is_empty() => match v.parse() {
                Ok(k) => args.transport = Some(k),
                Err(e) => fail(None, &format!("FABRIC_TRANSPORT: {e}")),
            },
            _ => {}
        }
    }
    if args.secret.is_none() {
        args.secret = std::env::var("FABRIC_SECRET")
            .ok()
            .filter(|s| !s.is_empty());
    }
    if let Err(e) = run(&args) {
        fail(args.rank, &e.to_string());
    }
}

fn fail(rank: Option<u32>, msg: &str) -> ! {
    match rank {
        Some(r) => eprintln!("allreduce: rank {r}: error: {msg}"),
        None => eprintln!("allreduce: error: {msg}"),
    }
    std::process::exit(1);
}

/// Finds the job (explicit rank, a launcher, or ranks this process starts) and runs it.
fn run(args: &Args) -> Res<()> {
    let cfg = MeshOptions {
        transport: args.transport,
        secret: args.secret.as_ref().map(|s| s.as_bytes().to_vec()),
        ..MeshOptions::default()
    };
    if let Some(cpu) = args.pin_cpu {
        fabric_core::sys::pin_to_cpu(cpu)?;
    }
    if let Some(rank) = args.rank {
        let launch = Launch::explicit(rank, args.ranks, args.bootstrap.clone())?;
        let mesh = mesh_from_launch(&launch, &cfg)?;
        // Pinned: the run that started us gave every rank a CPU of its own. Otherwise the
        // CPUs we may use (inherited from that run) decide.
        let oversubscribed = args.pin_cpu.is_none() && args.ranks as usize > usable_cpus();
        return bench(args, mesh, oversubscribed);
    }
    if let Some(mut launch) = Launch::from_env()? {
        if launch.server.is_none() {
            launch.server = args.bootstrap.clone();
        }
        let mesh = mesh_from_launch(&launch, &cfg)?;
        return bench(args, mesh, false);
    }
    // Start ranks 1.. ourselves; this process is rank 0.
    if args.ranks == 0 {
        return Err("--ranks must be at least 1".into());
    }
    let n = args.ranks;
    let server = Server::bind("127.0.0.1:0", n, cfg.secret.as_deref())?;
    let addr = server.local_addr()?.to_string();
    let cpus = fabric_core::sys::allowed_cpus().unwrap_or_default();
    let pin = !args.no_pin && cpus.len() >= n as usize && n > 1;
    // Counted before pinning: a pinned process sees one CPU.
    let oversubscribed = n as usize > cpus.len().max(1);
    if pin {
        fabric_core::sys::pin_to_cpu(cpus[0])?;
    }
    let mut children: Vec<Child> = Vec::new();
    for r in 1..n {
        // The same arguments (and environment) plus this rank's place.
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(std::env::args_os().skip(1))
            .arg("--rank")
            .arg(r.to_string())
            .arg("--bootstrap")
            .arg(&addr)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if pin {
            cmd.arg("--pin-cpu").arg(cpus[r as usize].to_string());
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                reap(children, true);
                return Err(e.into());
            }
        }
    }
    // A watchdog: a rank that fails ends the run at once (the others would only notice
    // at their next deadline).
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = {
        let finished = finished.clone();
        std::thread::spawn(move || {
            let mut children = children;
            while !finished.load(std::sync::atomic::Ordering::Acquire) {
                for (i, c) in children.iter_mut().enumerate() {
                    if let Ok(Some(st)) = c.try_wait() {
                        if !st.success() {
                            eprintln!("allreduce: rank {} failed ({st}); stopping the run", i + 1);
                            reap(children, true);
                            std::process::exit(1);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            children
        })
    };
    let r = connect_mesh(0, n, Rendezvous::Serve(server), &cfg)
        .map_err(Into::into)
        .and_then(|mesh| bench(args, mesh, oversubscribed));
    finished.store(true, std::sync::atomic::Ordering::Release);
    let children = watch.join().map_err(|_| "watchdog thread panicked")?;
    let failed = reap(children, r.is_err());
    r?;
    if failed > 0 {
        return Err(format!("{failed} of the ranks this run started failed").into());
    }
    Ok(())
}

/// Waits for the started ranks (killing them first when `kill`); returns how many failed.
fn reap(children: Vec<Child>, kill: bool) -> usize {
    let mut failed = 0;
    for mut c in children {
        if kill {
            let _ = c.kill();
        }
        match c.wait() {
            Ok(st) if st.success() => {}
            _ => failed += 1,
        }
    }
    failed
}

// ---------------------------------------------------------------------------------------
// The communication layer: one `Worker` (one progress engine, one poll, one wait fd) with
// an endpoint per peer; send/recv/write by rank.

/// A finished operation.
#[derive(Debug)]
struct Done {
    wr_id: u64,
    len: usize,
}

#[derive(Debug)]
struct Comm {
    rank: usize,
    size: usize,
    domain: Domain,
    worker: Worker,
    /// Each rank's endpoint (`None` at this rank).
    eps: Vec<Option<EndpointId>>,
    events: Vec<Event>,
    /// More ranks than CPUs here: yield at once when idle.
    oversubscribed: bool,
    /// Reduction scratch (cache-sized).
    blk: Vec<u8>,
    /// Completions taken by the last poll (kept to reuse its allocation).
    done: Vec<Done>,
    /// The write ring's slots, keys and counts (when the ring reduce-scatters by writes).
    wring: Option<WriteRing>,
    /// The write ring's credit writes posted and not completed (they may complete during
    /// any later poll; `poll` counts them and hides them from the algorithms).
    credits_out: usize,
    /// The one-sided small-message path's state (when recursive doubling puts).
    put: Option<Box<PutRd>>,
    /// Its writes and fetch-adds posted and not yet taken by `poll` (counted and hidden
    /// like the credits).
    puts_out: usize,
}

/// Outcome of a post: done, or refused for backpressure (the buffer is handed back).
enum Posted {
    Yes,
    Full(Buf),
}

impl Comm {
    fn new(
        rank: usize,
        domain: Domain,
        peers: Vec<Option<Box<dyn Transport>>>,
        oversubscribed: bool,
    ) -> Res<Self> {
        let mut worker = Worker::new(&domain)?;
        let size = peers.len();
        let mut eps = Vec::with_capacity(size);
        for p in peers {
            eps.push(match p {
                Some(t) => Some(worker.add(t)?),
                None => None,
            });
        }
        Ok(Comm {
            rank,
            size,
            domain,
            worker,
            eps,
            events: (0..64).map(|_| Event::default()).collect(),
            oversubscribed,
            blk: vec![0u8; BLK],
            done: Vec::with_capacity(2 * WINDOW),
            wring: None,
            credits_out: 0,
            put: None,
            puts_out: 0,
        })
    }

    fn ep(&self, p: usize) -> Res<EndpointId> {
        self.eps
            .get(p)
            .copied()
            .flatten()
            .ok_or_else(|| format!("no connection to rank {p}").into())
    }

    fn posted(r: PostResult, p: usize, what: &str) -> Res<Posted> {
        match r {
            Ok(()) => Ok(Posted::Yes),
            Err(e) if e.is_would_block() => Ok(Posted::Full(e.buf)),
            Err(e) => Err(format!("{what} to rank {p}: {}", e.error).into()),
        }
    }

    fn send(&mut self, p: usize, buf: Buf, wr_id: u64) -> Res<Posted> {
        let ep = self.ep(p)?;
        Self::posted(self.worker.post_send(ep, buf, wr_id), p, "send")
    }

    fn recv(&mut self, p: usize, buf: Buf, wr_id: u64) -> Res<Posted> {
        let ep = self.ep(p)?;
        Self::posted(self.worker.post_recv(ep, buf, wr_id), p, "receive")
    }

    fn write(&mut self, p: usize, buf: Buf, key: &RemoteKey, off: u64, wr_id: u64) -> Res<Posted> {
        let ep = self.ep(p)?;
        let r = self.worker.endpoint(ep)?.post_write(buf, key, off, wr_id);
        Self::posted(r, p, "write")
    }

    fn atomic(&mut self, p: usize, buf: Buf, key: &RemoteKey, off: u64, add: u64) -> Res<Posted> {
        let ep = self.ep(p)?;
        let r = self.worker.endpoint(ep)?.post_atomic(
            buf,
            key,
            off,
            fabric_core::AtomicOp::FetchAdd { add },
            PUT,
        );
        Self::posted(r, p, "fetch-add")
    }

    /// One poll of every endpoint; finished operations go to `out` (their buffers are
    /// released here). A failed operation is an error. (Lockstep algorithms have work in
    /// flight only with the peers they wait for.)
    fn poll(&mut self, out: &mut Vec<Done>) -> Res<usize> {
        let n = self.worker.poll(&mut self.events)?;
        let mut bad = None;
        for ev in self.events.iter_mut().take(n) {
            let c = std::mem::take(&mut ev.completion);
            if c.status != Status::Success && bad.is_none() {
                let peer = self.eps.iter().position(|e| *e == Some(ev.endpoint));
                bad = Some(format!(
                    "{:?} with rank {} completed with {:?}",
                    c.op,
                    peer.map_or_else(|| "?".into(), |p| p.to_string()),
                    c.status
                ));
            }
            if c.wr_id == CREDIT {
                self.credits_out = self.credits_out.saturating_sub(1);
                continue;
            }
            if c.wr_id == PUT {
                self.puts_out = self.puts_out.saturating_sub(1);
                continue;
            }
            out.push(Done {
                wr_id: c.wr_id,
                len: c.len,
            });
        }
        match bad {
            Some(b) => Err(b.into()),
            None => Ok(n),
        }
    }
}

/// Backoff while waiting: spin, then yield, then sleep on the connection's wait fd; an
/// error after a minute without progress.
#[derive(Debug)]
struct Idle {
    since: Option<Instant>,
    spins: u32,
}

const STALL: Duration = Duration::from_secs(60);

impl Idle {
    fn new() -> Self {
        Idle {
            since: None,
            spins: 0,
        }
    }

    fn progress(&mut self) {
        self.since = None;
        self.spins = 0;
    }

    fn wait(&mut self, comm: &mut Comm, p: usize) -> Res<()> {
        self.spins += 1;
        if !comm.oversubscribed && self.spins < 256 {
            Self::keep_active(comm, p)?;
            std::hint::spin_loop();
            return Ok(());
        }
        let t0 = *self.since.get_or_insert_with(Instant::now);
        let waited = t0.elapsed();
        if waited > STALL {
            return Err(format!("no progress with rank {p} for {} s", STALL.as_secs()).into());
        }
        if waited > Duration::from_millis(5) {
            // Only a long wait sleeps: the worker parks every endpoint on its fd.
            comm.worker.wait(Some(Duration::from_millis(1)))?;
            return Ok(());
        }
        Self::keep_active(comm, p)?;
        if comm.oversubscribed || waited > Duration::from_micros(100) {
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Keeps the peer's endpoint active while we spin or yield. The worker parks an
    /// endpoint after `PARK_AFTER` (64) empty polls; a parked shm endpoint then costs this
    /// rank an `epoll_wait(0)` on every poll (none is active) and the peer an `eventfd`
    /// write per message (our "sleeping" flag is set), plus the arm's system calls.
    fn keep_active(comm: &mut Comm, p: usize) -> Res<()> {
        if let Ok(ep) = comm.ep(p) {
            comm.worker.endpoint(ep)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Reduction on bytes (f32, native endianness; all ranks run this build).

/// `acc[i] += x[i]` over f32 elements.
///
/// LLVM turns this loop into packed adds already (callgrind: 4,867 instructions per 16 KiB
/// block, 1.19 per element, the same as an explicitly 8-lane version).
fn add_f32(acc: &mut [u8], x: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(4).zip(x.chunks_exact(4)) {
        let v = f32::from_ne_bytes([a[0], a[1], a[2], a[3]])
            + f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        a.copy_from_slice(&v.to_ne_bytes());
    }
}

const BLK: usize = 16 << 10;

/// `dst[d_off..+len] = a[a_off..+len] + b` in cache-sized blocks, through copies (both
/// regions may have slices out in other operations meanwhile).
fn sum_to(
    blk: &mut [u8],
    dst: &fabric_core::Region,
    d_off: usize,
    a: &fabric_core::Region,
    a_off: usize,
    b: &[u8],
) -> Res<()> {
    let mut o = 0;
    while o < b.len() {
        let k = (b.len() - o).min(blk.len());
        a.read_at(a_off + o, &mut blk[..k])?;
        add_f32(&mut blk[..k], &b[o..o + k]);
        dst.write_at(d_off + o, &blk[..k])?;
        o += k;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Algorithms.

const RECV: u64 = 1 << 63;
const WRITE: u64 = 1 << 62;
/// The notice that follows a write (write ring).
const NOTICE: u64 = 1 << 61;
/// A credit write (write ring); carries no step or chunk.
const CREDIT: u64 = 1 << 60;
/// A write or fetch-add of the one-sided small-message path; carries no step or chunk.
const PUT: u64 = 1 << 59;

fn wr(flags: u64, step: usize, chunk: usize) -> u64 {
    flags | ((step as u64) << 32) | chunk as u64
}

fn unwr(w: u64) -> (u64, usize, usize) {
    (
        w & (RECV | WRITE | NOTICE),
        ((w & !(RECV | WRITE | NOTICE)) >> 32) as usize,
        (w & 0xffff_ffff) as usize,
    )
}

/// The buffers of one size.
struct Bufs<'a> {
    /// Input (the caller's `Vec<f32>`).
    send: &'a fabric_core::Region,
    /// Output (the caller's `Vec<f32>`).
    out: &'a fabric_core::Region,
    /// Recursive doubling's receive buffer.
    tmp: &'a fabric_core::Region,
    /// The ring's chunk slots.
    slots: &'a [fabric_core::Region],
    /// The send ring's chunk for this size, in bytes (at most a slot's length).
    chunk: usize,
    /// The right neighbour's output (one-sided all-gather).
    right_out: Option<RemoteKey>,
    bytes: usize,
}

/// Sends `src[..bytes]` to rank `to` while receiving as many bytes from rank `from` into
/// `tmp` (the receive is posted first).
fn exchange(
    comm: &mut Comm,
    to: usize,
    from: usize,
    src: &fabric_core::Region,
    tmp: &fabric_core::Region,
    bytes: usize,
) -> Res<()> {
    // The completion list is the Comm's (no allocation per step).
    let mut done = std::mem::take(&mut comm.done);
    let r = exchange_with(comm, &mut done, to, from, src, tmp, bytes);
    done.clear();
    comm.done = done;
    r
}

fn exchange_with(
    comm: &mut Comm,
    done: &mut Vec<Done>,
    to: usize,
    from: usize,
    src: &fabric_core::Region,
    tmp: &fabric_core::Region,
    bytes: usize,
) -> Res<()> {
    let mut pending_recv = Some(tmp.slice(0, bytes)?);
    let mut pending_send = Some(src.slice(0, bytes)?);
    let (mut sent, mut got) = (false, false);
    let mut idle = Idle::new();
    while !(sent && got) {
        if let Some(b) = pending_recv.take() {
            if let Posted::Full(b) = comm.recv(from, b, RECV)? {
                pending_recv = Some(b);
            }
        }
        if let Some(b) = pending_send.take() {
            if let Posted::Full(b) = comm.send(to, b, 0)? {
                pending_send = Some(b);
            }
        }
        done.clear();
        if comm.poll(done)? == 0 {
            idle.wait(comm, from)?;
            continue;
        }
        idle.progress();
        for d in done.iter() {
            if d.wr_id & RECV != 0 {
                if d.len != bytes {
                    return Err(
                        format!("rank {from} sent {} bytes, expected {bytes}", d.len).into(),
                    );
                }
                got = true;
            } else {
                sent = true;
            }
        }
    }
    Ok(())
}

/// One-way transfer of `src[..bytes]` to `to` / into `dst[..bytes]` from `from`.
fn one_way(
    comm: &mut Comm,
    peer: usize,
    r: &fabric_core::Region,
    bytes: usize,
    send: bool,
) -> Res<()> {
    let mut done = std::mem::take(&mut comm.done);
    let res = one_way_with(comm, &mut done, peer, r, bytes, send);
    done.clear();
    comm.done = done;
    res
}

fn one_way_with(
    comm: &mut Comm,
    done: &mut Vec<Done>,
    peer: usize,
    r: &fabric_core::Region,
    bytes: usize,
    send: bool,
) -> Res<()> {
    let mut pending = Some(r.slice(0, bytes)?);
    let mut idle = Idle::new();
    loop {
        if let Some(b) = pending.take() {
            let p = if send {
                comm.send(peer, b, 0)?
            } else {
                comm.recv(peer, b, RECV)?
            };
            if let Posted::Full(b) = p {
                pending = Some(b);
            }
        }
        done.clear();
        if comm.poll(done)? == 0 {
            idle.wait(comm, peer)?;
            continue;
        }
        idle.progress();
        if let Some(d) = done.first() {
            if !send && d.len != bytes {
                return Err(format!("rank {peer} sent {} bytes, expected {bytes}", d.len).into());
            }
            return Ok(());
        }
    }
}

/// Recursive doubling (MPICH's scheme for a non-power-of-two N: ranks below 2·rem pair
/// up, the even one hands its vector to the odd one and gets the result at the end).
fn allreduce_rd(comm: &mut Comm, b: &Bufs<'_>) -> Res<()> {
    if let Some(mut pr) = comm.put.take() {
        let res = if b.bytes <= pr.max {
            Some(allreduce_put(comm, &mut pr, b))
        } else {
            None
        };
        comm.put = Some(pr);
        if let Some(res) = res {
            return res;
        }
    }
    let (n, r, bytes) = (comm.size, comm.rank, b.bytes);
    let mut blk = std::mem::take(&mut comm.blk);
    let res = (|| -> Res<()> {
        if n == 1 {
            return copy_region(&mut blk, b.out, b.send, bytes);
        }
        let p2 = pow2_below(n);
        let rem = n - p2;
        // `have_out`: the running sum is in `out` (else it is still `send`).
        let mut have_out = false;
        let newrank = if r < 2 * rem {
            if r % 2 == 0 {
                one_way(comm, r + 1, b.send, bytes, true)?;
                one_way(comm, r + 1, b.out, bytes, false)?;
                return Ok(());
            }
            one_way(comm, r - 1, b.tmp, bytes, false)?;
            let t = b.tmp.bytes()?;
            sum_to(&mut blk, b.out, 0, b.send, 0, &t[..bytes])?;
            have_out = true;
            r / 2
        } else {
            r - rem
        };
        let mut mask = 1;
        while mask < p2 {
            let partner = rd_partner(newrank, mask, rem);
            let src = if have_out { b.out } else { b.send };
            exchange(comm, partner, partner, src, b.tmp, bytes)?;
            let t = b.tmp.bytes()?;
            sum_to(&mut blk, b.out, 0, src, 0, &t[..bytes])?;
            have_out = true;
            mask <<= 1;
        }
        if r < 2 * rem {
            one_way(comm, r - 1, b.out, bytes, true)?;
        }
        Ok(())
    })();
    comm.blk = blk;
    res
}

/// The rank recursive doubling pairs `newrank` with at distance `mask` (ranks below
/// `2 * rem` were folded in pairs: their new rank is `r / 2`, and the odd one stays).
fn rd_partner(newrank: usize, mask: usize, rem: usize) -> usize {
    let pn = newrank ^ mask;
    if pn < rem {
        pn * 2 + 1
    } else {
        pn + rem
    }
}

/// The largest power of two not above `n` (n >= 1).
fn pow2_below(n: usize) -> usize {
    1usize << (usize::BITS - 1 - n.leading_zeros())
}

// ---------------------------------------------------------------------------------------
// Recursive doubling by one-sided puts (the latency path on shm).

/// Bytes per flag word's line (each round's flag on a cache line of its own).
const FLAG_LINE: usize = 64;
/// Puts left unreaped at most before `poll` takes their completions.
const PUTS_UNREAPED: usize = 64;

/// Recursive doubling without two-sided messages: in each round a rank writes its vector
/// straight into a receive slot of its partner (`post_write`; slots registered once,
/// remotely writable, two per round used by alternate operations) and then runs a
/// fetch-add on the partner's flag word for that round, which leaves there
/// `(operation number << 32) | payload`. The partner spins on its own flag word (a local
/// atomic load: no poll, no matching, no receive to post) until the number is that of
/// the current operation. A 4-byte vector travels in the payload itself: one fetch-add per
/// round and no write. The fetch-add is an atomic read-modify-write that follows the
/// write on the same connection (posts run in order), so a flag that says "operation k"
/// means the slot holds operation k's bytes.
///
/// Why two slots per round are enough: a rank puts into its partner's round-j slot for
/// operation k + 1 only after it finished operation k, which needed the partner's round-j
/// put of operation k, which the partner made only after it had finished operation k - 1,
/// the last one that read the slot operation k + 1 uses (the same parity). The flag words
/// alternate the same way (one flag word per round would not do: the partner may finish
/// operation k and overwrite the word with operation k + 1 before we looked at it; with
/// two, the word of operation k + 2 is written only after we made our put of k + 1, that
/// is after we saw k), so comparing the operation number for equality (32 bits,
/// wrapping) is exact. Each word has one writer, which knows what it left there and adds
/// the difference.
#[derive(Debug)]
struct PutRd {
    /// Flag lines (two per round, used by alternate operations), then 2 slots of `max`
    /// bytes per round; the partners write here.
    rx: fabric_core::Region,
    /// Result words of our fetch-adds (their old values; unused).
    atom: fabric_core::Region,
    /// By round (0: the fold of a non-power-of-two N, 1..: the doubling rounds): the
    /// partner's `rx` key.
    keys: Vec<Option<RemoteKey>>,
    /// By round: the partner's `rx` mapped into this process, where the transport maps
    /// peers' memory (then a put is a copy and a store, see [`put`]).
    wins: Vec<Option<RemoteWindow>>,
    /// By round and parity: the value our fetch-adds left in the partner's flag word.
    left: Vec<u64>,
    rounds: usize,
    /// Largest vector (bytes) this path takes.
    max: usize,
    /// Operations run so far (the current one's number once started).
    seq: u64,
    /// Fetch-adds posted so far (picks the result word).
    adds: u64,
    /// After each operation, wait for every put's completion (transports whose writes
    /// may still be reading the source when the post returns).
    drain_each: bool,
    blk_a: Vec<u8>,
    blk_b: Vec<u8>,
}

impl PutRd {
    /// Registers the slots and flags and swaps keys with every partner (in the order of
    /// the rounds, the order in which every pair meets).
    fn setup(comm: &mut Comm, max: usize, window: bool) -> Res<Self> {
        let (n, r) = (comm.size, comm.rank);
        let p2 = pow2_below(n);
        let rem = n - p2;
        let rounds = p2.trailing_zeros() as usize + 1;
        let max = max.max(8).next_multiple_of(FLAG_LINE);
        let d = comm.domain.clone();
        let rx = d.register(
            2 * (FLAG_LINE + max) * rounds,
            Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        )?;
        let mut keys = vec![None; rounds];
        let mut wins = vec![None; rounds];
        let mut partners = vec![None; rounds];
        if r < 2 * rem {
            partners[0] = Some(r ^ 1);
        }
        if r >= 2 * rem || r % 2 == 1 {
            let newrank = if r < 2 * rem { r / 2 } else { r - rem };
            for (j, p) in partners.iter_mut().enumerate().skip(1) {
                *p = Some(rd_partner(newrank, 1 << (j - 1), rem));
            }
        }
        for (j, p) in partners.into_iter().enumerate() {
            if let Some(p) = p {
                let key = swap_key(comm, &rx, p, p)?;
                if window {
                    wins[j] = map_window(comm, p, &key)?;
                }
                keys[j] = Some(key);
            }
        }
        Ok(PutRd {
            rx,
            atom: d.register(8 * PUTS_UNREAPED * 2, Access::empty())?,
            keys,
            wins,
            left: vec![0; 2 * rounds],
            rounds,
            max,
            seq: 0,
            adds: 0,
            drain_each: d.kind() != TransportKind::Shm,
            blk_a: vec![0u8; BLK],
            blk_b: vec![0u8; BLK],
        })
    }

    /// Operation `seq`'s flag word of `round`.
    fn flag(&self, round: usize, seq: u64) -> usize {
        FLAG_LINE * (2 * round + (seq % 2) as usize)
    }

    /// Operation `seq`'s slot of `round`.
    fn slot(&self, round: usize, seq: u64) -> usize {
        FLAG_LINE * 2 * self.rounds + (2 * round + (seq % 2) as usize) * self.max
    }
}

/// Waits until every put has completed (their sources may be reused).
fn drain_puts(comm: &mut Comm) -> Res<()> {
    let mut done = std::mem::take(&mut comm.done);
    let mut idle = Idle::new();
    let res = (|| -> Res<()> {
        while comm.puts_out > 0 {
            done.clear();
            if comm.poll(&mut done)? == 0 {
                idle.wait(comm, usize::MAX)?;
            } else {
                idle.progress();
            }
        }
        Ok(())
    })();
    done.clear();
    comm.done = done;
    res
}

/// Posts, retrying after taking completions while the connection is full.
fn post_retry(comm: &mut Comm, mut post: impl FnMut(&mut Comm) -> Res<Posted>) -> Res<()> {
    let mut idle = Idle::new();
    loop {
        if let Posted::Yes = post(comm)? {
            comm.puts_out += 1;
            return Ok(());
        }
        let n = comm.puts_out;
        drain_puts(comm)?;
        if n == 0 {
            idle.wait(comm, usize::MAX)?;
        }
    }
}

/// Puts `src[..bytes]` (or, for 4 bytes, the value `mine`, `src`'s content) into `peer`'s
/// round-`round` slot and flag for operation `pr.seq`.
fn put(
    comm: &mut Comm,
    pr: &mut PutRd,
    peer: usize,
    round: usize,
    (src, bytes, mine): (&fabric_core::Region, usize, u32),
) -> Res<()> {
    if let Some(win) = &pr.wins[round] {
        // Straight into the partner's memory: the vector into its slot, then the flag word
        // (a release store: the partner that sees the word finds the bytes).
        if bytes != 4 {
            copy_to_window(win, pr.slot(round, pr.seq), src, bytes, &mut pr.blk_a)?;
        }
        let word = ((pr.seq as u32 as u64) << 32) | u64::from(mine);
        win.store_u64(pr.flag(round, pr.seq), word)?;
        pr.left[2 * round + (pr.seq % 2) as usize] = word;
        return Ok(());
    }
    let key = pr.keys[round].ok_or("no key for this round's partner")?;
    let payload = if bytes == 4 {
        mine
    } else {
        let off = pr.slot(round, pr.seq) as u64;
        post_retry(comm, |c| {
            c.write(peer, src.slice(0, bytes)?, &key, off, PUT)
        })?;
        0
    };
    let word = ((pr.seq as u32 as u64) << 32) | u64::from(payload);
    let f = 2 * round + (pr.seq % 2) as usize;
    let add = word.wrapping_sub(pr.left[f]);
    pr.left[f] = word;
    let k = (pr.adds % (2 * PUTS_UNREAPED) as u64) as usize;
    pr.adds += 1;
    let off = pr.flag(round, pr.seq) as u64;
    let atom = &pr.atom;
    post_retry(comm, |c| {
        c.atomic(peer, atom.slice(8 * k, 8)?, &key, off, add)
    })
}

/// Copies `src[..bytes]` into the window at `off`: straight from the region's bytes when it
/// lends them (memory no peer may write: the caller's input), else through `blk`.
fn copy_to_window(
    win: &RemoteWindow,
    off: usize,
    src: &fabric_core::Region,
    bytes: usize,
    blk: &mut [u8],
) -> Res<()> {
    if src.is_lendable() {
        if let Ok(b) = src.bytes() {
            win.write_at(off, &b[..bytes])?;
            return Ok(());
        }
    }
    let mut o = 0;
    while o < bytes {
        let k = (bytes - o).min(blk.len());
        src.read_at(o, &mut blk[..k])?;
        win.write_at(off + o, &blk[..k])?;
        o += k;
    }
    Ok(())
}

/// `peer`'s region of `key` mapped into this process, or `None` where the transport does
/// not map peers' memory. The region's announcement travels on its own path: poll while
/// it has not arrived.
fn map_window(comm: &mut Comm, peer: usize, key: &RemoteKey) -> Res<Option<RemoteWindow>> {
    let ep = comm.ep(peer)?;
    let end = Instant::now() + Duration::from_secs(30);
    let mut done = Vec::new();
    loop {
        match comm.worker.endpoint(ep)?.map_remote(key) {
            Ok(w) => return Ok(Some(w)),
            Err(fabric_core::Error::Unsupported { .. }) => return Ok(None),
            Err(fabric_core::Error::RemoteKey(why)) if Instant::now() < end => {
                comm.poll(&mut done)?;
                if !done.is_empty() {
                    return Err(format!("unexpected completion while mapping: {why}").into());
                }
                std::thread::yield_now();
            }
            Err(e) => return Err(format!("mapping rank {peer}'s slots: {e}").into()),
        }
    }
}

/// Waits for the round-`round` flag of the current operation; returns its payload.
#[inline(never)]
fn put_wait(comm: &mut Comm, pr: &PutRd, round: usize, peer: usize) -> Res<u32> {
    let off = pr.flag(round, pr.seq);
    let want = pr.seq as u32;
    // Spin (the partner is running on a CPU of its own), unless ranks share CPUs.
    let spins = if comm.oversubscribed { 0 } else { 2048 };
    for _ in 0..spins {
        let w = pr.rx.load_u64(off)?;
        if (w >> 32) as u32 == want {
            return Ok(w as u32);
        }
        std::hint::spin_loop();
    }
    // Longer: poll (a failed peer, the completions of our puts) and back off.
    let mut done = std::mem::take(&mut comm.done);
    let mut idle = Idle::new();
    let res = loop {
        let w = pr.rx.load_u64(off)?;
        if (w >> 32) as u32 == want {
            break Ok(w as u32);
        }
        done.clear();
        if let Err(e) = comm.poll(&mut done) {
            break Err(e);
        }
        if let Err(e) = idle.wait(comm, peer) {
            break Err(e);
        }
    };
    done.clear();
    comm.done = done;
    res
}

/// `out = src + what the partner put` (the payload itself for 4 bytes, else its slot);
/// returns the 4-byte sum's bits (`mine` is `src`'s content then).
fn put_sum(
    pr: &mut PutRd,
    round: usize,
    payload: u32,
    (src, bytes, mine): (&fabric_core::Region, usize, u32),
    out: &fabric_core::Region,
) -> Res<u32> {
    if bytes == 4 {
        let s = f32::from_bits(mine) + f32::from_bits(payload);
        out.write_at(0, &s.to_ne_bytes())?;
        return Ok(s.to_bits());
    }
    let slot = pr.slot(round, pr.seq);
    let mut o = 0;
    while o < bytes {
        let k = (bytes - o).min(BLK);
        pr.rx.read_at(slot + o, &mut pr.blk_a[..k])?;
        src.read_at(o, &mut pr.blk_b[..k])?;
        add_f32(&mut pr.blk_a[..k], &pr.blk_b[..k]);
        out.write_at(o, &pr.blk_a[..k])?;
        o += k;
    }
    Ok(0)
}

/// Recursive doubling by puts (see [`PutRd`]); the rank pairing is [`allreduce_rd`]'s.
fn allreduce_put(comm: &mut Comm, pr: &mut PutRd, b: &Bufs<'_>) -> Res<()> {
    let (n, r, bytes) = (comm.size, comm.rank, b.bytes);
    if n == 1 {
        let mut blk = std::mem::take(&mut comm.blk);
        let res = copy_region(&mut blk, b.out, b.send, bytes);
        comm.blk = blk;
        return res;
    }
    pr.seq += 1;
    let p2 = pow2_below(n);
    let rem = n - p2;
    // With more than one round (or a fold), `out` is a put's source and then summed
    // into: its puts must have completed first.
    let reuse = n > 2;
    let mut have_out = false;
    // A 4-byte vector's running value (read once; it travels in the flag words).
    let mut mine = 0;
    if bytes == 4 {
        let mut v = [0u8; 4];
        b.send.read_at(0, &mut v)?;
        mine = u32::from_ne_bytes(v);
    }
    let newrank = if r < 2 * rem {
        if r % 2 == 0 {
            // Folded out: hand the vector over, get the result back in our slot.
            put(comm, pr, r + 1, 0, (b.send, bytes, mine))?;
            let v = put_wait(comm, pr, 0, r + 1)?;
            if bytes == 4 {
                b.out.write_at(0, &v.to_ne_bytes())?;
            } else {
                let slot = pr.slot(0, pr.seq);
                let mut o = 0;
                while o < bytes {
                    let k = (bytes - o).min(BLK);
                    pr.rx.read_at(slot + o, &mut pr.blk_a[..k])?;
                    b.out.write_at(o, &pr.blk_a[..k])?;
                    o += k;
                }
            }
            return finish_put(comm, pr);
        }
        let v = put_wait(comm, pr, 0, r - 1)?;
        if reuse {
            drain_puts(comm)?;
        }
        mine = put_sum(pr, 0, v, (b.send, bytes, mine), b.out)?;
        have_out = true;
        r / 2
    } else {
        r - rem
    };
    for j in 1..pr.rounds {
        let partner = rd_partner(newrank, 1 << (j - 1), rem);
        let src = if have_out { b.out } else { b.send };
        put(comm, pr, partner, j, (src, bytes, mine))?;
        let v = put_wait(comm, pr, j, partner)?;
        if reuse {
            drain_puts(comm)?;
        }
        mine = put_sum(pr, j, v, (src, bytes, mine), b.out)?;
        have_out = true;
    }
    if r < 2 * rem {
        put(comm, pr, r - 1, 0, (b.out, bytes, mine))?;
    }
    finish_put(comm, pr)
}

/// Takes the puts' completions now and then (every operation where a put may still be
/// reading its source when the post returns).
fn finish_put(comm: &mut Comm, pr: &PutRd) -> Res<()> {
    if pr.drain_each || comm.puts_out >= PUTS_UNREAPED {
        drain_puts(comm)?;
    }
    Ok(())
}

fn copy_region(
    blk: &mut [u8],
    dst: &fabric_core::Region,
    src: &fabric_core::Region,
    bytes: usize,
) -> Res<()> {
    let mut o = 0;
    while o < bytes {
        let k = (bytes - o).min(blk.len());
        src.read_at(o, &mut blk[..k])?;
        dst.write_at(o, &blk[..k])?;
        o += k;
    }
    Ok(())
}

/// Most operations of one direction posted on a connection at once.
const WINDOW: usize = 64;

/// Pipelined ring: reduce-scatter (steps `0..N-1`), then all-gather (steps
/// `N-1..2(N-1)`). At step `st`, this rank sends one segment to its right neighbour and
/// receives one from its left, chunk by chunk; the chunk `c` it receives at step `st` is
/// the chunk `c` it sends at step `st + 1` (after adding its own input during the
/// reduce-scatter). Every rank posts in the same order (step-major), so the connections'
/// post-order delivery matches sends to receives without tags.
fn allreduce_ring(comm: &mut Comm, b: &Bufs<'_>) -> Res<()> {
    let (n, r) = (comm.size, comm.rank);
    if n == 1 {
        let mut blk = std::mem::take(&mut comm.blk);
        let res = copy_region(&mut blk, b.out, b.send, b.bytes);
        comm.blk = blk;
        return res;
    }
    let count = b.bytes / 4;
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let ce = (b.chunk.min(b.slots[0].len()) / 4).max(1); // elements per chunk
    let group = (b.slots.len() / 2).max(1);
    let steps = 2 * (n - 1);
    let rs_steps = n - 1;
    let seg = |q: usize| (q * count / n, (q + 1) * count / n);
    // Segment sent / received at step `st` (reduce-scatter, then all-gather).
    let send_seg = |st: usize| {
        if st < rs_steps {
            (r + n - st) % n
        } else {
            (r + 1 + n - (st - rs_steps)) % n
        }
    };
    let recv_seg = |st: usize| {
        if st < rs_steps {
            (r + 2 * n - st - 1) % n
        } else {
            (r + n - (st - rs_steps)) % n
        }
    };
    // Element range of chunk c of segment q (empty past the segment's end).
    let chunk = |q: usize, c: usize| {
        let (a, e) = seg(q);
        let s = (a + c * ce).min(e);
        (s, (s + ce).min(e))
    };
    let cmax = (0..n)
        .map(|q| (seg(q).1 - seg(q).0).div_ceil(ce))
        .max()
        .unwrap_or(0);
    // The one order every rank follows: groups of `group` chunks, step-major within a
    // group. A receive at (st, c) uses slot (st % 2, c % group), last used by an earlier
    // item of the order, so every wait points to an earlier item: no cycle around the
    // ring, with bounded scratch.
    let mut send_list = Vec::with_capacity(steps * cmax);
    let mut recv_list = Vec::with_capacity(steps * cmax);
    for g0 in (0..cmax).step_by(group) {
        for st in 0..steps {
            for c in g0..(g0 + group).min(cmax) {
                let (a, e) = chunk(send_seg(st), c);
                if e > a {
                    send_list.push((st, c));
                }
                let (a, e) = chunk(recv_seg(st), c);
                if e > a {
                    recv_list.push((st, c));
                }
            }
        }
    }
    let slot_of = |st: usize, c: usize| (st % 2) * group + c % group;
    let one_sided = b.right_out.is_some();
    // On shm, the first all-gather send goes from the slot the last reduction wrote (as
    // well as the output): fabric-core memory is sent by rendezvous, one copy, where the
    // caller's output would take the eager path's two.
    let fwd_slot = comm.domain.kind() == TransportKind::Shm && !one_sided;
    // Whether the send at step `st` goes from a slot (that of the receive at `st - 1`).
    let from_slot = |st: usize| st >= 1 && (st < rs_steps || (fwd_slot && st == rs_steps));
    let mut ready: Vec<Vec<bool>> = (0..steps).map(|st| vec![st == 0; cmax]).collect();
    let mut slot_busy = vec![false; 2 * group];
    let notices = if one_sided {
        // Notices: one buffer to send from (content unused), one to receive into.
        Some((
            comm.domain.register(8 * WINDOW, Access::empty())?,
            comm.domain.register(8 * WINDOW, Access::empty())?,
        ))
    } else {
        None
    };
    let ag_sends = send_list.iter().filter(|(st, _)| *st >= rs_steps).count();
    let sends_total = send_list.len() + if one_sided { ag_sends } else { 0 };
    let (mut si, mut ri) = (0usize, 0usize); // next send / receive in the lists
    let (mut sends_done, mut recvs_done) = (0usize, 0usize);
    let (mut sends_out, mut recvs_out) = (0usize, 0usize);
    let mut done = Vec::with_capacity(2 * WINDOW);
    let mut blk = std::mem::take(&mut comm.blk);
    let mut idle = Idle::new();
    let res = (|| -> Res<()> {
        while sends_done < sends_total || recvs_done < recv_list.len() {
            let mut moved = false;
            // Receives, in order.
            while ri < recv_list.len() && recvs_out < WINDOW {
                let (st, c) = recv_list[ri];
                let (a, e) = chunk(recv_seg(st), c);
                let len = (e - a) * 4;
                let buf = if st < rs_steps {
                    let k = slot_of(st, c);
                    if slot_busy[k] {
                        break;
                    }
                    b.slots[k].slice(0, len)?
                } else if let Some((_, nb)) = &notices {
                    nb.slice(8 * (ri % WINDOW), 8)?
                } else {
                    b.out.slice(a * 4, len)?
                };
                if let Posted::Full(_) = comm.recv(left, buf, wr(RECV, st, c))? {
                    break;
                }
                if st < rs_steps {
                    slot_busy[slot_of(st, c)] = true;
                }
                recvs_out += 1;
                ri += 1;
                moved = true;
            }
            // Sends, in order, once ready.
            while si < send_list.len() && sends_out + 2 <= WINDOW {
                let (st, c) = send_list[si];
                if !ready[st][c] {
                    break;
                }
                let (a, e) = chunk(send_seg(st), c);
                let len = (e - a) * 4;
                let buf = if st == 0 {
                    b.send.slice(a * 4, len)?
                } else if from_slot(st) {
                    b.slots[slot_of(st - 1, c)].slice(0, len)?
                } else {
                    b.out.slice(a * 4, len)?
                };
                match (&b.right_out, &notices) {
                    (Some(key), Some((nb, _))) if st >= rs_steps => {
                        let w = comm.write(right, buf, key, (a * 4) as u64, wr(WRITE, st, c))?;
                        if let Posted::Full(_) = w {
                            break;
                        }
                        // The notice follows the write (post order); a refused notice is
                        // retried while polling.
                        let mut nbuf = Some(nb.slice(8 * (si % WINDOW), 8)?);
                        while let Some(x) = nbuf.take() {
                            if let Posted::Full(x) = comm.send(right, x, wr(0, st, c))? {
                                nbuf = Some(x);
                                comm.poll(&mut done)?;
                            }
                        }
                        sends_out += 2;
                    }
                    _ => {
                        if let Posted::Full(_) = comm.send(right, buf, wr(0, st, c))? {
                            break;
                        }
                        sends_out += 1;
                    }
                }
                si += 1;
                moved = true;
            }
            // Completions.
            comm.poll(&mut done)?;
            if !done.is_empty() {
                moved = true;
            }
            for d in done.drain(..) {
                let (kind, st, c) = unwr(d.wr_id);
                if kind & RECV == 0 {
                    sends_out -= 1;
                    sends_done += 1;
                    if from_slot(st) {
                        slot_busy[slot_of(st - 1, c)] = false;
                    }
                    continue;
                }
                recvs_out -= 1;
                recvs_done += 1;
                let (a, e) = chunk(recv_seg(st), c);
                let len = (e - a) * 4;
                let want = if st >= rs_steps && one_sided { 8 } else { len };
                if d.len != want {
                    return Err(format!(
                        "rank {left} sent {} bytes at step {st} chunk {c}, expected {want}",
                        d.len
                    )
                    .into());
                }
                if st < rs_steps {
                    let k = slot_of(st, c);
                    let slot = &b.slots[k];
                    if st + 1 < rs_steps {
                        // A partial sum, in the slot: sent from there at the next step.
                        let mut m = slot.bytes_mut()?;
                        let mut o = 0;
                        while o < len {
                            let kk = (len - o).min(blk.len());
                            b.send.read_at(a * 4 + o, &mut blk[..kk])?;
                            add_f32(&mut m[o..o + kk], &blk[..kk]);
                            o += kk;
                        }
                    } else if fwd_slot {
                        // This rank's finished segment: in the slot (sent from there next)
                        // and in the output.
                        let mut m = slot.bytes_mut()?;
                        let mut o = 0;
                        while o < len {
                            let kk = (len - o).min(blk.len());
                            b.send.read_at(a * 4 + o, &mut blk[..kk])?;
                            add_f32(&mut m[o..o + kk], &blk[..kk]);
                            b.out.write_at(a * 4 + o, &m[o..o + kk])?;
                            o += kk;
                        }
                    } else {
                        // This rank's finished segment goes to the output.
                        let t = slot.bytes()?;
                        sum_to(&mut blk, b.out, a * 4, b.send, a * 4, &t[..len])?;
                        drop(t);
                        slot_busy[k] = false;
                    }
                }
                if st + 1 < steps {
                    ready[st + 1][c] = true;
                }
            }
            if moved {
                idle.progress();
            } else {
                idle.wait(comm, left)?;
            }
        }
        Ok(())
    })();
    comm.blk = blk;
    res
}

// ---------------------------------------------------------------------------------------
// The ring with a one-sided reduce-scatter.

/// What the write-based ring keeps between operations: this rank's receive slots (the left
/// neighbour writes into them), its credit word (the right neighbour writes into it how many
/// of our writes it has finished with), the neighbours' keys, and running counts that both
/// ends of a connection advance in the same order (so nothing is reset between operations
/// and a late credit can never be mistaken for a new one).
#[derive(Debug)]
struct WriteRing {
    /// `slots` receive slots of `chunk` bytes, remotely writable by the left neighbour.
    rx: fabric_core::Region,
    /// One 8-byte word, remotely writable by the right neighbour: how many of the
    /// reduce-scatter chunks we wrote to it (counted from the first operation) it has
    /// finished with.
    credit: fabric_core::Region,
    /// Sources of our credit writes (one 8-byte word per write in flight).
    credit_src: fabric_core::Region,
    /// The notices that follow each write (content unused) and their receive buffers.
    notice_tx: fabric_core::Region,
    notice_rx: fabric_core::Region,
    right_rx: RemoteKey,
    left_credit: RemoteKey,
    slots: usize,
    chunk: usize,
    /// Per slot of the right neighbour: 1 + the number of the last reduce-scatter chunk we
    /// wrote into it (0: never used). The slot is free again once the neighbour's credit
    /// reaches that value.
    last_use: Vec<u64>,
    /// Reduce-scatter chunks written to the right neighbour so far (all operations).
    sent: u64,
    /// Reduce-scatter chunks received from the left neighbour so far.
    received: u64,
    /// Of those, how many (from the first) we finished with; `credited` of them were told.
    freed: u64,
    credited: u64,
    /// Credit writes posted so far (picks the source word of the next).
    credit_posts: u64,
    /// Reduce blocks (cache-sized).
    blk_a: Vec<u8>,
    blk_b: Vec<u8>,
}

/// Credit writes in flight at most.
const CREDIT_WINDOW: usize = 16;

impl WriteRing {
    /// Registers this rank's slots and credit word and swaps keys with both neighbours.
    fn setup(comm: &mut Comm, chunk: usize, slots: usize) -> Res<Self> {
        let (n, r) = (comm.size, comm.rank);
        let (left, right) = ((r + n - 1) % n, (r + 1) % n);
        let d = comm.domain.clone();
        let rx = d.register(chunk * slots, Access::REMOTE_WRITE)?;
        let credit = d.register(8, Access::REMOTE_WRITE)?;
        // Our slots' key goes left (the left neighbour writes into them); our credit
        // word's key goes right (the right neighbour tells us through it).
        let right_rx = swap_key(comm, &rx, left, right)?;
        let left_credit = swap_key(comm, &credit, right, left)?;
        Ok(WriteRing {
            rx,
            credit,
            credit_src: d.register(8 * CREDIT_WINDOW, Access::empty())?,
            notice_tx: d.register(8 * WINDOW, Access::empty())?,
            notice_rx: d.register(8 * WINDOW, Access::empty())?,
            right_rx,
            left_credit,
            slots,
            chunk,
            last_use: vec![0; slots],
            sent: 0,
            received: 0,
            freed: 0,
            credited: 0,
            credit_posts: 0,
            blk_a: vec![0u8; BLK],
            blk_b: vec![0u8; BLK],
        })
    }
}

/// Sends our key of `region` to rank `to`; returns the key rank `from` sent us.
fn swap_key(
    comm: &mut Comm,
    region: &fabric_core::Region,
    to: usize,
    from: usize,
) -> Res<RemoteKey> {
    let key = region
        .remote_key()
        .ok_or("a remotely writable region has no remote key")?;
    let d = comm.domain.clone();
    let mine = d.register(RemoteKey::PACKED_LEN, Access::empty())?;
    mine.write_at(0, &key.pack())?;
    let theirs = d.register(RemoteKey::PACKED_LEN, Access::empty())?;
    exchange(comm, to, from, &mine, &theirs, RemoteKey::PACKED_LEN)?;
    let mut k = [0u8; RemoteKey::PACKED_LEN];
    theirs.read_at(0, &mut k)?;
    Ok(RemoteKey::decode(&k)?)
}

/// How many of the write ring's `slots` an operation whose segments have `cmax` chunks
/// uses (the first ones): half of them when `2 <= cmax < 2 × slots` and there are at
/// least 4, else all. (Not alternating halves between operations: back-to-back operations
/// would then touch all the slots again. One-chunk operations keep all: rotating over
/// half took 5–10 % longer at 1 MiB, 2 ranks, in 5 of 6 interleaved rounds.)
fn op_slots(slots: usize, cmax: usize) -> usize {
    if slots >= 4 && (2..2 * slots).contains(&cmax) {
        slots / 2
    } else {
        slots
    }
}

/// The ring of [`allreduce_ring`] with the reduce-scatter done by one-sided writes: at
/// every reduce-scatter step a rank writes its chunk (its own input at the first step, the
/// partial sum it reduced in place in a receive slot after that) straight into a receive
/// slot of the right neighbour (`post_write`: one copy, whatever the source memory), then
/// sends an 8-byte notice (connections deliver in post order, so the notice's arrival means
/// the bytes are there). The receiver adds its input to the slot; the last reduce-scatter
/// step writes the finished segment into the output and keeps it in the slot, from which
/// the first all-gather step sends it (on shm a slot is fabric-core memory: by rendezvous,
/// one copy into the neighbour's output). Later all-gather steps (N > 2) forward from the
/// output as [`allreduce_ring`] does.
///
/// Slots per operation: an operation with 2 to `2 S - 1` chunks per segment uses only the
/// first half of the `S` slots (with `S >= 4`): its working set then stays in cache
/// (2 ranks, 512 KiB chunks, 8 slots: 4 MiB took 326–361 µs on 4 slots against 451–544 on
/// 8; from 16 MiB up, 8 slots are faster). Both ends of a connection compute the same slot
/// for every chunk (the operation's size and rank count are theirs alike).
///
/// Flow control: reduce-scatter chunk number `g` (counted over all operations) goes into
/// slot `g % A` (`A` the operation's slots: consecutive small operations rotate over
/// them); a rank writes it only once the right neighbour's credit word says it finished
/// with the chunk last written into that slot. A receiver finishes with a chunk when its
/// slot's last use (the forward write or the all-gather send from it) completed, and then
/// writes the count of chunks finished in order into the left neighbour's credit word.
/// With groups of `A / 2` chunks every wait points to an earlier chunk of the one order all
/// ranks follow, so there is no cycle around the ring.
fn allreduce_ring_w(comm: &mut Comm, b: &Bufs<'_>) -> Res<()> {
    let mut w = comm.wring.take().ok_or("write ring not set up")?;
    let res = ring_w(comm, &mut w, b);
    comm.wring = Some(w);
    res
}

fn ring_w(comm: &mut Comm, w: &mut WriteRing, b: &Bufs<'_>) -> Res<()> {
    let (n, r) = (comm.size, comm.rank);
    let count = b.bytes / 4;
    let right = (r + 1) % n;
    let left = (r + n - 1) % n;
    let ce = w.chunk / 4;
    let steps = 2 * (n - 1);
    let rs_steps = n - 1;
    let seg = |q: usize| (q * count / n, (q + 1) * count / n);
    let send_seg = |st: usize| {
        if st < rs_steps {
            (r + n - st) % n
        } else {
            (r + 1 + n - (st - rs_steps)) % n
        }
    };
    let recv_seg = |st: usize| {
        if st < rs_steps {
            (r + 2 * n - st - 1) % n
        } else {
            (r + n - (st - rs_steps)) % n
        }
    };
    let chunk = |q: usize, c: usize| {
        let (a, e) = seg(q);
        let s = (a + c * ce).min(e);
        (s, (s + ce).min(e))
    };
    let cmax = (0..n)
        .map(|q| (seg(q).1 - seg(q).0).div_ceil(ce))
        .max()
        .unwrap_or(0);
    let act = op_slots(w.slots, cmax);
    let group = (act / 2).max(1);
    // The one order every rank follows (as in `allreduce_ring`). Sends: (step, chunk,
    // reduce-scatter chunk number within this operation, or usize::MAX in the
    // all-gather); receives: (step, chunk). `rs_item[st * cmax + c]`: the number of the
    // reduce-scatter chunk (st, c) this rank receives.
    let mut rs_item = vec![usize::MAX; rs_steps * cmax];
    let mut send_list = Vec::with_capacity(steps * cmax);
    let mut recv_list = Vec::with_capacity(steps * cmax);
    let (mut ns, mut nr) = (0usize, 0usize);
    for g0 in (0..cmax).step_by(group) {
        for st in 0..steps {
            for c in g0..(g0 + group).min(cmax) {
                let (a, e) = chunk(send_seg(st), c);
                if e > a {
                    let k = if st < rs_steps { ns } else { usize::MAX };
                    ns += usize::from(st < rs_steps);
                    send_list.push((st, c, k));
                }
                let (a, e) = chunk(recv_seg(st), c);
                if e > a {
                    if st < rs_steps {
                        rs_item[st * cmax + c] = nr;
                        nr += 1;
                    }
                    recv_list.push((st, c));
                }
            }
        }
    }
    let one_sided = b.right_out.is_some();
    let (sent0, recv0) = (w.sent, w.received);
    // Where the chunk (st, c) received during the reduce-scatter sits: its slot.
    let at_slot =
        |st: usize, c: usize| ((recv0 + rs_item[st * cmax + c] as u64) % act as u64) as usize;
    let mut ready: Vec<Vec<bool>> = (0..steps).map(|st| vec![st == 0; cmax]).collect();
    // Chunks received this operation that we finished with (by number within it).
    let mut finished = vec![false; nr];
    let sends_total = send_list.len()
        + send_list
            .iter()
            .filter(|(st, _, _)| *st < rs_steps || one_sided)
            .count();
    let (mut si, mut ri) = (0usize, 0usize);
    let (mut sends_done, mut recvs_done) = (0usize, 0usize);
    let (mut sends_out, mut recvs_out) = (0usize, 0usize);
    let mut done = std::mem::take(&mut comm.done);
    let mut idle = Idle::new();
    let res = (|| -> Res<()> {
        loop {
            // Tell the left neighbour how far we got (the newest count only).
            let mut f = w.freed - recv0;
            while (f as usize) < nr && finished[f as usize] {
                f += 1;
            }
            w.freed = recv0 + f;
            // At most CREDIT_WINDOW writes in flight, each from a word of its own; a credit
            // not posted now goes with a later one (the count only grows). The operation
            // does not wait for credit writes to complete: on tcp their acknowledgements
            // can queue behind the neighbour's next message, for which no receive is posted
            // until the next operation (poll() counts them down whenever they come).
            if w.freed > w.credited && comm.credits_out < CREDIT_WINDOW {
                let k = (w.credit_posts % CREDIT_WINDOW as u64) as usize;
                w.credit_src.store_u64(8 * k, w.freed)?;
                let src = w.credit_src.slice(8 * k, 8)?;
                if let Posted::Yes = comm.write(left, src, &w.left_credit, 0, CREDIT)? {
                    w.credited = w.freed;
                    w.credit_posts += 1;
                    comm.credits_out += 1;
                }
            }
            if sends_done == sends_total && recvs_done == recv_list.len() {
                break;
            }
            let mut moved = false;
            // Receives (notices during the reduce-scatter, data after), in order.
            while ri < recv_list.len() && recvs_out < WINDOW {
                let (st, c) = recv_list[ri];
                let buf = if st < rs_steps || one_sided {
                    w.notice_rx.slice(8 * (ri % WINDOW), 8)?
                } else {
                    let (a, e) = chunk(recv_seg(st), c);
                    b.out.slice(a * 4, (e - a) * 4)?
                };
                if let Posted::Full(_) = comm.recv(left, buf, wr(RECV, st, c))? {
                    break;
                }
                recvs_out += 1;
                ri += 1;
                moved = true;
            }
            // Sends, in order, once ready and (reduce-scatter) credited.
            while si < send_list.len() && sends_out + 2 <= WINDOW {
                let (st, c, k) = send_list[si];
                if !ready[st][c] {
                    break;
                }
                let (a, e) = chunk(send_seg(st), c);
                let len = (e - a) * 4;
                if st < rs_steps {
                    let g = sent0 + k as u64;
                    let slot = (g % act as u64) as usize;
                    if w.credit.load_u64(0)? < w.last_use[slot] {
                        break;
                    }
                    let src = if st == 0 {
                        b.send.slice(a * 4, len)?
                    } else {
                        let s = at_slot(st - 1, c);
                        w.rx.slice(s * w.chunk, len)?
                    };
                    let off = (slot * w.chunk) as u64;
                    if let Posted::Full(_) =
                        comm.write(right, src, &w.right_rx, off, wr(WRITE, st, c))?
                    {
                        break;
                    }
                    w.last_use[slot] = g + 1;
                    w.sent += 1;
                } else if one_sided {
                    let src = b.out.slice(a * 4, len)?;
                    let key = b.right_out.as_ref().ok_or("no key")?;
                    if let Posted::Full(_) =
                        comm.write(right, src, key, (a * 4) as u64, wr(WRITE, st, c))?
                    {
                        break;
                    }
                } else {
                    let src = if st == rs_steps {
                        let s = at_slot(st - 1, c);
                        w.rx.slice(s * w.chunk, len)?
                    } else {
                        b.out.slice(a * 4, len)?
                    };
                    if let Posted::Full(_) = comm.send(right, src, wr(0, st, c))? {
                        break;
                    }
                    sends_out += 1;
                    si += 1;
                    moved = true;
                    continue;
                }
                // The notice follows the write (post order); a refused notice is retried
                // while polling.
                let mut nbuf = Some(w.notice_tx.slice(8 * (si % WINDOW), 8)?);
                while let Some(x) = nbuf.take() {
                    if let Posted::Full(x) = comm.send(right, x, wr(NOTICE, st, c))? {
                        nbuf = Some(x);
                        comm.poll(&mut done)?;
                    }
                }
                sends_out += 2;
                si += 1;
                moved = true;
            }
            comm.poll(&mut done)?;
            if !done.is_empty() {
                moved = true;
            }
            for d in done.drain(..) {
                let (kind, st, c) = unwr(d.wr_id);
                if kind & RECV == 0 {
                    sends_out -= 1;
                    sends_done += 1;
                    // The last use of a slot: the forward write (reduce-scatter) or the
                    // first all-gather send.
                    let fwd = kind & WRITE != 0 && st >= 1 && st < rs_steps;
                    let ag = kind & (WRITE | NOTICE) == 0 && st == rs_steps;
                    if fwd || ag {
                        finished[rs_item[(st - 1) * cmax + c]] = true;
                    }
                    continue;
                }
                recvs_out -= 1;
                recvs_done += 1;
                let (a, e) = chunk(recv_seg(st), c);
                let len = (e - a) * 4;
                let want = if st < rs_steps || one_sided { 8 } else { len };
                if d.len != want {
                    return Err(format!(
                        "rank {left} sent {} bytes at step {st} chunk {c}, expected {want}",
                        d.len
                    )
                    .into());
                }
                if st < rs_steps {
                    let k = rs_item[st * cmax + c];
                    w.received += 1;
                    let s = at_slot(st, c);
                    let last = st + 1 == rs_steps;
                    // The input is borrowed in place when no write from it is in flight
                    // (then a slice of it would make the borrow Busy); else copied.
                    let input = b.send.bytes().ok();
                    let mut o = 0;
                    while o < len {
                        let kk = (len - o).min(BLK);
                        w.rx.read_at(s * w.chunk + o, &mut w.blk_a[..kk])?;
                        let at = a * 4 + o;
                        match &input {
                            Some(g) => add_f32(&mut w.blk_a[..kk], &g[at..at + kk]),
                            None => {
                                b.send.read_at(at, &mut w.blk_b[..kk])?;
                                add_f32(&mut w.blk_a[..kk], &w.blk_b[..kk]);
                            }
                        }
                        if last {
                            b.out.write_at(a * 4 + o, &w.blk_a[..kk])?;
                        }
                        // Kept in the slot for the next send from it (a forward write, or
                        // the all-gather's first send).
                        if !last || !one_sided {
                            w.rx.write_at(s * w.chunk + o, &w.blk_a[..kk])?;
                        }
                        o += kk;
                    }
                    if last && one_sided {
                        finished[k] = true;
                    }
                }
                if st + 1 < steps {
                    ready[st + 1][c] = true;
                }
            }
            if moved {
                idle.progress();
            } else {
                // Both neighbours have work in flight with us (the right one: our sends'
                // completions); the wait keeps the left one active.
                if right != left {
                    Idle::keep_active(comm, right)?;
                }
                idle.wait(comm, left)?;
            }
        }
        Ok(())
    })();
    comm.done = done;
    res
}

fn allreduce(comm: &mut Comm, algo: Algo, b: &Bufs<'_>) -> Res<()> {
    match algo {
        Algo::Rd => allreduce_rd(comm, b),
        Algo::Ring if comm.wring.is_some() => allreduce_ring_w(comm, b),
        Algo::Ring => allreduce_ring(comm, b),
    }
}

// ---------------------------------------------------------------------------------------
// The benchmark.

/// This rank's input element `i` in `round` (0: the timed operations, 1: the checked one);
/// small integers: every sum is exact in f32.
fn input(rank: usize, i: usize, round: usize) -> f32 {
    ((i % 997) + 3 * rank + 1 + 2 * round) as f32
}

fn expected(n: usize, i: usize, round: usize) -> f32 {
    (n * (i % 997) + 3 * n * (n - 1) / 2 + n + 2 * n * round) as f32
}

/// Rewrites this rank's input for `round` in place (1 MiB at a time), with `--inject-error`'s
/// wrong element where it was.
fn write_input(send: &fabric_core::Region, rank: usize, round: usize, wrong: bool) -> Res<()> {
    let count = send.len() / 4;
    let mut buf = Vec::with_capacity((1 << 20).min(send.len()));
    let mut i = 0;
    while i < count {
        buf.clear();
        let end = (i + (1 << 18)).min(count);
        for j in i..end {
            let v = input(rank, j, round) + if wrong && j == count / 2 { 1.0 } else { 0.0 };
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        send.write_at(i * 4, &buf)?;
        i = end;
    }
    Ok(())
}

/// The last-level (L3) cache's size in bytes, from sysfs (`None` where it says none).
///
/// Why the all-gather's receives stream from half of it (2 ranks, shm, write ring, near runs,
/// µs): 4 MiB 441–488 streaming against 520–732 not, 8 MiB 1,311–1,561 against 1,535–1,724,
/// 32 MiB 6,562–7,161 against 8,232–8,754 — and 1 MiB 98–121 against 74–124, 2 MiB 188–242
/// against 144–213, where the ranks' buffers fit this host's 32 MiB L3 (BENCHMARKS, "the
/// all-gather's output streams").
fn l3_bytes() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let level = std::fs::read_to_string(e.path().join("level")).ok()?;
        if level.trim() != "3" {
            return None;
        }
        let size = std::fs::read_to_string(e.path().join("size")).ok()?;
        let size = size.trim();
        let (num, mult) = match size.as_bytes().last()? {
            b'K' => (&size[..size.len() - 1], 1 << 10),
            b'M' => (&size[..size.len() - 1], 1 << 20),
            b'G' => (&size[..size.len() - 1], 1 << 30),
            _ => (size, 1),
        };
        num.parse::<usize>()
            .ok()
            .map(|v| v * mult)
            .filter(|&b| b > 0)
    })
}

/// The send ring's chunk for a vector of `bytes` on `n` ranks: a whole segment of up to
/// 1 MiB where segments are at most 2 MiB (one or two chunks per step), 256 KiB chunks for
/// larger segments. Over tcp, 2 ranks, the kernel's copies are the work and a chunk boundary
/// is one more round of `sendmsg` / `read` and waiting: 1 MiB chunks took 377–391 µs at 2 MiB
/// against 447–466 for 256 KiB chunks, and 1,073–1,175 against 1,196–1,642 at 4 MiB; from
/// 16 MiB the pipeline of 256 KiB chunks wins (5.7 ms against 6.7 at 16 MiB; BENCHMARKS,
/// "the send ring's chunk per size").
fn send_ring_chunk(bytes: usize, n: usize) -> usize {
    let seg = bytes.div_ceil(n.max(1)).div_ceil(4) * 4;
    if seg <= SEND_WHOLE_SEGMENTS_UP_TO {
        seg.clamp(4, SEND_CHUNK_MAX)
    } else {
        SEND_PIPELINE_CHUNK
    }
}

/// `send_ring_chunk`'s rule: segments up to this size go whole, in chunks of at most
/// `SEND_CHUNK_MAX`; larger ones in `SEND_PIPELINE_CHUNK` chunks.
const SEND_WHOLE_SEGMENTS_UP_TO: usize = 2 << 20;
const SEND_CHUNK_MAX: usize = 1 << 20;
const SEND_PIPELINE_CHUNK: usize = 256 << 10;

fn default_iters(bytes: usize) -> usize {
    ((1usize << 30) / bytes.max(1)).clamp(5, 10_000)
}

fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(4).next_power_of_two();
    while s <= max {
        v.push(s);
        s *= 2;
    }
    v
}

/// CPUs this process may run on (1 when that cannot be read).
fn usable_cpus() -> usize {
    fabric_core::sys::allowed_cpus().map_or(1, |c| c.len().max(1))
}

/// Runs every size; `oversubscribed`: this run started more ranks on this host than it has
/// CPUs for them (waits then yield the CPU at once instead of spinning).
fn bench(args: &Args, mesh: fabric_core::bootstrap::Mesh, oversubscribed: bool) -> Res<()> {
    let rank = mesh.rank() as usize;
    let n = mesh.size() as usize;
    let kind = mesh.kind();
    let (domain, peers) = mesh.into_parts();
    let caps = peers.iter().flatten().next().map(|c| c.capabilities());
    let mut comm = Comm::new(rank, domain.clone(), peers, oversubscribed)?;
    let support = domain.memory_support();
    let one_sided = args.one_sided
        && caps.is_some_and(|c| c.one_sided)
        && support
            .caller_remote
            .contains(fabric_core::MemoryKinds::HOST);
    if args.one_sided && !one_sided && rank == 0 {
        eprintln!("allreduce: {kind} cannot give peers write access to caller memory; two-sided all-gather instead");
    }
    let rs_write = match args.rs {
        Some(m) => m == RsMode::Write,
        None => kind == TransportKind::Shm,
    } && n > 1
        && caps.is_some_and(|c| c.one_sided)
        && support
            .allocated_remote
            .contains(fabric_core::MemoryKinds::HOST);
    if args.rs == Some(RsMode::Write) && !rs_write && n > 1 && rank == 0 {
        eprintln!(
            "allreduce: {kind} cannot write into peers' memory; two-sided reduce-scatter instead"
        );
    }
    // `--chunk-bytes` in whole elements: the write ring's chunk (512 KiB without it) and the
    // send ring's at every size (per size without it, `send_ring_chunk`).
    let fixed_chunk = args.chunk_bytes.map(|c| (c / 4).max(1) * 4);
    let chunk = fixed_chunk.unwrap_or(512 << 10);
    let send_chunk = |bytes: usize| fixed_chunk.unwrap_or_else(|| send_ring_chunk(bytes, n));
    let sizes = sizes(args.min_bytes, args.max_bytes);
    // The smallest vector whose output is marked streaming (`usize::MAX`: none).
    let stream_from = match args.stream_output {
        StreamOut::Always => 0,
        StreamOut::Never => usize::MAX,
        StreamOut::Auto => l3_bytes().map_or(usize::MAX, |l3| (l3 / 2).div_ceil(2 * n)),
    };
    if rs_write {
        comm.wring = Some(WriteRing::setup(&mut comm, chunk, args.slots.max(2))?);
    }
    let rd_put = match args.rd_mode {
        Some(m) => m == RdMode::Put,
        None => kind == TransportKind::Shm,
    } && n > 1
        && caps.is_some_and(|c| c.one_sided && c.atomics)
        && support
            .allocated_remote
            .contains(fabric_core::MemoryKinds::HOST);
    if args.rd_mode == Some(RdMode::Put) && !rd_put && n > 1 && rank == 0 {
        eprintln!("allreduce: {kind} has no one-sided writes and atomics into peers' memory; recursive doubling by sends instead");
    }
    if rd_put {
        let max = args
            .put_max_bytes
            .min(args.rd_max_bytes)
            .min(args.max_bytes)
            .max(4);
        comm.put = Some(Box::new(PutRd::setup(&mut comm, max, args.window)?));
    }
    // The send ring's slots (the write ring has its own, remotely writable): as long as
    // the largest chunk of any ring size of this run.
    let slot_len = sizes
        .iter()
        .filter(|&&b| b > args.rd_max_bytes || args.algo == Some(Algo::Ring))
        .map(|&b| send_chunk(b))
        .max()
        .unwrap_or(4);
    let slots: Vec<fabric_core::Region> = (0..if rs_write { 0 } else { args.slots.max(2) })
        .map(|_| domain.register(slot_len, Access::empty()))
        .collect::<fabric_core::Result<_>>()?;
    let tmp = domain.register(
        args.rd_max_bytes.max(4).min(args.max_bytes.max(4)),
        Access::empty(),
    )?;
    let pb = if rank == 0 {
        ProgressBar::with_draw_target(Some(sizes.len() as u64), ProgressDrawTarget::stderr())
    } else {
        ProgressBar::hidden()
    };
    if !std::io::stderr().is_terminal() {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg:>20} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    if rank == 0 {
        println!(
            "# fabric allreduce: {n} ranks, transport {kind}, f32 sum, out of place; \
             rd up to {} B ({}), ring chunk {}, {} slots, reduce-scatter by {}{}; \
             output streams {}; waits {}",
            args.rd_max_bytes,
            if rd_put {
                let how = match comm.put.as_ref() {
                    Some(p) if p.wins.iter().any(Option::is_some) => "stored through windows",
                    _ => "posted",
                };
                format!(
                    "puts up to {} B, {how}",
                    args.put_max_bytes.min(args.rd_max_bytes)
                )
            } else {
                "sends".to_string()
            },
            if rs_write || args.chunk_bytes.is_some() {
                format!("{chunk} B")
            } else {
                format!(
                    "a segment up to {SEND_CHUNK_MAX} B, {SEND_PIPELINE_CHUNK} B past {} MiB \
                     segments",
                    SEND_WHOLE_SEGMENTS_UP_TO >> 20
                )
            },
            args.slots.max(2),
            if rs_write { "writes" } else { "sends" },
            if one_sided {
                ", one-sided all-gather"
            } else {
                ""
            },
            match stream_from {
                0 => "at every size".to_string(),
                usize::MAX => "at no size".to_string(),
                b => format!("from {b} B"),
            },
            if oversubscribed {
                "yield (more ranks than CPUs)"
            } else {
                "spin"
            }
        );
        println!(
            "# {:>10} {:>11} {:>8} {:>6} {:>11} {:>9} {:>9} {:>6}",
            "size(B)", "count", "iters", "algo", "time(us)", "algbw", "busbw", "check"
        );
    }
    for &bytes in &sizes {
        pb.set_message(format!("{bytes} B"));
        let count = bytes / 4;
        let bytes = count * 4;
        let algo = args.algo.unwrap_or(if bytes <= args.rd_max_bytes {
            Algo::Rd
        } else {
            Algo::Ring
        });
        if algo == Algo::Rd && bytes > tmp.len() {
            return Err(format!("--algo rd needs --rd-max-bytes >= {bytes}").into());
        }
        // The caller's own memory, registered in place.
        let wrong = args.inject_error && rank == n - 1;
        let out_access = if one_sided && algo == Algo::Ring {
            Access::REMOTE_WRITE
        } else {
            Access::empty()
        };
        let send = domain.register_memory(vec![0f32; count], Access::empty())?;
        write_input(&send, rank, 0, wrong)?;
        let out = domain.register_memory(vec![0f32; count], out_access)?;
        out.set_streaming(bytes >= stream_from);
        let right_out = if out_access == Access::REMOTE_WRITE {
            Some(exchange_keys(&mut comm, &out)?)
        } else {
            None
        };
        let b = Bufs {
            send: &send,
            out: &out,
            tmp: &tmp,
            slots: &slots,
            chunk: send_chunk(bytes),
            right_out,
            bytes,
        };
        let iters = args.iters.unwrap_or_else(|| default_iters(bytes)).max(1);
        let warmup = args.warmup.unwrap_or(iters / 10).max(1);
        for _ in 0..warmup {
            allreduce(&mut comm, algo, &b)?;
        }
        barrier(&mut comm, &tmp)?;
        let t0 = Instant::now();
        for _ in 0..iters {
            allreduce(&mut comm, algo, &b)?;
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let checked = if args.check {
            // Poison the output, change the input, run once more, compare every element: a
            // reduction that read anything left over from the timed operations (a slot
            // reused too early, or read at the wrong place) sums the old values.
            out.fill(0, bytes, 0xff)?;
            write_input(&send, rank, 1, wrong)?;
            barrier(&mut comm, &tmp)?;
            allreduce(&mut comm, algo, &b)?;
            check(&out, n, count, rank, bytes)?;
            "ok"
        } else {
            "-"
        };
        barrier(&mut comm, &tmp)?;
        // The puts' completions hold slices of this size's buffers.
        drain_puts(&mut comm)?;
        if rank == 0 {
            let algbw = bytes as f64 / us / 1e3;
            let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
            pb.suspend(|| {
                println!(
                    "  {:>10} {:>11} {:>8} {:>6} {:>11.2} {:>9.3} {:>9.3} {:>6}",
                    bytes,
                    count,
                    iters,
                    algo.name(one_sided && algo == Algo::Ring),
                    us,
                    algbw,
                    busbw,
                    checked
                )
            });
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    // Every rank leaves together (no connection closes under a peer still working).
    barrier(&mut comm, &tmp)?;
    Ok(())
}

fn check(out: &fabric_core::Region, n: usize, count: usize, rank: usize, bytes: usize) -> Res<()> {
    let mut buf = vec![0u8; bytes.min(1 << 20)];
    let mut o = 0;
    while o < bytes {
        let k = (bytes - o).min(buf.len());
        out.read_at(o, &mut buf[..k])?;
        for (j, w) in buf[..k].chunks_exact(4).enumerate() {
            let i = o / 4 + j;
            let got = f32::from_ne_bytes([w[0], w[1], w[2], w[3]]);
            let want = expected(n, i, 1);
            if got != want {
                return Err(format!(
                    "wrong result at {bytes} B, element {i} of {count}: got {got}, expected {want} (rank {rank})"
                )
                .into());
            }
        }
        o += k;
    }
    Ok(())
}

/// A 4-byte all-reduce as a barrier.
fn barrier(comm: &mut Comm, tmp: &fabric_core::Region) -> Res<()> {
    let d = comm.domain.clone();
    let s = d.register_memory(vec![1f32], Access::empty())?;
    let o = d.register_memory(vec![0f32], Access::empty())?;
    let b = Bufs {
        send: &s,
        out: &o,
        tmp,
        slots: &[],
        chunk: 0,
        right_out: None,
        bytes: 4,
    };
    allreduce_rd(comm, &b)
}

/// Gives the left neighbour our output's key; returns the right neighbour's.
fn exchange_keys(comm: &mut Comm, out: &fabric_core::Region) -> Res<RemoteKey> {
    let (n, r) = (comm.size, comm.rank);
    let key = out
        .remote_key()
        .ok_or("the output region has no remote key")?;
    let d = comm.domain.clone();
    let mine = d.register(RemoteKey::PACKED_LEN, Access::empty())?;
    mine.write_at(0, &key.pack())?;
    let theirs = d.register(RemoteKey::PACKED_LEN, Access::empty())?;
    let (left, right) = ((r + n - 1) % n, (r + 1) % n);
    // Send left, receive from right (the receive is posted before the send, so nobody
    // waits in a cycle).
    exchange(comm, left, right, &mine, &theirs, RemoteKey::PACKED_LEN)?;
    let mut k = [0u8; RemoteKey::PACKED_LEN];
    theirs.read_at(0, &mut k)?;
    Ok(RemoteKey::decode(&k)?)
}

/* A stand-in for libcuda.so that keeps "device" memory in host memory, for testing the
 * plumbing of nvlink-p2p (argument passing, ownership, cache, error mapping) on machines
 * without a GPU. It is not a GPU: copies are memcpy, events and streams are tokens.
 * Written for this project's tests; only the entry points the tests reach exist.
 *
 * Behaviours of the real driver it models, because the crate must cope with them:
 * - cuMemAlloc memory is a memfd, so a legacy IPC handle opens in *another* process
 *   (through /proc/PID/fd); opening it in the exporting process fails with
 *   CUDA_ERROR_INVALID_CONTEXT (201), as the real driver does. The handle bytes name the
 *   exporter's pid and fd only, so a freed and re-made allocation repeats them.
 * - cuMemcpyHtoD from pageable memory returns once the bytes are staged: they land when the
 *   legacy stream is synchronized (cuCtxSynchronize, a synchronous copy or memset, an event
 *   recorded on stream 0), not for work on non-blocking streams or in another process.
 * - cuMemMap beyond the imported allocation fails (CUDA_ERROR_INVALID_VALUE).
 * - Freeing memory that another process still has open through IPC is undefined behaviour
 *   for the real driver; here every allocation has a trailer page counting the processes
 *   that map it, and cuMemFree of a mapped one is counted (fake_freed_while_mapped).
 * Knobs (environment): FAKE_CUDA_COUNT, FAKE_CUDA_NO_VMM; FAKE_CUDA_DMABUF=<CUresult>
 * (device reports DMA-BUF support; export returns that code, 0 = a memfd dup);
 * FAKE_CUDA_FABRIC=ok|create:<code>|export:<code>|import:<code> (device reports fabric
 * support; the named step fails); FAKE_CUDA_VMM_RDMA=1 (device reports GPUDirect RDMA with
 * VMM) and FAKE_CUDA_REFUSE_RDMA_FLAG=<code> (cuMemCreate refuses that flag). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>

typedef unsigned long long dptr;
#define OK 0
#define INVALID_VALUE 1
#define INVALID_CONTEXT 201
#define NOT_READY 600
#define UNKNOWN 999
#define MAXA 4096

typedef struct { unsigned char r[64]; } ipc_handle; /* passed by value, like CUipcMemHandle */

/* kind: 1 = cuMemAlloc (owns fd), 2 = VMM mapping, 3 = IPC mapping of another process */
static struct { dptr p; size_t n; int fd; int kind; } allocs[MAXA];
static __thread void *current;
static long next_token = 0x100;

int nvlink_p2p_stand_in_driver(void) { return 1; }

static int find(dptr p, dptr *base, size_t *size) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p && p >= allocs[i].p && p < allocs[i].p + allocs[i].n) {
            if (base) *base = allocs[i].p;
            if (size) *size = allocs[i].n;
            return i + 1;
        }
    return 0;
}

static int valid(dptr p, size_t n) { dptr b; size_t s; return n == 0 || (find(p, &b, &s) && p + n <= b + s); }

static int add_alloc(dptr p, size_t n, int fd, int kind) {
    for (int i = 0; i < MAXA; i++)
        if (!allocs[i].p) { allocs[i].p = p; allocs[i].n = n; allocs[i].fd = fd; allocs[i].kind = kind; return OK; }
    return 2;
}

/* The trailer page after an allocation's pages: how many other processes map it now. */
static int *trailer(dptr p, size_t n) { return (int *)(uintptr_t)(p + (n + 4095) / 4096 * 4096); }
static int freed_while_mapped;
int fake_freed_while_mapped(void) { return freed_while_mapped; }

int fake_live_allocs(void) {
    int n = 0;
    for (int i = 0; i < MAXA; i++) n += allocs[i].p && allocs[i].kind == 1;
    return n;
}

/* Host-to-device copies staged for the legacy stream. */
static struct { dptr d; void *buf; size_t n; } staged[256];
static int nstaged;
static void land(void) {
    for (int i = 0; i < nstaged; i++) { memcpy((void *)(uintptr_t)staged[i].d, staged[i].buf, staged[i].n); free(staged[i].buf); }
    nstaged = 0;
}
static void *null_events[16];
static int null_event_at;
static void sync_event(void *e) {
    for (int i = 0; i < 16; i++) if (e && null_events[i] == e) { land(); null_events[i] = 0; }
}

static int env_code(const char *name, int dflt) { const char *v = getenv(name); return v ? atoi(v) : dflt; }
/* FAKE_CUDA_FABRIC=step:code -> code if `step` is the failing step, else 0. */
static int fabric_fails(const char *step) {
    const char *v = getenv("FAKE_CUDA_FABRIC");
    size_t n = strlen(step);
    if (!v || strncmp(v, step, n) != 0 || v[n] != ':') return 0;
    return atoi(v + n + 1);
}

int cuInit(unsigned f) { (void)f; return OK; }
int cuDriverGetVersion(int *v) { *v = 12080; return OK; }
int cuDeviceGetCount(int *c) { const char *e = getenv("FAKE_CUDA_COUNT"); *c = e ? atoi(e) : 2; return OK; }
int cuDeviceGet(int *d, int o) { *d = o; return OK; }
int cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev;
    switch (attr) {
    case 33: *v = 0x40 + dev; break;           /* PCI bus id */
    case 115: *v = 0; break;                    /* memory pools: none, so cudarc uses cuMemAlloc */
    case 102: *v = getenv("FAKE_CUDA_NO_VMM") ? 0 : 1; break; /* virtual memory management */
    case 103: *v = 1; break;                    /* POSIX fd shareable handles */
    case 110: *v = getenv("FAKE_CUDA_VMM_RDMA") ? 1 : 0; break; /* GPUDirect RDMA with VMM */
    case 124: *v = getenv("FAKE_CUDA_DMABUF") ? 1 : 0; break;   /* DMA-BUF */
    case 128: *v = getenv("FAKE_CUDA_FABRIC") ? 1 : 0; break;   /* fabric handles */
    default: *v = 0;
    }
    return OK;
}
int cuDeviceGetName(char *n, int len, int dev) { (void)dev; strncpy(n, "Stand-in GPU", len); return OK; }
int cuDeviceGetUuid(unsigned char *u, int dev) { for (int i = 0; i < 16; i++) u[i] = (unsigned char)(i * 7 + dev); return OK; }
int cuDeviceCanAccessPeer(int *can, int a, int b) { *can = a != b; return OK; }
int cuDeviceGetP2PAttribute(int *v, int attr, int a, int b) { (void)a; (void)b; *v = attr == 1 ? 0 : 1; return OK; }
int cuDevicePrimaryCtxRetain(void **c, int dev) { *c = (void *)(uintptr_t)(0x1000 + dev); return OK; }
int cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return OK; }
int cuCtxCreate_v2(void **c, unsigned f, int dev) { (void)f; (void)dev; *c = (void *)(uintptr_t)(0x10000 + next_token++); current = *c; return OK; }
int cuCtxDestroy_v2(void *c) { (void)c; return OK; }
int cuCtxGetCurrent(void **c) { *c = current; return OK; }
int cuCtxSetCurrent(void *c) { current = c; return OK; }
int cuCtxSynchronize(void) { land(); return OK; }
int cuCtxEnablePeerAccess(void *peer, unsigned f) { (void)peer; return f ? INVALID_VALUE : OK; }
int cuCtxDisablePeerAccess(void *peer) { (void)peer; return OK; }
int cuMemAlloc_v2(dptr *p, size_t n) {
    if (!n) return INVALID_VALUE;
    size_t pages = (n + 4095) / 4096 * 4096 + 4096; /* + the trailer */
    int fd = memfd_create("standin-mem", MFD_CLOEXEC);
    if (fd < 0) return 2;
    void *m = ftruncate(fd, (off_t)pages) == 0 ? mmap(0, pages, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (m == MAP_FAILED) { close(fd); return 2; }
    *p = (dptr)(uintptr_t)m;
    if (add_alloc(*p, n, fd, 1) != OK) { munmap(m, pages); close(fd); return 2; }
    return OK;
}
int cuMemFree_v2(dptr p) {
    land();
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p == p && allocs[i].kind == 1) {
            if (__atomic_load_n(trailer(p, allocs[i].n), __ATOMIC_SEQ_CST) > 0) freed_while_mapped++;
            munmap((void *)(uintptr_t)p, (allocs[i].n + 4095) / 4096 * 4096 + 4096);
            close(allocs[i].fd);
            allocs[i].p = 0;
            return OK;
        }
    return INVALID_VALUE;
}
/* VMM: a physical allocation is a memfd; mapping it maps the memfd. "Free memory" drops by
 * the size of every live allocation handle, so a missing cuMemRelease shows as a leak. */
static long long vmm_live;
int cuMemGetInfo_v2(size_t *fr, size_t *t) { *t = 1ull << 36; *fr = (size_t)((1ll << 36) - vmm_live); return OK; }
#define GRAN 65536
typedef struct { int type_, handle_types, loc_type, loc_id; void *win32; unsigned char flags[8]; } prop_t;
static struct { int fd; size_t n; } handles[MAXA];
int cuMemGetAllocationGranularity(size_t *g, const prop_t *p, int opt) { (void)p; (void)opt; *g = GRAN; return OK; }
static int new_handle(unsigned long long *h, int fd, size_t n) {
    for (int i = 1; i < MAXA; i++)
        if (!handles[i].fd) { handles[i].fd = fd + 1; handles[i].n = n; *h = i; vmm_live += n; return OK; }
    close(fd);
    return 2;
}
int cuMemCreate(unsigned long long *h, size_t n, const prop_t *p, unsigned long long f) {
    if (p->flags[1] && getenv("FAKE_CUDA_REFUSE_RDMA_FLAG")) return env_code("FAKE_CUDA_REFUSE_RDMA_FLAG", UNKNOWN);
    if (p->handle_types == 8) {
        if (!getenv("FAKE_CUDA_FABRIC")) return 801;
        if (fabric_fails("create")) return fabric_fails("create");
    } else if (p->handle_types != 1) return INVALID_VALUE;
    if (f || n == 0 || n % GRAN) return INVALID_VALUE;
    int fd = memfd_create("standin-vmm", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)n) != 0) return 2;
    return new_handle(h, fd, n);
}
int cuMemRelease(unsigned long long h) {
    if (h >= MAXA || !handles[h].fd) return INVALID_VALUE;
    close(handles[h].fd - 1); handles[h].fd = 0; vmm_live -= (long long)handles[h].n;
    return OK;
}
int cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long f) {
    (void)f;
    if (h >= MAXA || !handles[h].fd) return INVALID_VALUE;
    if (type == 8) {
        if (fabric_fails("export")) return fabric_fails("export");
        int pid = getpid();
        memset(out, 0, 64); memcpy(out, "FABRIC", 6); memcpy((char *)out + 8, &pid, 4); memcpy((char *)out + 12, &h, 8);
        return OK;
    }
    if (type != 1) return INVALID_VALUE;
    *(int *)out = dup(handles[h].fd - 1);
    return OK;
}
int cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
    if (type == 8) {
        int pid; unsigned long long src;
        if (fabric_fails("import")) return fabric_fails("import");
        if (memcmp(os, "FABRIC", 6) != 0) return INVALID_VALUE;
        memcpy(&pid, (char *)os + 8, 4); memcpy(&src, (char *)os + 12, 8);
        if (pid != getpid() || src >= MAXA || !handles[src].fd) return INVALID_VALUE;
        int fd = dup(handles[src].fd - 1);
        return fd < 0 ? INVALID_VALUE : new_handle(h, fd, handles[src].n);
    }
    if (type != 1) return INVALID_VALUE;
    int fd = dup((int)(intptr_t)os);
    if (fd < 0) return INVALID_VALUE;
    off_t n = lseek(fd, 0, SEEK_END);
    return new_handle(h, fd, (size_t)n);
}
int cuMemAddressReserve(dptr *p, size_t n, size_t align, dptr addr, unsigned long long f) {
    (void)align; (void)addr; (void)f;
    void *m = mmap(0, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return 2;
    *p = (dptr)(uintptr_t)m;
    return OK;
}
int cuMemAddressFree(dptr p, size_t n) { return munmap((void *)(uintptr_t)p, n) ? INVALID_VALUE : OK; }
int cuMemMap(dptr p, size_t n, size_t off, unsigned long long h, unsigned long long f) {
    (void)f;
    if (h >= MAXA || !handles[h].fd || off + n > handles[h].n) return INVALID_VALUE;
    if (mmap((void *)(uintptr_t)p, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, handles[h].fd - 1, (off_t)off) == MAP_FAILED) return INVALID_VALUE;
    return add_alloc(p, n, -1, 2);
}
int cuMemSetAccess(dptr p, size_t n, const void *desc, size_t count) { (void)desc; return valid(p, n) && count == 1 ? OK : INVALID_VALUE; }
int cuMemUnmap(dptr p, size_t n) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p == p && allocs[i].kind == 2) {
            allocs[i].p = 0;
            mmap((void *)(uintptr_t)p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            return OK;
        }
    return INVALID_VALUE;
}
int cuMemGetAddressRange_v2(dptr *b, size_t *s, dptr p) { return find(p, b, s) ? OK : INVALID_VALUE; }
/* Staged, like pageable HtoD on the real driver: the bytes land when the legacy stream syncs. */
int cuMemcpyHtoD_v2(dptr d, const void *s, size_t n) {
    if (!valid(d, n)) return INVALID_VALUE;
    if (nstaged == 256) land();
    void *b = malloc(n ? n : 1);
    if (!b) return 2;
    memcpy(b, s, n);
    staged[nstaged].d = d; staged[nstaged].buf = b; staged[nstaged].n = n; nstaged++;
    return OK;
}
int cuMemcpyDtoH_v2(void *d, dptr s, size_t n) { if (!valid(s, n)) return INVALID_VALUE; land(); memcpy(d, (void *)(uintptr_t)s, n); return OK; }
static int dtod(dptr d, dptr s, size_t n) { if (!valid(d, n) || !valid(s, n)) return INVALID_VALUE; memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return OK; }
int cuMemcpyDtoD_v2(dptr d, dptr s, size_t n) { land(); return dtod(d, s, n); }
/* On a non-blocking stream: not ordered after staged host-to-device copies. */
int cuMemcpyDtoDAsync_v2(dptr d, dptr s, size_t n, void *st) { if (!st) land(); return dtod(d, s, n); }
int cuMemcpyPeerAsync(dptr d, void *dc, dptr s, void *sc, size_t n, void *st) { (void)dc; (void)sc; if (!st) land(); return dtod(d, s, n); }
int cuMemsetD8_v2(dptr d, unsigned char v, size_t n) { if (!valid(d, n)) return INVALID_VALUE; land(); memset((void *)(uintptr_t)d, v, n); return OK; }
int cuMemsetD8Async(dptr d, unsigned char v, size_t n, void *st) { (void)st; return cuMemsetD8_v2(d, v, n); }
int cuMemGetHandleForAddressRange(void *out, dptr p, size_t n, int type, unsigned long long f) {
    (void)f;
    int code = env_code("FAKE_CUDA_DMABUF", INVALID_VALUE);
    if (code) return code;
    int i = find(p, 0, 0);
    if (type != 1 || !i || !valid(p, n) || allocs[i - 1].fd < 0) return INVALID_VALUE;
    *(int *)out = dup(allocs[i - 1].fd);
    return OK;
}
int cuPointerGetAttribute(void *data, int attr, dptr p) {
    if (!find(p, 0, 0)) return INVALID_VALUE;
    if (attr == 17) { *(void **)data = 0; return OK; } /* MEMPOOL_HANDLE: not from a pool */
    return INVALID_VALUE;
}
int cuStreamCreate(void **s, unsigned f) { (void)f; *s = (void *)(uintptr_t)(next_token++); return OK; }
int cuStreamDestroy_v2(void *s) { (void)s; return OK; }
int cuStreamSynchronize(void *s) { if (!s) land(); return OK; }
int cuStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; (void)f; return OK; }
int cuEventCreate(void **e, unsigned f) { (void)f; *e = (void *)(uintptr_t)(next_token++); return OK; }
int cuEventRecord(void *e, void *s) { if (!s) { null_events[null_event_at] = e; null_event_at = (null_event_at + 1) % 16; } return OK; }
int cuEventQuery(void *e) { sync_event(e); return OK; }
int cuEventSynchronize(void *e) { sync_event(e); return OK; }
int cuEventDestroy_v2(void *e) { (void)e; return OK; }
int cuEventElapsedTime(float *ms, void *a, void *b) { (void)a; (void)b; *ms = 1.0f; return OK; }
/* Legacy IPC: the handle names the exporter's pid and the allocation's memfd; another
 * process maps that memfd. Opens must balance closes. */
static int ipc_open;
int cuIpcGetMemHandle(unsigned char *h, dptr p) {
    dptr b; size_t s;
    int i = find(p, &b, &s);
    if (!i || b != p || allocs[i - 1].kind != 1) return INVALID_VALUE;
    int pid = getpid();
    unsigned long long n = s;
    memset(h, 0, 64); memcpy(h, "FAKEIPC", 7); memcpy(h + 8, &pid, 4); memcpy(h + 12, &allocs[i - 1].fd, 4); memcpy(h + 16, &n, 8);
    return OK;
}
int cuIpcOpenMemHandle_v2(dptr *p, ipc_handle h, unsigned f) {
    (void)f;
    int pid, fd; unsigned long long n; char path[64];
    if (memcmp(h.r, "FAKEIPC", 7) != 0) return INVALID_VALUE;
    memcpy(&pid, h.r + 8, 4); memcpy(&fd, h.r + 12, 4); memcpy(&n, h.r + 16, 8);
    if (pid == getpid()) return INVALID_CONTEXT;
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int mine = open(path, O_RDWR | O_CLOEXEC);
    if (mine < 0) return INVALID_VALUE;
    size_t pages = (n + 4095) / 4096 * 4096 + 4096;
    void *m = mmap(0, pages, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
    close(mine);
    if (m == MAP_FAILED) return INVALID_VALUE;
    *p = (dptr)(uintptr_t)m;
    if (add_alloc(*p, n, -1, 3) != OK) { munmap(m, pages); return 2; }
    __atomic_add_fetch(trailer(*p, n), 1, __ATOMIC_SEQ_CST);
    ipc_open++;
    return OK;
}
int cuIpcCloseMemHandle(dptr p) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p == p && allocs[i].kind == 3) {
            __atomic_sub_fetch(trailer(p, allocs[i].n), 1, __ATOMIC_SEQ_CST);
            munmap((void *)(uintptr_t)p, (allocs[i].n + 4095) / 4096 * 4096 + 4096);
            allocs[i].p = 0; ipc_open--;
            return OK;
        }
    return INVALID_VALUE;
}
int fake_ipc_open_count(void) { return ipc_open; }
int cuIpcGetEventHandle(unsigned char *h, void *e) { memset(h, 0, 64); memcpy(h, &e, sizeof e); return OK; }
int cuIpcOpenEventHandle(void **e, ipc_handle h) { memcpy(e, h.r, sizeof *e); return OK; }
int cuGetErrorName(int r, const char **s) { (void)r; *s = "CUDA_ERROR_STANDIN"; return OK; }
int cuGetErrorString(int r, const char **s) { (void)r; *s = "stand-in error"; return OK; }
int fake_live_vmm_handles(void) {
    int n = 0;
    for (int i = 1; i < MAXA; i++) n += handles[i].fd != 0;
    return n;
}

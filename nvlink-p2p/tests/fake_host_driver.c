/* A stand-in for libcuda.so that keeps "device" memory in host memory, for testing the
 * plumbing of nvlink-p2p (argument passing, ownership, cache, error mapping) on machines
 * without a GPU. It is not a GPU: copies are memcpy, events and streams are tokens.
 * Written for this project's tests; only the entry points the tests reach exist. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/mman.h>

typedef unsigned long long dptr;
#define OK 0
#define INVALID_VALUE 1
#define NOT_READY 600
#define UNKNOWN 999
#define MAXA 4096

typedef struct { unsigned char r[64]; } ipc_handle; /* passed by value, like CUipcMemHandle */

static struct { dptr p; size_t n; } allocs[MAXA];
static __thread void *current;
static long next_token = 0x100;

static int find(dptr p, dptr *base, size_t *size) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p && p >= allocs[i].p && p < allocs[i].p + allocs[i].n) {
            if (base) *base = allocs[i].p;
            if (size) *size = allocs[i].n;
            return 1;
        }
    return 0;
}

static int valid(dptr p, size_t n) { dptr b; size_t s; return n == 0 || (find(p, &b, &s) && p + n <= b + s); }

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
    default: *v = 0;                            /* no fabric, no DMA-BUF, no VMM RDMA */
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
int cuCtxSynchronize(void) { return OK; }
int cuCtxEnablePeerAccess(void *peer, unsigned f) { (void)peer; return f ? INVALID_VALUE : OK; }
int cuCtxDisablePeerAccess(void *peer) { (void)peer; return OK; }
int cuMemAlloc_v2(dptr *p, size_t n) {
    if (!n) return INVALID_VALUE;
    for (int i = 0; i < MAXA; i++)
        if (!allocs[i].p) {
            void *m = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
            if (!m) return 2;
            allocs[i].p = (dptr)(uintptr_t)m; allocs[i].n = n; *p = allocs[i].p;
            return OK;
        }
    return 2;
}
int cuMemFree_v2(dptr p) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p == p) { free((void *)(uintptr_t)p); allocs[i].p = 0; return OK; }
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
    if (f || n == 0 || n % GRAN || p->handle_types != 1) return INVALID_VALUE;
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
    if (type != 1 || h >= MAXA || !handles[h].fd) return INVALID_VALUE;
    *(int *)out = dup(handles[h].fd - 1);
    return OK;
}
int cuMemImportFromShareableHandle(unsigned long long *h, void *os, int type) {
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
    if (h >= MAXA || !handles[h].fd) return INVALID_VALUE;
    if (mmap((void *)(uintptr_t)p, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, handles[h].fd - 1, (off_t)off) == MAP_FAILED) return INVALID_VALUE;
    for (int i = 0; i < MAXA; i++)
        if (!allocs[i].p) { allocs[i].p = p; allocs[i].n = n; return OK; }
    return 2;
}
int cuMemSetAccess(dptr p, size_t n, const void *desc, size_t count) { (void)desc; return valid(p, n) && count == 1 ? OK : INVALID_VALUE; }
int cuMemUnmap(dptr p, size_t n) {
    for (int i = 0; i < MAXA; i++)
        if (allocs[i].p == p) {
            allocs[i].p = 0;
            mmap((void *)(uintptr_t)p, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            return OK;
        }
    return INVALID_VALUE;
}
int cuMemGetAddressRange_v2(dptr *b, size_t *s, dptr p) { return find(p, b, s) ? OK : INVALID_VALUE; }
int cuMemcpyHtoD_v2(dptr d, const void *s, size_t n) { if (!valid(d, n)) return INVALID_VALUE; memcpy((void *)(uintptr_t)d, s, n); return OK; }
int cuMemcpyDtoH_v2(void *d, dptr s, size_t n) { if (!valid(s, n)) return INVALID_VALUE; memcpy(d, (void *)(uintptr_t)s, n); return OK; }
int cuMemcpyDtoD_v2(dptr d, dptr s, size_t n) { if (!valid(d, n) || !valid(s, n)) return INVALID_VALUE; memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return OK; }
int cuMemcpyDtoDAsync_v2(dptr d, dptr s, size_t n, void *st) { (void)st; return cuMemcpyDtoD_v2(d, s, n); }
int cuMemcpyPeerAsync(dptr d, void *dc, dptr s, void *sc, size_t n, void *st) { (void)dc; (void)sc; (void)st; return cuMemcpyDtoD_v2(d, s, n); }
int cuMemsetD8_v2(dptr d, unsigned char v, size_t n) { if (!valid(d, n)) return INVALID_VALUE; memset((void *)(uintptr_t)d, v, n); return OK; }
int cuMemsetD8Async(dptr d, unsigned char v, size_t n, void *st) { (void)st; return cuMemsetD8_v2(d, v, n); }
int cuPointerGetAttribute(void *data, int attr, dptr p) {
    if (!find(p, 0, 0)) return INVALID_VALUE;
    if (attr == 17) { *(void **)data = 0; return OK; } /* MEMPOOL_HANDLE: not from a pool */
    return INVALID_VALUE;
}
int cuStreamCreate(void **s, unsigned f) { (void)f; *s = (void *)(uintptr_t)(next_token++); return OK; }
int cuStreamDestroy_v2(void *s) { (void)s; return OK; }
int cuStreamSynchronize(void *s) { (void)s; return OK; }
int cuStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; (void)f; return OK; }
int cuEventCreate(void **e, unsigned f) { (void)f; *e = (void *)(uintptr_t)(next_token++); return OK; }
int cuEventRecord(void *e, void *s) { (void)e; (void)s; return OK; }
int cuEventQuery(void *e) { (void)e; return OK; }
int cuEventSynchronize(void *e) { (void)e; return OK; }
int cuEventDestroy_v2(void *e) { (void)e; return OK; }
int cuEventElapsedTime(float *ms, void *a, void *b) { (void)a; (void)b; *ms = 1.0f; return OK; }
/* Legacy IPC: the handle carries the pointer; opening works in-process (real CUDA refuses
 * that), which lets the cache be tested here. Opens must balance closes. */
static int ipc_open;
int cuIpcGetMemHandle(unsigned char *h, dptr p) {
    dptr b; size_t s;
    if (!find(p, &b, &s) || b != p) return INVALID_VALUE;
    memset(h, 0, 64); memcpy(h, "FAKEIPC", 7); memcpy(h + 8, &p, 8);
    return OK;
}
int cuIpcOpenMemHandle_v2(dptr *p, ipc_handle h, unsigned f) {
    (void)f;
    dptr q;
    if (memcmp(h.r, "FAKEIPC", 7) != 0) return INVALID_VALUE;
    memcpy(&q, h.r + 8, 8);
    if (!find(q, 0, 0)) return INVALID_VALUE;
    ipc_open++; *p = q;
    return OK;
}
int cuIpcCloseMemHandle(dptr p) { (void)p; if (ipc_open <= 0) return INVALID_VALUE; ipc_open--; return OK; }
int fake_ipc_open_count(void) { return ipc_open; }
int cuIpcGetEventHandle(unsigned char *h, void *e) { memset(h, 0, 64); memcpy(h, &e, sizeof e); return OK; }
int cuIpcOpenEventHandle(void **e, ipc_handle h) { memcpy(e, h.r, sizeof *e); return OK; }
int cuGetErrorName(int r, const char **s) { (void)r; *s = "CUDA_ERROR_STANDIN"; return OK; }
int cuGetErrorString(int r, const char **s) { (void)r; *s = "stand-in error"; return OK; }

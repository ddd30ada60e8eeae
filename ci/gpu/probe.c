/* What this machine's CUDA driver (and any sandbox in front of it) allows, found by trying:
 * legacy IPC opened in a forked child, VMM POSIX-fd export/import, DMA-BUF export, fabric
 * handles (create, export, import), pidfd_getfd. Loads libcuda with dlopen, so it builds
 * without CUDA (ci/gpu/build.sh) and runs where the driver is (ci/gpu/run.sh runs it first,
 * so that a test failure can be told apart from a limit of the machine).
 *
 * Prints one "probe: FEATURE: ok|unsupported|refused (...)" line per feature, then
 * "PROBE_REFUSED=a,b,..." naming the features that are not available (ipc, vmm, dmabuf,
 * fabric, pidfd). Exit status: 0 when the driver loaded and initialised, 2 otherwise.
 * Written for this project; CUDA types are declared here with the driver API's layout. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long dptr;
typedef struct { char reserved[64]; } ipc_handle;
typedef struct {
    int type, handle_types, loc_type, loc_id;
    void *win32;
    unsigned char compression, rdma;
    unsigned short usage;
    unsigned char reserved[4];
} alloc_prop;

static void *lib;
static char refused_list[256];

static void *sym(const char *name) { return lib ? dlsym(lib, name) : NULL; }
#define FN(ret, name, args) typedef ret(*name##_t) args; static name##_t p_##name
FN(CUresult, cuInit, (unsigned));
FN(CUresult, cuDriverGetVersion, (int *));
FN(CUresult, cuDeviceGetCount, (int *));
FN(CUresult, cuDeviceGet, (int *, int));
FN(CUresult, cuDeviceGetAttribute, (int *, int, int));
FN(CUresult, cuDeviceGetName, (char *, int, int));
FN(CUresult, cuDevicePrimaryCtxRetain, (void **, int));
FN(CUresult, cuCtxSetCurrent, (void *));
FN(CUresult, cuMemAlloc_v2, (dptr *, size_t));
FN(CUresult, cuMemFree_v2, (dptr));
FN(CUresult, cuIpcGetMemHandle, (ipc_handle *, dptr));
FN(CUresult, cuIpcOpenMemHandle_v2, (dptr *, ipc_handle, unsigned));
FN(CUresult, cuIpcCloseMemHandle, (dptr));
FN(CUresult, cuMemGetAllocationGranularity, (size_t *, const alloc_prop *, int));
FN(CUresult, cuMemCreate, (unsigned long long *, size_t, const alloc_prop *, unsigned long long));
FN(CUresult, cuMemRelease, (unsigned long long));
FN(CUresult, cuMemExportToShareableHandle, (void *, unsigned long long, int, unsigned long long));
FN(CUresult, cuMemImportFromShareableHandle, (unsigned long long *, void *, int));
FN(CUresult, cuMemGetHandleForAddressRange, (void *, dptr, size_t, int, unsigned long long));
FN(CUresult, cuGetErrorName, (CUresult, const char **));

static int load(void) {
    const char *names[] = {"libcuda.so.1", "libcuda.so"};
    for (unsigned i = 0; i < 2 && !lib; i++) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) return 0;
#define GET(name) p_##name = (name##_t)sym(#name)
    GET(cuInit); GET(cuDriverGetVersion); GET(cuDeviceGetCount); GET(cuDeviceGet);
    GET(cuDeviceGetAttribute); GET(cuDeviceGetName); GET(cuDevicePrimaryCtxRetain);
    GET(cuCtxSetCurrent); GET(cuMemAlloc_v2); GET(cuMemFree_v2); GET(cuIpcGetMemHandle);
    GET(cuIpcOpenMemHandle_v2); GET(cuIpcCloseMemHandle); GET(cuMemGetAllocationGranularity);
    GET(cuMemCreate); GET(cuMemRelease); GET(cuMemExportToShareableHandle);
    GET(cuMemImportFromShareableHandle); GET(cuMemGetHandleForAddressRange); GET(cuGetErrorName);
    return p_cuInit && p_cuDriverGetVersion && p_cuDeviceGetCount && p_cuDeviceGet;
}

static const char *ename(CUresult r) {
    const char *s = NULL;
    if (p_cuGetErrorName && p_cuGetErrorName(r, &s) == 0 && s) return s;
    return "CUDA_ERROR_?";
}

static void refused(const char *feature) {
    if (strstr(refused_list, feature)) return;
    if (refused_list[0]) strncat(refused_list, ",", sizeof refused_list - strlen(refused_list) - 1);
    strncat(refused_list, feature, sizeof refused_list - strlen(refused_list) - 1);
}

static int attr(int a) {
    int v = -1;
    if (p_cuDeviceGetAttribute && p_cuDeviceGetAttribute(&v, a, 0) != 0) v = -1;
    return v;
}

#define TRY(feature, call, label) do { CUresult r_ = (call); if (r_ != 0) { \
    printf("probe: %s: refused (%s returned %s (%d))\n", feature, label, ename(r_), r_); \
    return 0; } } while (0)
#define NEED(feature, p) do { if (!(p)) { \
    printf("probe: %s: unsupported (the driver has no %s)\n", feature, #p + 2); return 0; } } while (0)

/* Child half of the legacy IPC check: started before the parent touches CUDA (CUDA must not
 * be used across fork), opens the handle it reads from `in`, writes the result to `out`. */
static void ipc_child(int in, int out) {
    ipc_handle h;
    int r = -1;
    void *ctx;
    dptr p;
    if (read(in, &h, sizeof h) == (ssize_t)sizeof h && load() && p_cuInit(0) == 0 &&
        p_cuDevicePrimaryCtxRetain && p_cuDevicePrimaryCtxRetain(&ctx, 0) == 0 &&
        p_cuCtxSetCurrent(ctx) == 0 && p_cuIpcOpenMemHandle_v2) {
        r = p_cuIpcOpenMemHandle_v2(&p, h, 1);
        if (r == 0) p_cuIpcCloseMemHandle(p);
    }
    if (write(out, &r, sizeof r) != (ssize_t)sizeof r) _exit(3);
    _exit(0);
}

static int probe_ipc(pid_t child, int to_child, int from_child) {
    const char *f = "legacy-ipc-fork";
    dptr p = 0;
    ipc_handle h;
    int r = -1;
    NEED(f, p_cuIpcGetMemHandle);
    TRY(f, p_cuMemAlloc_v2(&p, 2 << 20), "cuMemAlloc");
    CUresult g = p_cuIpcGetMemHandle(&h, p);
    if (g != 0) {
        printf("probe: %s: refused (cuIpcGetMemHandle returned %s (%d))\n", f, ename(g), g);
        p_cuMemFree_v2(p);
        return 0;
    }
    struct pollfd pf = {from_child, POLLIN, 0};
    if (write(to_child, &h, sizeof h) != (ssize_t)sizeof h || poll(&pf, 1, 20000) != 1 ||
        read(from_child, &r, sizeof r) != (ssize_t)sizeof r) {
        printf("probe: %s: refused (the child did not answer within 20 s)\n", f);
        kill(child, SIGKILL);
        p_cuMemFree_v2(p);
        return 0;
    }
    p_cuMemFree_v2(p);
    if (r != 0) {
        printf("probe: %s: refused (cuIpcOpenMemHandle in the child returned %s (%d))\n", f,
               r > 0 ? ename(r) : "no driver", r);
        return 0;
    }
    printf("probe: %s: ok\n", f);
    return 1;
}

static int probe_vmm(void) {
    const char *f = "posix-fd";
    alloc_prop prop;
    size_t g = 0;
    unsigned long long h = 0, h2 = 0;
    int fd = -1;
    NEED(f, p_cuMemCreate);
    if (attr(102) != 1 || attr(103) != 1) {
        printf("probe: %s: unsupported (VMM attribute %d, POSIX-fd attribute %d)\n", f, attr(102), attr(103));
        return 0;
    }
    memset(&prop, 0, sizeof prop);
    prop.type = 1;         /* pinned */
    prop.handle_types = 1; /* POSIX fd */
    prop.loc_type = 1;     /* device 0 */
    TRY(f, p_cuMemGetAllocationGranularity(&g, &prop, 0), "cuMemGetAllocationGranularity");
    TRY(f, p_cuMemCreate(&h, g, &prop, 0), "cuMemCreate");
    CUresult r = p_cuMemExportToShareableHandle(&fd, h, 1, 0);
    if (r == 0) r = p_cuMemImportFromShareableHandle(&h2, (void *)(intptr_t)fd, 1);
    if (h2) p_cuMemRelease(h2);
    if (fd >= 0) close(fd);
    p_cuMemRelease(h);
    if (r != 0) {
        printf("probe: %s: refused (export/import returned %s (%d))\n", f, ename(r), r);
        return 0;
    }
    printf("probe: %s: ok (granularity %zu, GPUDirect RDMA with VMM attribute %d)\n", f, g, attr(110));
    return 1;
}

static int probe_dmabuf(void) {
    const char *f = "dmabuf";
    dptr p = 0;
    int fd = -1;
    NEED(f, p_cuMemGetHandleForAddressRange);
    if (attr(124) != 1) {
        printf("probe: %s: unsupported (device attribute DMA_BUF_SUPPORTED = %d)\n", f, attr(124));
        return 0;
    }
    TRY(f, p_cuMemAlloc_v2(&p, 2 << 20), "cuMemAlloc");
    CUresult r = p_cuMemGetHandleForAddressRange(&fd, p, 2 << 20, 1, 0);
    if (fd >= 0) close(fd);
    p_cuMemFree_v2(p);
    if (r != 0) {
        printf("probe: %s: refused (cuMemGetHandleForAddressRange returned %s (%d) although the attribute says yes)\n", f, ename(r), r);
        return 0;
    }
    printf("probe: %s: ok\n", f);
    return 1;
}

static int probe_fabric(void) {
    const char *f = "fabric";
    alloc_prop prop;
    size_t g = 0;
    unsigned long long h = 0, h2 = 0;
    unsigned char fh[64];
    NEED(f, p_cuMemCreate);
    if (attr(128) != 1) {
        printf("probe: %s: unsupported (device attribute HANDLE_TYPE_FABRIC_SUPPORTED = %d)\n", f, attr(128));
        return 0;
    }
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.handle_types = 8; /* fabric */
    prop.loc_type = 1;
    TRY(f, p_cuMemGetAllocationGranularity(&g, &prop, 0), "cuMemGetAllocationGranularity");
    TRY(f, p_cuMemCreate(&h, g, &prop, 0), "cuMemCreate");
    CUresult r = p_cuMemExportToShareableHandle(fh, h, 8, 0);
    const char *step = "cuMemExportToShareableHandle";
    if (r == 0) { r = p_cuMemImportFromShareableHandle(&h2, fh, 8); step = "cuMemImportFromShareableHandle"; }
    if (h2) p_cuMemRelease(h2);
    p_cuMemRelease(h);
    if (r != 0) {
        printf("probe: %s: refused (%s returned %s (%d); no IMEX channel?)\n", f, step, ename(r), r);
        return 0;
    }
    printf("probe: %s: ok\n", f);
    return 1;
}

static int probe_pidfd(void) {
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
    long pidfd = syscall(SYS_pidfd_open, getpid(), 0);
    long fd = pidfd >= 0 ? syscall(SYS_pidfd_getfd, (int)pidfd, 1, 0) : -1;
    int err = errno;
    if (fd >= 0) close((int)fd);
    if (pidfd >= 0) close((int)pidfd);
    if (fd < 0) {
        printf("probe: pidfd: refused (%s)\n", strerror(err));
        return 0;
    }
    printf("probe: pidfd: ok\n");
    return 1;
}

int main(void) {
    int to_child[2], from_child[2];
    alarm(60);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (pipe(to_child) || pipe(from_child)) return 2;
    pid_t child = fork();
    if (child == 0) ipc_child(to_child[0], from_child[1]);
    if (!load()) {
        printf("probe: no CUDA driver library (libcuda.so.1) could be loaded: %s\n", dlerror());
        kill(child, SIGKILL);
        printf("PROBE_REFUSED=ipc,vmm,dmabuf,fabric%s\n", probe_pidfd() ? "" : ",pidfd");
        return 2;
    }
    Dl_info info;
    if (dladdr((void *)p_cuInit, &info) && info.dli_fname) printf("probe: library %s\n", info.dli_fname);
    int version = 0, count = 0, dev = 0;
    void *ctx = NULL;
    CUresult r = p_cuInit(0);
    if (r == 0) r = p_cuDriverGetVersion(&version);
    if (r == 0) r = p_cuDeviceGetCount(&count);
    if (r != 0 || count == 0 || p_cuDeviceGet(&dev, 0) != 0 || !p_cuDevicePrimaryCtxRetain ||
        p_cuDevicePrimaryCtxRetain(&ctx, 0) != 0 || p_cuCtxSetCurrent(ctx) != 0) {
        printf("probe: the driver loaded but does not initialise a device (%s (%d), %d devices)\n", ename(r), r, count);
        kill(child, SIGKILL);
        return 2;
    }
    char name[128] = "?";
    if (p_cuDeviceGetName) p_cuDeviceGetName(name, sizeof name, 0);
    printf("probe: driver CUDA %d.%d, %d device(s), device 0: %s, compute mode %d (0 default, 2 prohibited, 3 exclusive-process)\n",
           version / 1000, version % 1000 / 10, count, name, attr(20));
    if (attr(20) == 3) printf("probe: WARNING: exclusive-process compute mode fails every two-process test\n");
    if (!probe_ipc(child, to_child[1], from_child[0])) refused("ipc");
    waitpid(child, NULL, 0);
    if (!probe_vmm()) refused("vmm");
    if (!probe_dmabuf()) refused("dmabuf");
    if (!probe_fabric()) refused("fabric");
    if (!probe_pidfd()) refused("pidfd");
    printf("PROBE_REFUSED=%s\n", refused_list);
    return 0;
}

/* workload.c — a program that makes a known set of CUDA calls against the stub libraries, for the
 * integration tests (built twice: `workload` against libcudart.so.12 + libcuda.so.1, and
 * `workload_static` with both stubs compiled in, so the API symbols live in the executable).
 *
 * Usage: workload SCENARIO [N]; protocol and manifest format in manifest.h. Scenarios:
 *   counts   23 cudaMalloc ((i+1) MiB), cudaFree of the first 19; 7 cudaMallocAsync ((i+1) MiB) +
 *            7 cudaFreeAsync; 3 cudaMalloc of 2 TiB (rc 2); 11 cuMemAlloc_v2 ((i+1) * 4 KiB),
 *            cuMemFree_v2 of the first 5; 5 cudaMallocHost ((i+1) * 4 KiB), cudaFreeHost of the
 *            first 3; 3 cudaMallocManaged ((i+1) MiB); 2 cudaMallocPitch (1000 x 7: pitch 1024,
 *            7168 bytes); 2 cudaFree(0xdead) (rc 1); 1 cudaFree(NULL) (rc 0).
 *   devices  cudaSetDevice(1), 3 cudaMalloc (1 MiB); a thread: cudaSetDevice(2), 5 cudaMalloc
 *            (2 MiB); joined; 2 cudaMalloc (1 MiB, device 1); cudaSetDevice(9) (rc 101).
 *   vmm      cuMemAddressReserve (64 MiB); 5 cuMemCreate (2 MiB, device 3); cuMemMap of each at
 *            reserve + i * 2 MiB; cuMemRelease of handles 0 and 1 (still mapped); one cuMemUnmap
 *            of mappings 0-1 (4 MiB: frees handles 0 and 1); cuMemUnmap of mapping 2; cuMemRelease
 *            of handle 2 (freed now); 1 cuMemCreate of 2 TiB (rc 2). Left: the reservation,
 *            handles 3 and 4, mapped.
 *   context  cudaSetDevice(0); 7 cudaMalloc (1 MiB); cuCtxCreate_v2(device 1); 3 cuMemAlloc_v2
 *            (3 MiB, device 1); cuCtxDestroy_v2 of that context (implicitly frees those 3).
 *   loop N   N x (cudaMalloc 1 MiB + cudaFree), timed; no per-call manifest, one line instead:
 *            {"loop_pairs": N, "ns_per_pair": X}. KVT_LOOP_PAUSE_EVERY / KVT_LOOP_PAUSE_MS pace it.
 *   leak N   N cudaMalloc (1 MiB), never freed.
 *   hold     13 cudaMalloc (1 MiB), then waits to be killed.
 *   storm S  for S seconds, forks short-lived children (KVT_STORM_IN_FLIGHT at once, 8 by default; at most
 *            KVT_STORM_PER_SECOND a second if set), each one cudaMalloc (1 MiB) held at its _exit(0): a storm
 *            of exits of processes holding memory. KVT_STORM_EXEC=1: each child execs `workload once` instead
 *            (a new program loading the libraries, making that one call).
 *            No per-call manifest, one line instead: {"storm_children": N}.
 *   leader_exits  2 cudaMalloc (1 MiB); the main thread starts a thread and ends (pthread_exit). That
 *            thread, once the main one is a zombie, makes 3 cudaMalloc (1 MiB) and writes the
 *            manifest; the process ends with it (exit status 7).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>

#include "cuda_stub.h"
#include "manifest.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define TOO_BIG_BYTES (1ULL << 41) /* past the stub's 1 TiB limit: CUDA_ERROR_OUT_OF_MEMORY */
#define INVALID_POINTER ((void *)0xdead)

/* ---- one wrapper per API: make the call, record it ---- */

static void *runtime_malloc(size_t size_bytes) {
    void *pointer = NULL;
    int rc = cudaMalloc(&pointer, size_bytes);
    record_call("cudaMalloc", size_bytes, (uintptr_t)pointer, rc);
    return pointer;
}

/* size_bytes: the size of the allocation being freed, for the manifest. */
static void runtime_free(void *pointer, size_t size_bytes) {
    int rc = cudaFree(pointer);
    record_call("cudaFree", rc == 0 && pointer ? size_bytes : 0, (uintptr_t)pointer, rc);
}

static void *runtime_malloc_async(size_t size_bytes) {
    void *pointer = NULL;
    int rc = cudaMallocAsync(&pointer, size_bytes, NULL);
    record_call("cudaMallocAsync", size_bytes, (uintptr_t)pointer, rc);
    return pointer;
}

static void runtime_free_async(void *pointer, size_t size_bytes) {
    int rc = cudaFreeAsync(pointer, NULL);
    record_call("cudaFreeAsync", rc == 0 ? size_bytes : 0, (uintptr_t)pointer, rc);
}

static void *runtime_malloc_host(size_t size_bytes) {
    void *pointer = NULL;
    int rc = cudaMallocHost(&pointer, size_bytes);
    record_call("cudaMallocHost", size_bytes, (uintptr_t)pointer, rc);
    return pointer;
}

static void runtime_free_host(void *pointer, size_t size_bytes) {
    int rc = cudaFreeHost(pointer);
    record_call("cudaFreeHost", rc == 0 ? size_bytes : 0, (uintptr_t)pointer, rc);
}

static void runtime_malloc_managed(size_t size_bytes) {
    void *pointer = NULL;
    int rc = cudaMallocManaged(&pointer, size_bytes, cudaMemAttachGlobal);
    record_call("cudaMallocManaged", size_bytes, (uintptr_t)pointer, rc);
}

static void runtime_malloc_pitch(size_t width_bytes, size_t height) {
    void *pointer = NULL;
    size_t pitch_bytes = 0;
    int rc = cudaMallocPitch(&pointer, &pitch_bytes, width_bytes, height);
    /* Failed: the tracer can only know width * height. */
    size_t size_bytes = (rc == 0 ? pitch_bytes : width_bytes) * height;
    record_call("cudaMallocPitch", size_bytes, (uintptr_t)pointer, rc);
}

static void runtime_set_device(int device) {
    int rc = cudaSetDevice(device);
    if (rc == 0)
        thread_device = device;
    record_call_on(device, "cudaSetDevice", 0, 0, rc);
}

static CUdeviceptr driver_alloc(size_t size_bytes) {
    CUdeviceptr address = 0;
    int rc = cuMemAlloc_v2(&address, size_bytes);
    record_call("cuMemAlloc_v2", size_bytes, address, rc);
    return address;
}

static void driver_free(CUdeviceptr address, size_t size_bytes) {
    int rc = cuMemFree_v2(address);
    record_call("cuMemFree_v2", rc == 0 ? size_bytes : 0, address, rc);
}

/* ---- scenarios ---- */

static void scenario_counts(unsigned long n) {
    (void)n;
    void *device[23];
    for (int i = 0; i < 23; i++)
        device[i] = runtime_malloc((i + 1) * MiB);
    for (int i = 0; i < 19; i++)
        runtime_free(device[i], (i + 1) * MiB);

    void *async[7];
    for (int i = 0; i < 7; i++)
        async[i] = runtime_malloc_async((i + 1) * MiB);
    for (int i = 0; i < 7; i++)
        runtime_free_async(async[i], (i + 1) * MiB);

    for (int i = 0; i < 3; i++)
        runtime_malloc(TOO_BIG_BYTES);

    CUdeviceptr driver[11];
    for (int i = 0; i < 11; i++)
        driver[i] = driver_alloc((i + 1) * 4 * KiB);
    for (int i = 0; i < 5; i++)
        driver_free(driver[i], (i + 1) * 4 * KiB);

    void *host[5];
    for (int i = 0; i < 5; i++)
        host[i] = runtime_malloc_host((i + 1) * 4 * KiB);
    for (int i = 0; i < 3; i++)
        runtime_free_host(host[i], (i + 1) * 4 * KiB);

    for (int i = 0; i < 3; i++)
        runtime_malloc_managed((i + 1) * MiB);
    for (int i = 0; i < 2; i++)
        runtime_malloc_pitch(1000, 7);
    for (int i = 0; i < 2; i++)
        runtime_free(INVALID_POINTER, 0);
    runtime_free(NULL, 0);
}

/* A thread running `run`; the workload exits when one cannot be made. */
static pthread_t start_thread(void *(*run)(void *)) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, run, NULL) != 0) {
        perror("pthread_create");
        exit(1);
    }
    return thread;
}

static void *devices_thread(void *unused) {
    (void)unused;
    prctl(PR_SET_NAME, "kvt-dev-thread"); /* events carry the calling thread's name */
    runtime_set_device(2);
    for (int i = 0; i < 5; i++)
        runtime_malloc(2 * MiB);
    return NULL;
}

static void scenario_devices(unsigned long n) {
    (void)n;
    runtime_set_device(1);
    for (int i = 0; i < 3; i++)
        runtime_malloc(MiB);
    pthread_join(start_thread(devices_thread), NULL);
    prctl(PR_SET_NAME, "kvt-a-long-name");
    prctl(PR_SET_NAME, "short"); /* a shorter name over a longer one: nothing of the old one shows */
    for (int i = 0; i < 2; i++)
        runtime_malloc(MiB);
    runtime_set_device(9);
}

static CUmemGenericAllocationHandle vmm_create(size_t size_bytes, const CUmemAllocationProp *prop) {
    CUmemGenericAllocationHandle handle = 0;
    int rc = cuMemCreate(&handle, size_bytes, prop, 0);
    int device = prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop->location.id : -1;
    record_call_on(device, "cuMemCreate", size_bytes, handle, rc);
    return handle;
}

static void vmm_release(CUmemGenericAllocationHandle handle, size_t size_bytes) {
    int rc = cuMemRelease(handle);
    record_call("cuMemRelease", rc == 0 ? size_bytes : 0, handle, rc);
}

static void vmm_map(CUdeviceptr address, size_t size_bytes, CUmemGenericAllocationHandle handle) {
    int rc = cuMemMap(address, size_bytes, 0, handle, 0);
    record((struct call_record){.api = "cuMemMap", .size_bytes = size_bytes, .address = address,
                                .handle = handle, .has_handle = 1, .rc = rc,
                                .device = thread_device});
}

static void vmm_unmap(CUdeviceptr address, size_t size_bytes) {
    int rc = cuMemUnmap(address, size_bytes);
    record_call("cuMemUnmap", size_bytes, address, rc);
}

static void scenario_vmm(unsigned long n) {
    (void)n;
    const size_t reserve_bytes = 64 * MiB, chunk_bytes = 2 * MiB;
    CUdeviceptr base = 0;
    int rc = cuMemAddressReserve(&base, reserve_bytes, 0, 0, 0);
    record_call("cuMemAddressReserve", reserve_bytes, base, rc);

    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 3;
    CUmemGenericAllocationHandle handles[5];
    for (int i = 0; i < 5; i++)
        handles[i] = vmm_create(chunk_bytes, &prop);
    for (int i = 0; i < 5; i++)
        vmm_map(base + i * chunk_bytes, chunk_bytes, handles[i]);

    /* Released while mapped: the memory goes only when the last mapping of each goes. */
    vmm_release(handles[0], chunk_bytes);
    vmm_release(handles[1], chunk_bytes);
    vmm_unmap(base, 2 * chunk_bytes); /* one call over two mappings */
    vmm_unmap(base + 2 * chunk_bytes, chunk_bytes);
    vmm_release(handles[2], chunk_bytes); /* already unmapped: freed now */

    vmm_create(TOO_BIG_BYTES, &prop);
}

static void scenario_context(unsigned long n) {
    (void)n;
    runtime_set_device(0);
    for (int i = 0; i < 7; i++)
        runtime_malloc(MiB);

    const int context_device = 1;
    CUcontext context = NULL;
    int rc = cuCtxCreate_v2(&context, 0, context_device);
    int previous_device = thread_device;
    if (rc == 0)
        thread_device = context_device; /* cuCtxCreate makes the new context current */
    record_call_on(context_device, "cuCtxCreate_v2", 0, (uintptr_t)context, rc);

    for (int i = 0; i < 3; i++)
        driver_alloc(3 * MiB);

    rc = cuCtxDestroy_v2(context);
    if (rc == 0)
        thread_device = previous_device; /* the destroyed context is popped off this thread */
    record_call_on(context_device, "cuCtxDestroy_v2", 0, (uintptr_t)context, rc);
}

static void scenario_loop(unsigned long pairs) {
    /* KVT_LOOP_PAUSE_EVERY=K KVT_LOOP_PAUSE_MS=M: sleep M ms after every K pairs, so that a test
     * can send many events without a burst larger than a subscriber's queue.
     * KVT_LOOP_PAIRS_PER_SECOND=R: a steady offered load instead; pair i starts no earlier than
     * i / R seconds after the first (checked every 16 pairs; a late loop catches up unslept). */
    const char *every_text = getenv("KVT_LOOP_PAUSE_EVERY"), *pause_text = getenv("KVT_LOOP_PAUSE_MS");
    const char *rate_text = getenv("KVT_LOOP_PAIRS_PER_SECOND");
    unsigned long pause_every = every_text ? strtoul(every_text, NULL, 10) : 0;
    unsigned long pause_ms = pause_text ? strtoul(pause_text, NULL, 10) : 0;
    double pairs_per_second = rate_text ? strtod(rate_text, NULL) : 0.0;
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (unsigned long i = 0; i < pairs; i++) {
        if (pause_every && i && i % pause_every == 0)
            usleep(pause_ms * 1000);
        if (pairs_per_second > 0 && i % 16 == 0) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            double ahead_ns = i * 1e9 / pairs_per_second
                              - ((now.tv_sec - start.tv_sec) * 1e9 + (now.tv_nsec - start.tv_nsec));
            if (ahead_ns > 0) {
                struct timespec pause = {(time_t)(ahead_ns / 1e9), (long)((long long)ahead_ns % 1000000000LL)};
                nanosleep(&pause, NULL);
            }
        }
        void *pointer = NULL;
        if (cudaMalloc(&pointer, MiB) != 0 || cudaFree(pointer) != 0) {
            fprintf(stderr, "loop: a call failed at pair %lu\n", i);
            exit(1);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    double elapsed_ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
    printf("{\"loop_pairs\": %lu, \"ns_per_pair\": %.1f}\n", pairs,
           pairs ? elapsed_ns / pairs : 0.0);
}

static void scenario_leak(unsigned long count) {
    for (unsigned long i = 0; i < count; i++)
        runtime_malloc(MiB);
}

static void scenario_storm(unsigned long seconds) {
    const char *in_flight_text = getenv("KVT_STORM_IN_FLIGHT");
    const char *rate_text = getenv("KVT_STORM_PER_SECOND");
    unsigned long in_flight = in_flight_text ? strtoul(in_flight_text, NULL, 10) : 8, running = 0, children = 0;
    double per_second = rate_text ? strtod(rate_text, NULL) : 0.0;
    int exec_children = getenv("KVT_STORM_EXEC") != NULL;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        int over = now.tv_sec - start.tv_sec >= (time_t)seconds;
        if (over && running == 0)
            break;
        double ahead_ns = per_second > 0 ? children * 1e9 / per_second
                                               - ((now.tv_sec - start.tv_sec) * 1e9 + (now.tv_nsec - start.tv_nsec)) : 0;
        if (!over && running < in_flight && ahead_ns > 0 && running == 0) {
            struct timespec pause = {(time_t)(ahead_ns / 1e9), (long)((long long)ahead_ns % 1000000000LL)};
            nanosleep(&pause, NULL);
            continue;
        }
        if (!over && running < in_flight && ahead_ns <= 0) {
            pid_t child = fork();
            if (child == 0) {
                if (exec_children) {
                    execl("/proc/self/exe", "workload", "once", (char *)NULL);
                    _exit(127);
                }
                void *pointer = NULL;
                _exit(cudaMalloc(&pointer, MiB) == 0 ? 0 : 1);
            }
            if (child > 0) {
                running++;
                children++;
                continue;
            }
        }
        if (wait(NULL) > 0)
            running--;
    }
    printf("{\"storm_children\": %lu}\n", children);
}

static void scenario_hold(unsigned long n) {
    (void)n;
    for (int i = 0; i < 13; i++)
        runtime_malloc(MiB);
}

/* Whether thread `tid` of this process has ended (a zombie, or gone). */
static int thread_ended(pid_t tid) {
    char path[64], stat[256];
    snprintf(path, sizeof(path), "/proc/self/task/%d/stat", (int)tid);
    FILE *file = fopen(path, "r");
    if (!file)
        return 1;
    size_t length = fread(stat, 1, sizeof(stat) - 1, file);
    fclose(file);
    stat[length] = '\0';
    const char *state = strrchr(stat, ')'); /* "pid (comm) S ...": the name may hold spaces */
    return state && state[1] == ' ' && (state[2] == 'Z' || state[2] == 'X');
}

static void *leader_exits_thread(void *unused) {
    (void)unused;
    for (int tries = 0; !thread_ended(getpid()); tries++) {
        if (tries == 10000) {
            fprintf(stderr, "the main thread did not end\n");
            exit(1);
        }
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
    for (int i = 0; i < 3; i++)
        runtime_malloc(MiB);
    print_manifest();
    wait_for_line();
    exit(7); /* a status of its own: the exit event carries the last thread's */
}

static void scenario_leader_exits(unsigned long n) {
    (void)n;
    for (int i = 0; i < 2; i++)
        runtime_malloc(MiB);
    start_thread(leader_exits_thread);
    pthread_exit(NULL);
}

static const struct {
    const char *name;
    void (*run)(unsigned long n);
    int takes_n;
} scenarios[] = {
    {"counts", scenario_counts, 0}, {"devices", scenario_devices, 0}, {"vmm", scenario_vmm, 0},
    {"context", scenario_context, 0}, {"loop", scenario_loop, 1}, {"leak", scenario_leak, 1},
    {"hold", scenario_hold, 0}, {"leader_exits", scenario_leader_exits, 0},
    {"storm", scenario_storm, 1},
};

static void usage(void) {
    fprintf(stderr, "usage: workload counts|devices|vmm|context|hold|leader_exits|once | workload loop|leak|storm N\n");
    exit(2);
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "once") == 0) { /* a storm's exec'd child: no protocol, no manifest */
        void *pointer = NULL;
        return cudaMalloc(&pointer, MiB) == 0 ? 0 : 1;
    }
    if (argc < 2)
        usage();
    for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]); i++) {
        if (strcmp(argv[1], scenarios[i].name) != 0)
            continue;
        unsigned long n = 0;
        if (scenarios[i].takes_n) {
            char *end = NULL;
            if (argc != 3 || (n = strtoul(argv[2], &end, 10), *end != '\0' || end == argv[2]))
                usage();
        } else if (argc != 2) {
            usage();
        }
        announce_ready();
        wait_for_go();
        scenarios[i].run(n);
        print_manifest();
        wait_for_line();
        return 0;
    }
    usage();
}

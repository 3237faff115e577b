/* manifest.h — what the workloads share: the stdin/stdout protocol and the manifest of CUDA calls.
 *
 * Protocol: `ready <pid>` (the tracer attaches now), one line on stdin (go), the scenario runs,
 * then the manifest: one JSON object per CUDA call the program itself made (not the driver calls
 * the runtime makes inside it), then `done`; then the program waits for a line or EOF on stdin
 * and exits 0, so the tracer can look at it while it is still alive.
 *
 * A manifest line: {"api": "cudaMalloc", "size_bytes": N, "address": N, "rc": N, "device": N,
 * "tid": N} plus "handle": N for cuMemMap.
 *   address    the pointer/handle/context an allocation returned (0 when it failed), the argument
 *              of a free/release/unmap/destroy;
 *   size_bytes bytes the call asked for (cudaMallocPitch: pitch * height); for a free or release
 *              the size of the object it named (0 when the call failed or named NULL); the range
 *              for cuMemMap/cuMemUnmap; 0 for context calls;
 *   device     the device the calling thread had made current (cudaSetDevice, or cuCtxCreate_v2,
 *              which makes its context current), -1 when none; except calls that name a device
 *              themselves: cudaSetDevice and cuCtxCreate_v2 (the ordinal asked for, even when the
 *              call failed), cuCtxDestroy_v2 (the context's device), cuMemCreate
 *              (prop.location.id);
 *   tid        the calling thread (gettid).
 * The manifest is printed after the scenario, so no stdout I/O sits between the traced calls.
 * Include after defining _GNU_SOURCE (gettid). Header-only: each workload is a single file.
 */
#ifndef KVT_MANIFEST_H
#define KVT_MANIFEST_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

struct call_record {
    const char *api;
    unsigned long long size_bytes;
    unsigned long long address;
    unsigned long long handle; /* cuMemMap only */
    int has_handle;
    int rc;
    int device;
    int tid;
};

/* Several threads record (scenario `devices`). */
static pthread_mutex_t records_lock = PTHREAD_MUTEX_INITIALIZER;
static struct call_record *records;
static size_t record_count, record_capacity;

/* The device the calling thread made current; -1 until it sets one. */
static __thread int thread_device = -1;

static inline void record(struct call_record call) {
    call.tid = (int)gettid();
    pthread_mutex_lock(&records_lock);
    if (record_count == record_capacity) {
        record_capacity = record_capacity ? 2 * record_capacity : 256;
        records = realloc(records, record_capacity * sizeof(*records));
        if (records == NULL) {
            perror("realloc");
            exit(1);
        }
    }
    records[record_count++] = call;
    pthread_mutex_unlock(&records_lock);
}

/* A call about the calling thread's current device. */
static inline void record_call(const char *api, unsigned long long size_bytes,
                               unsigned long long address, int rc) {
    record((struct call_record){.api = api, .size_bytes = size_bytes, .address = address, .rc = rc,
                                .device = thread_device});
}

/* A call that names its device itself. */
static inline void record_call_on(int device, const char *api, unsigned long long size_bytes,
                                  unsigned long long address, int rc) {
    record((struct call_record){.api = api, .size_bytes = size_bytes, .address = address, .rc = rc,
                                .device = device});
}

static inline void print_manifest(void) {
    for (size_t i = 0; i < record_count; i++) {
        const struct call_record *call = &records[i];
        printf("{\"api\": \"%s\", \"size_bytes\": %llu, \"address\": %llu, \"rc\": %d, "
               "\"device\": %d, \"tid\": %d",
               call->api, call->size_bytes, call->address, call->rc, call->device, call->tid);
        if (call->has_handle)
            printf(", \"handle\": %llu", call->handle);
        printf("}\n");
    }
    printf("done\n");
    fflush(stdout);
}

static inline void announce_ready(void) {
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
}

/* Blocks until one line (or EOF) arrives on stdin; 0 at EOF. */
static inline int wait_for_line(void) {
    char *line = NULL;
    size_t capacity = 0;
    ssize_t length = getline(&line, &capacity, stdin);
    free(line);
    return length >= 0;
}

/* Blocks until the test says go; a closed stdin means the test gave up: exit without any call. */
static inline void wait_for_go(void) {
    if (!wait_for_line()) {
        fprintf(stderr, "stdin closed before go: no CUDA call made\n");
        exit(1);
    }
}

#endif

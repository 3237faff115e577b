/* hog.c — what an unprivileged user can run against the agent (issue 31): CUDA entry points of its own that
 * allocate nothing, and copies of libcudart by the dozen.
 *
 *   hog alloc DEVICES HUGE FILL   cudaSetDevice(d) and one cuMemAlloc_v2 of 1 MiB for each d < DEVICES, then
 *                                 cudaSetDevice(DEVICES), HUGE allocations of 2^62 bytes and FILL of 4 KiB, each
 *                                 at a made-up address of its own (nothing is allocated);
 *   hog libs PATH...              dlopen of each library (copies of the stub libcudart).
 * Protocol: prints "ready PID", waits for a line, does it, prints "done", holds everything until stdin closes.
 * Built by tests/integration/test_shares.py (-O0 -fno-inline: every entry point is a real call).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;

static CUdeviceptr next_address = 0x100000000000ULL;

int cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    (void)bytesize;
    *dptr = next_address;
    next_address += 4096;
    return 0;
}

int cuMemFree_v2(CUdeviceptr dptr) {
    (void)dptr;
    return 0;
}

int cudaSetDevice(int device) {
    (void)device;
    return 0; /* any ordinal */
}

static void wait_line(void) {
    char line[64];
    if (!fgets(line, sizeof(line), stdin))
        exit(0);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: hog alloc DEVICES HUGE FILL | hog libs PATH...\n");
        return 2;
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    wait_line();
    if (strcmp(argv[1], "alloc") == 0 && argc == 5) {
        long devices = atol(argv[2]), huge = atol(argv[3]), fill = atol(argv[4]);
        CUdeviceptr address;
        for (long d = 0; d < devices; d++) {
            cudaSetDevice((int)d);
            cuMemAlloc_v2(&address, 1 << 20);
        }
        cudaSetDevice((int)devices); /* one more: where the totals map is full, a key it has no room for */
        for (long i = 0; i < huge; i++)
            cuMemAlloc_v2(&address, 1ULL << 62);
        for (long i = 0; i < fill; i++)
            cuMemAlloc_v2(&address, 4096);
    } else if (strcmp(argv[1], "libs") == 0) {
        for (int i = 2; i < argc; i++) {
            if (!dlopen(argv[i], RTLD_NOW | RTLD_LOCAL)) {
                fprintf(stderr, "dlopen %s: %s\n", argv[i], dlerror());
                return 1;
            }
        }
    } else {
        return 2;
    }
    printf("done\n");
    fflush(stdout);
    while (fgetc(stdin) != EOF) {
    }
    return 0;
}

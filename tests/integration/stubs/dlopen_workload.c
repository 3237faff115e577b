/* dlopen_workload.c — loads a CUDA runtime only after the tracer has attached, for the integration
 * tests: discovery must notice a library mapped into a process it already knows.
 *
 * Usage: dlopen_workload PATH_TO_LIBCUDART. Prints `ready <pid>`, waits for a line on stdin, THEN
 * dlopen()s PATH (RTLD_NOW), prints `loaded`, waits for another line, and makes 17 cudaMalloc ((i+1) * 64 KiB) that it never frees; then the
 * manifest and `done` (format in manifest.h), and waits for a line or EOF before exiting 0.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>

#include "cuda_stub.h"
#include "manifest.h"

typedef cudaError_t (*cuda_malloc_fn)(void **devPtr, size_t size);
typedef cudaError_t (*cuda_free_fn)(void *devPtr);

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: dlopen_workload PATH_TO_LIBCUDART\n");
        return 2;
    }
    announce_ready();
    wait_for_go();

    void *library = dlopen(argv[1], RTLD_NOW);
    if (library == NULL) {
        fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 1;
    }
    /* Tell the test the library is mapped, and wait: the agent attaches to a newly mapped library
     * within a second, and the test measures that before letting the calls run. */
    printf("loaded\n");
    fflush(stdout);
    if (!wait_for_line())
        return 1;
    cuda_malloc_fn malloc_fn = (cuda_malloc_fn)dlsym(library, "cudaMalloc");
    /* Looked up only to check the library is a complete runtime; nothing is freed. */
    cuda_free_fn free_fn = (cuda_free_fn)dlsym(library, "cudaFree");
    if (malloc_fn == NULL || free_fn == NULL) {
        fprintf(stderr, "dlsym: %s\n", dlerror());
        return 1;
    }

    for (int i = 0; i < 17; i++) {
        size_t size_bytes = (size_t)(i + 1) * 65536;
        void *pointer = NULL;
        int rc = malloc_fn(&pointer, size_bytes);
        record_call("cudaMalloc", size_bytes, (uintptr_t)pointer, rc);
    }
    print_manifest();
    wait_for_line();
    return 0;
}

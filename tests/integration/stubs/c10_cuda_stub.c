/* c10_cuda_stub.c — a stub of PyTorch's CUDA caching allocator, built as libc10_cuda.so (the name
 * kvtrace looks for), for the integration tests of kvtrace's block-level (USDT) events.
 *
 * What it shares with torch 2.11's libc10_cuda.so, which is what kvtrace reads:
 *   - USDT probes, provider `pytorch`: `malloc(pointer, device as int8, size, stream id)` at one
 *     site and `free(pointer)` at two, each guarded by a semaphore in section .probes exactly as
 *     torch guards them (`if (semaphore) probe`): a uprobe on the site alone sees nothing until
 *     something raises the semaphore (the kernel does, given the uprobe's ref_ctr_offset);
 *   - the argument shapes torch's notes have, `-8@%rax -1@%dl -8@%r14 -8@-N(%rbp)` and
 *     `-8@%rdi`: signed types as torch's macros declare them, registers pinned with GCC local
 *     register variables (their documented use: asm operands), the stream id left in a
 *     volatile stack slot. Built with -O2 -fno-omit-frame-pointer so that slot is %rbp-relative
 *     memory; at -O0 gcc would load it into a register;
 *   - the allocator's shape: blocks carved from segments it cudaMalloc's, per (device, stream)
 *     pool, requests rounded up to 512 bytes; at most 1 MiB from 2 MiB segments (small pool),
 *     up to 10 MiB from 20 MiB segments, larger ones from a segment of their own rounded up to
 *     2 MiB; best fit over the pool's free space (smallest free range that fits, lowest address
 *     on ties); a freed block merges with free neighbours; segments are never given back.
 *     Unlike torch it always splits (no oversize blocks) and has no empty_cache.
 * The malloc probe reports the requested size (torch fires it in allocate() with the caller's
 * size), after the block is taken; free fires before the block is returned, for any pointer.
 * Segment "addresses" come from the stub libcuda's bump allocator: numbers, never dereferenced;
 * the books live in host memory here. Thread safe (one mutex, as torch's per-device one).
 *
 * <sys/sdt.h> is the vendored copy shipped with kvtrace's PyTorch hook (agent/kvtrace/sources/torch_hook/sdt.h,
 * systemtap 4.8, CC0, with its sdt-config.h; ../torch_stubs.py puts that directory on the include path).
 *
 * Build: gcc -shared -fPIC -O2 -fno-omit-frame-pointer -Wl,-soname,libc10_cuda.so
 *        -l:libcudart.so.12 (see ../torch_stubs.py).
 */
#define _SDT_HAS_SEMAPHORES 1
#include "sdt.h"

#include <pthread.h>
#include <stdlib.h>

#include "c10_cuda_stub.h"
#include "cuda_stub.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define MIN_BLOCK_BYTES 512ULL          /* kMinBlockSize */
#define SMALL_SIZE_BYTES (1 * MiB)      /* kSmallSize: largest small-pool request */
#define SMALL_BUFFER_BYTES (2 * MiB)    /* kSmallBuffer */
#define LARGE_BUFFER_BYTES (20 * MiB)   /* kLargeBuffer */
#define MIN_LARGE_ALLOC_BYTES (10 * MiB) /* kMinLargeAlloc */
#define ROUND_LARGE_BYTES (2 * MiB)     /* kRoundLarge */
#define MAX_SEGMENTS 1024

/* The semaphores: a u16 each in .probes, in the library's writable data, as torch's
 * TORCH_SDT_DEFINE_SEMAPHORE makes them. Hidden: only this library reads them, and the note
 * names them by address. Named as <sys/sdt.h> requires (provider_name_semaphore). */
__attribute__((section(".probes"), visibility("hidden"))) volatile unsigned short
    pytorch_malloc_semaphore;
__attribute__((section(".probes"), visibility("hidden"))) volatile unsigned short
    pytorch_free_semaphore;

#define PROBE_ENABLED(name) __builtin_expect(pytorch_##name##_semaphore != 0, 0)

struct chunk {
    unsigned long long address;
    unsigned long long size_bytes;
    int allocated;
    struct chunk *previous, *next; /* neighbours in the segment, by address */
};

struct segment {
    struct c10_stub_segment info;
    struct chunk *first;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct segment segments[MAX_SEGMENTS];
static int segment_count;

static unsigned long long round_up(unsigned long long value, unsigned long long multiple) {
    return (value + multiple - 1) / multiple * multiple;
}

static unsigned long long segment_bytes_for(unsigned long long block_bytes) {
    if (block_bytes <= SMALL_SIZE_BYTES)
        return SMALL_BUFFER_BYTES;
    if (block_bytes < MIN_LARGE_ALLOC_BYTES)
        return LARGE_BUFFER_BYTES;
    return round_up(block_bytes, ROUND_LARGE_BYTES);
}

/* The smallest free chunk of the pool that fits; NULL when none does. Caller holds the lock. */
static struct chunk *best_fit(int device, long stream, int small_pool,
                              unsigned long long block_bytes, struct segment **segment_out) {
    struct chunk *best = NULL;
    for (int i = 0; i < segment_count; i++) {
        struct segment *segment = &segments[i];
        if (segment->info.device != device || segment->info.stream != stream ||
            segment->info.small_pool != small_pool || segment->info.free_bytes < block_bytes)
            continue; /* (no free chunk of a segment that lacks the bytes can fit: the same answer) */
        for (struct chunk *chunk = segment->first; chunk != NULL; chunk = chunk->next) {
            if (chunk->allocated || chunk->size_bytes < block_bytes)
                continue;
            if (best == NULL || chunk->size_bytes < best->size_bytes ||
                (chunk->size_bytes == best->size_bytes && chunk->address < best->address)) {
                best = chunk;
                *segment_out = segment;
            }
        }
    }
    return best;
}

/* A new segment with one free chunk; NULL when cudaMalloc or the table fails. Caller holds the
 * lock. */
static struct chunk *new_segment(int device, long stream, int small_pool,
                                 unsigned long long segment_bytes) {
    if (segment_count == MAX_SEGMENTS)
        return NULL;
    void *address = NULL;
    if (cudaMalloc(&address, segment_bytes) != cudaSuccess)
        return NULL;
    struct chunk *chunk = calloc(1, sizeof(*chunk));
    if (chunk == NULL)
        abort();
    chunk->address = (unsigned long long)address;
    chunk->size_bytes = segment_bytes;
    struct segment *segment = &segments[segment_count++];
    segment->info = (struct c10_stub_segment){.address = (unsigned long long)address,
                                              .size_bytes = segment_bytes,
                                              .free_bytes = segment_bytes,
                                              .device = device,
                                              .stream = stream,
                                              .small_pool = small_pool};
    segment->first = chunk;
    return chunk;
}

/* Takes block_bytes from the start of a free chunk; the rest stays free. */
static void take(struct segment *segment, struct chunk *chunk, unsigned long long block_bytes) {
    if (chunk->size_bytes > block_bytes) {
        struct chunk *rest = calloc(1, sizeof(*rest));
        if (rest == NULL)
            abort();
        rest->address = chunk->address + block_bytes;
        rest->size_bytes = chunk->size_bytes - block_bytes;
        rest->previous = chunk;
        rest->next = chunk->next;
        if (chunk->next != NULL)
            chunk->next->previous = rest;
        chunk->next = rest;
        chunk->size_bytes = block_bytes;
    }
    chunk->allocated = 1;
    segment->info.free_bytes -= block_bytes;
}

static void *allocate(size_t size_bytes, int device, long stream) {
    unsigned long long block_bytes =
        size_bytes < MIN_BLOCK_BYTES ? MIN_BLOCK_BYTES : round_up(size_bytes, MIN_BLOCK_BYTES);
    int small_pool = block_bytes <= SMALL_SIZE_BYTES;
    pthread_mutex_lock(&lock);
    struct segment *segment = NULL;
    struct chunk *chunk = best_fit(device, stream, small_pool, block_bytes, &segment);
    if (chunk == NULL) {
        chunk = new_segment(device, stream, small_pool, segment_bytes_for(block_bytes));
        segment = chunk != NULL ? &segments[segment_count - 1] : NULL;
    }
    if (chunk != NULL)
        take(segment, chunk, block_bytes);
    pthread_mutex_unlock(&lock);
    return chunk != NULL ? (void *)chunk->address : NULL;
}

/* The live block at address; NULL when there is none. Caller holds the lock. */
static struct chunk *find_block(unsigned long long address, struct segment **segment_out) {
    for (int i = 0; i < segment_count; i++) {
        struct segment *segment = &segments[i];
        if (address < segment->info.address ||
            address >= segment->info.address + segment->info.size_bytes)
            continue;
        for (struct chunk *chunk = segment->first; chunk != NULL; chunk = chunk->next) {
            if (chunk->address == address && chunk->allocated) {
                *segment_out = segment;
                return chunk;
            }
        }
    }
    return NULL;
}

static void merge_with_next(struct chunk *chunk) {
    struct chunk *next = chunk->next;
    chunk->size_bytes += next->size_bytes;
    chunk->next = next->next;
    if (next->next != NULL)
        next->next->previous = chunk;
    free(next);
}

static int release(void *block) {
    pthread_mutex_lock(&lock);
    struct segment *segment = NULL;
    struct chunk *chunk = find_block((unsigned long long)block, &segment);
    if (chunk == NULL) {
        pthread_mutex_unlock(&lock);
        return -1;
    }
    chunk->allocated = 0;
    segment->info.free_bytes += chunk->size_bytes;
    if (chunk->next != NULL && !chunk->next->allocated)
        merge_with_next(chunk);
    if (chunk->previous != NULL && !chunk->previous->allocated)
        merge_with_next(chunk->previous);
    pthread_mutex_unlock(&lock);
    return 0;
}

/* ---- the probed entry points ---- */

KVT_STUB_API void *c10_stub_malloc(size_t size_bytes, int device, long stream) {
    if (size_bytes == 0)
        return NULL;
    void *block = allocate(size_bytes, device, stream);
    if (block == NULL)
        return NULL;
    if (PROBE_ENABLED(malloc)) {
        /* torch 2.11: -8@%rax -1@%dl -8@%r14 -8@-56(%rbp) (pointer, device, size, stream id). */
        register long pointer_arg asm("rax") = (long)block;
        register signed char device_arg asm("rdx") = (signed char)device;
        register long size_arg asm("r14") = (long)size_bytes;
        volatile long stream_arg = stream;
        STAP_PROBE4(pytorch, malloc, pointer_arg, device_arg, size_arg, stream_arg);
    }
    return block;
}

KVT_STUB_API int c10_stub_free(void *block) {
    if (PROBE_ENABLED(free)) {
        register long pointer_arg asm("rdi") = (long)block; /* torch: -8@%rdi */
        STAP_PROBE1(pytorch, free, pointer_arg);
    }
    return release(block);
}

KVT_STUB_API int c10_stub_raw_delete(void *block) {
    if (PROBE_ENABLED(free)) {
        register long pointer_arg asm("rdi") = (long)block;
        STAP_PROBE1(pytorch, free, pointer_arg);
    }
    return release(block);
}

KVT_STUB_API int c10_stub_semaphore_value(void) {
    return pytorch_malloc_semaphore;
}

KVT_STUB_API int c10_stub_free_semaphore_value(void) {
    return pytorch_free_semaphore;
}

/* ---- introspection ---- */

KVT_STUB_API int c10_stub_segment_count(void) {
    pthread_mutex_lock(&lock);
    int count = segment_count;
    pthread_mutex_unlock(&lock);
    return count;
}

KVT_STUB_API int c10_stub_get_segment(int index, struct c10_stub_segment *out) {
    pthread_mutex_lock(&lock);
    int found = index >= 0 && index < segment_count;
    if (found)
        *out = segments[index].info;
    pthread_mutex_unlock(&lock);
    return found ? 0 : -1;
}

KVT_STUB_API int c10_stub_block_info(const void *block, unsigned long long *segment_address,
                                     unsigned long long *block_size_bytes) {
    pthread_mutex_lock(&lock);
    struct segment *segment = NULL;
    struct chunk *chunk = find_block((unsigned long long)block, &segment);
    if (chunk != NULL) {
        *segment_address = segment->info.address;
        *block_size_bytes = chunk->size_bytes;
    }
    pthread_mutex_unlock(&lock);
    return chunk != NULL ? 0 : -1;
}

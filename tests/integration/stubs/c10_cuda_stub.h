/* c10_cuda_stub.h — the API of the stub PyTorch caching allocator (c10_cuda_stub.c, built as
 * libc10_cuda.so) that the torch workload calls. Not PyTorch's API: PyTorch's allocator is C++
 * and reached through at::Tensor; what matters to kvtrace is only what the stub shares with it,
 * the USDT probes pytorch:malloc and pytorch:free (see c10_cuda_stub.c).
 */
#ifndef KVT_C10_CUDA_STUB_H
#define KVT_C10_CUDA_STUB_H

#include <stddef.h>

/* Hands out a block of at least size_bytes from a segment of (device, stream), cudaMalloc'ing a
 * new segment when no free space fits; fires pytorch:malloc(block, device, size_bytes, stream)
 * while traced. The caller has made `device` current (cudaSetDevice), as c10 does. NULL for a
 * size of 0 (no probe) or when cudaMalloc fails. */
void *c10_stub_malloc(size_t size_bytes, int device, long stream);

/* Return a block: the two ways PyTorch frees (a tensor's deleter, local_raw_delete, and
 * CUDACachingAllocator::raw_delete), each its own pytorch:free probe site. The probe fires before
 * the lookup, as in PyTorch, so it fires for an unknown pointer too. 0, or -1 when the pointer is
 * not a live block. */
int c10_stub_free(void *block);
int c10_stub_raw_delete(void *block);

/* The semaphores PyTorch guards its probes with (the kernel counts tracers in them). */
int c10_stub_semaphore_value(void);      /* pytorch:malloc's */
int c10_stub_free_semaphore_value(void); /* pytorch:free's */

/* ---- introspection, for the workload's manifest ---- */

struct c10_stub_segment {
    unsigned long long address;
    unsigned long long size_bytes;
    unsigned long long free_bytes; /* not in a live block */
    int device;
    long stream;
    int small_pool; /* 1: a 2 MiB segment for blocks of at most 1 MiB */
};

/* Segments are never returned to CUDA (like the caching allocator without empty_cache), so
 * indexes are stable: 0 .. count - 1 in cudaMalloc order. */
int c10_stub_segment_count(void);
int c10_stub_get_segment(int index, struct c10_stub_segment *out); /* 0, or -1: no such index */

/* A live block's segment start and rounded size (the caching allocator rounds every request up
 * to 512 bytes). 0, or -1 when the pointer is not a live block. */
int c10_stub_block_info(const void *block, unsigned long long *segment_address,
                        unsigned long long *block_size_bytes);

#endif

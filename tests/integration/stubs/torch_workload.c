/* torch_workload.c — a program that allocates and frees a known set of blocks through the stub
 * PyTorch caching allocator (libc10_cuda.so, c10_cuda_stub.c), for the tests of kvtrace's
 * block-level events (USDT pytorch:malloc / pytorch:free) and of segment/block nesting.
 *
 * Usage: torch_workload SCENARIO [N]. Protocol as in manifest.h: `ready <pid>`, a line on stdin
 * (go), the scenario, the manifest, `done`, then wait for a line or EOF and exit 0.
 *
 * Manifest: one JSON object per line, in this order:
 *   {"kind": "semaphores", "malloc": N, "free": N}   the semaphores as the scenario starts (a
 *       tracer attached with ref_ctr_offset makes them non-zero; nothing tracing: 0 and 0);
 *   {"kind": "block", "address": N, "size_bytes": N, "block_size_bytes": N, "device": N,
 *    "stream": N, "segment": N, "freed": true|false, "free_site": "c10_stub_free" |
 *    "c10_stub_raw_delete" | null, "tid": N}   one per c10_stub_malloc, in call order:
 *       size_bytes as asked (what pytorch:malloc reports), block_size_bytes as rounded (what the
 *       block takes of its segment), segment the start of the segment holding it. An address
 *       appears twice when a later block reuses freed space (it does, by design);
 *   {"kind": "segment", "address": N, "size_bytes": N, "free_bytes": N, "device": N, "stream": N,
 *    "pool": "small" | "large"}   one per cudaMalloc the allocator made, in order, with the
 *       bytes not in live blocks at the end of the scenario (segments are never freed).
 * Scenarios:
 *   blocks  device 0 (never cudaSetDevice(0), like torch on one GPU), stream 0 unless said:
 *           20 blocks: 10 small (<= 1 MiB), 7 large (1-10 MiB), 2 huge (> 10 MiB, a segment
 *           each), 1 small on stream 35; 5 freed; 3 more that best fit puts in freed space
 *           (the 100352 B hole, the 8 MiB hole, the freed 12 MiB segment: three addresses
 *           appear twice); 2 more freed. 23 blocks, 7 freed (4 through c10_stub_free, 3 through
 *           c10_stub_raw_delete). Then cudaSetDevice(1) and 5 blocks on device 1, 2 freed (one
 *           through each site). In all 28 malloc and 9 free probe firings, 9 segments.
 *   loop N  N x (c10_stub_malloc 4 KiB + c10_stub_free), timed; no per-block manifest, one line
 *           after the semaphores instead: {"loop_pairs": N, "ns_per_pair": X}.
 *   hold N  N x c10_stub_malloc 512 B on device 0, all kept (bench/agent_memory.py --torch-blocks);
 *           one line after the semaphores: {"held": N, "segments": S}.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "c10_cuda_stub.h"
#include "cuda_stub.h"
#include "manifest.h"

#define KiB (1ULL << 10)
#define MiB (1ULL << 20)
#define MAX_BLOCKS 64
#define OTHER_STREAM 35L

struct block_record {
    void *address;
    unsigned long long size_bytes, block_size_bytes, segment;
    int device;
    long stream;
    const char *free_site; /* NULL while live */
    int tid;
};

static struct block_record blocks[MAX_BLOCKS];
static int block_count;
static int semaphore_malloc_at_start, semaphore_free_at_start;
static double loop_elapsed_ns;

/* Allocates and records; returns the index in blocks[]. */
static int block_malloc(unsigned long long size_bytes, int device, long stream) {
    void *address = c10_stub_malloc(size_bytes, device, stream);
    if (address == NULL || block_count == MAX_BLOCKS) {
        fprintf(stderr, "c10_stub_malloc(%llu, %d, %ld) failed\n", size_bytes, device, stream);
        exit(1);
    }
    struct block_record *block = &blocks[block_count];
    *block = (struct block_record){.address = address, .size_bytes = size_bytes, .device = device,
                                   .stream = stream, .tid = (int)gettid()};
    if (c10_stub_block_info(address, &block->segment, &block->block_size_bytes) != 0) {
        fprintf(stderr, "block %p unknown to the allocator right after malloc\n", address);
        exit(1);
    }
    return block_count++;
}

/* raw_delete: 1 frees through c10_stub_raw_delete, 0 through c10_stub_free. */
static void block_free(int index, int raw_delete) {
    struct block_record *block = &blocks[index];
    int rc = raw_delete ? c10_stub_raw_delete(block->address) : c10_stub_free(block->address);
    if (rc != 0 || block->free_site != NULL) {
        fprintf(stderr, "freeing block %d (%p) failed\n", index, block->address);
        exit(1);
    }
    block->free_site = raw_delete ? "c10_stub_raw_delete" : "c10_stub_free";
}

static void set_device(int device) {
    int rc = cudaSetDevice(device);
    if (rc != cudaSuccess) {
        fprintf(stderr, "cudaSetDevice(%d) returned %d\n", device, rc);
        exit(1);
    }
}

static void scenario_blocks(unsigned long n) {
    (void)n;
    /* Small pool (2 MiB segments): 10 blocks, about 3 MiB in all, so two segments. */
    static const unsigned long long small_bytes[10] = {
        1000, 4096, 65536, 100000, 256 * KiB, 500000, 1 * MiB, 2000, 300000, 700000,
    };
    int small[10];
    for (int i = 0; i < 10; i++)
        small[i] = block_malloc(small_bytes[i], 0, 0);
    /* Large pool (20 MiB segments): 7 blocks, about 29.5 MiB, so two segments. */
    static const unsigned long long large_bytes[7] = {
        3 * MiB / 2, 3 * MiB, 5 * MiB, 8 * MiB, 2 * MiB + 1, 4 * MiB, 6 * MiB,
    };
    int large[7];
    for (int i = 0; i < 7; i++)
        large[i] = block_malloc(large_bytes[i], 0, 0);
    /* Huge: a segment each, 12 MiB exactly and 34 MiB with 1 MiB - 512 B left free. */
    int huge_12 = block_malloc(12 * MiB, 0, 0);
    block_malloc(33 * MiB + 1, 0, 0);
    /* Another stream: a pool (and segment) of its own. */
    block_malloc(256 * KiB, 0, OTHER_STREAM);

    block_free(small[3], 0);   /* 100000 B: a 100352 B hole */
    block_free(large[1], 0);   /* 3 MiB */
    block_free(huge_12, 0);    /* the whole 12 MiB segment is free */
    block_free(small[1], 1);   /* 4096 B */
    block_free(large[3], 1);   /* 8 MiB */

    int reused_small = block_malloc(90000, 0, 0); /* best fit: the 100352 B hole */
    block_malloc(7 * MiB, 0, 0);                  /* best fit: the 8 MiB hole */
    block_malloc(12 * MiB, 0, 0);                 /* the free 12 MiB segment, no cudaMalloc */

    block_free(small[6], 1);     /* 1 MiB */
    block_free(reused_small, 0); /* 90000 B */

    set_device(1);
    static const unsigned long long device1_bytes[5] = {4 * KiB, 64 * KiB, 2 * MiB, 2 * MiB,
                                                        16 * MiB};
    int device1[5];
    for (int i = 0; i < 5; i++)
        device1[i] = block_malloc(device1_bytes[i], 1, 0);
    block_free(device1[1], 0);
    block_free(device1[4], 1);
}

static void print_blocks_and_segments(void) {
    for (int i = 0; i < block_count; i++) {
        const struct block_record *block = &blocks[i];
        printf("{\"kind\": \"block\", \"address\": %llu, \"size_bytes\": %llu, "
               "\"block_size_bytes\": %llu, \"device\": %d, \"stream\": %ld, \"segment\": %llu, "
               "\"freed\": %s, \"free_site\": ",
               (unsigned long long)(uintptr_t)block->address, block->size_bytes,
               block->block_size_bytes, block->device, block->stream, block->segment,
               block->free_site ? "true" : "false");
        if (block->free_site)
            printf("\"%s\"", block->free_site);
        else
            printf("null");
        printf(", \"tid\": %d}\n", block->tid);
    }
    int count = c10_stub_segment_count();
    for (int i = 0; i < count; i++) {
        struct c10_stub_segment segment;
        if (c10_stub_get_segment(i, &segment) != 0)
            exit(1);
        printf("{\"kind\": \"segment\", \"address\": %llu, \"size_bytes\": %llu, "
               "\"free_bytes\": %llu, \"device\": %d, \"stream\": %ld, \"pool\": \"%s\"}\n",
               segment.address, segment.size_bytes, segment.free_bytes, segment.device,
               segment.stream, segment.small_pool ? "small" : "large");
    }
}

static void scenario_loop(unsigned long pairs) {
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (unsigned long i = 0; i < pairs; i++) {
        void *block = c10_stub_malloc(4 * KiB, 0, 0);
        if (block == NULL || c10_stub_free(block) != 0) {
            fprintf(stderr, "loop: a call failed at pair %lu\n", i);
            exit(1);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    loop_elapsed_ns = (end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec);
}

static void scenario_hold(unsigned long count) {
    for (unsigned long i = 0; i < count; i++) {
        if (c10_stub_malloc(512, 0, 0) == NULL) {
            fprintf(stderr, "hold: c10_stub_malloc failed at block %lu\n", i);
            exit(1);
        }
    }
}

static void usage(void) {
    fprintf(stderr, "usage: torch_workload blocks | torch_workload loop|hold N\n");
    exit(2);
}

int main(int argc, char **argv) {
    unsigned long n = 0;
    int loop = 0, hold = 0;
    if (argc == 2 && strcmp(argv[1], "blocks") == 0) {
        loop = 0;
    } else if (argc == 3 && (strcmp(argv[1], "loop") == 0 || strcmp(argv[1], "hold") == 0)) {
        char *end = NULL;
        n = strtoul(argv[2], &end, 10);
        if (*end != '\0' || end == argv[2])
            usage();
        loop = strcmp(argv[1], "loop") == 0;
        hold = !loop;
    } else {
        usage();
    }
    announce_ready();
    wait_for_go();
    /* Read before the first probe site runs: whether a tracer had raised them by go. */
    semaphore_malloc_at_start = c10_stub_semaphore_value();
    semaphore_free_at_start = c10_stub_free_semaphore_value();
    if (loop)
        scenario_loop(n);
    else if (hold)
        scenario_hold(n);
    else
        scenario_blocks(n);
    printf("{\"kind\": \"semaphores\", \"malloc\": %d, \"free\": %d}\n", semaphore_malloc_at_start,
           semaphore_free_at_start);
    if (loop)
        printf("{\"loop_pairs\": %lu, \"ns_per_pair\": %.1f}\n", n,
               n ? loop_elapsed_ns / n : 0.0);
    else if (hold)
        printf("{\"held\": %lu, \"segments\": %d}\n", n, c10_stub_segment_count());
    else
        print_blocks_and_segments();
    printf("done\n");
    fflush(stdout);
    wait_for_line();
    return 0;
}

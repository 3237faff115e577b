/* cuda_stub.c — a fake CUDA driver, built as libcuda.so.1, for the integration tests (no GPU here).
 *
 * The tests attach uprobes to these exported symbols and compare what the tracer saw with the
 * manifest the workload prints, so the behaviour is small and fully deterministic:
 *   - allocations come from bump allocators (device 0x7f1000000000, host 0x7e1000000000, address
 *     reservations 0x7d1000000000), every one rounded up to 2 MiB (at least one 2 MiB granule, so
 *     addresses stay unique); VMM handles count up from 0x1000;
 *   - a size >= 1 TiB fails with CUDA_ERROR_OUT_OF_MEMORY and writes no out-parameter;
 *   - freeing/releasing/unmapping address or handle 0xdead fails with CUDA_ERROR_INVALID_VALUE;
 *     every other free succeeds (no table of live objects: the tracer keeps the books, not us);
 *   - cuDevicePrimaryCtxRetain returns context 0xc0000 + dev * 0x100, cuCtxCreate_v2 0xd0000 +
 *     dev * 0x100; ordinals outside 0..7 fail with CUDA_ERROR_INVALID_DEVICE.
 * The "addresses" are only numbers: nothing is mapped, nothing may dereference them.
 * Thread safe: the bump pointers move with __atomic builtins.
 *
 * KVT_STUB_LOG=1 in the environment makes every call write "driver <api> <rc>" to stderr, so that
 * the self-check can see which driver calls the runtime stub made on the workload's behalf.
 *
 * Build: gcc -shared -fPIC -O0 -fno-inline -Wl,-soname,libcuda.so.1 (see ../cuda_stubs.py).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_stub.h"

#define GRANULE_BYTES (2ULL << 20)
#define OUT_OF_MEMORY_BYTES (1ULL << 40)
#define INVALID_ADDRESS 0xdeadULL
#define PITCH_ALIGNMENT_BYTES 512ULL

static unsigned long long next_device_address = 0x7f1000000000ULL;
static unsigned long long next_host_address = 0x7e1000000000ULL;
static unsigned long long next_reserved_address = 0x7d1000000000ULL;
static unsigned long long next_handle = 0x1000ULL;

/* -1: KVT_STUB_LOG not read yet. */
static int log_enabled = -1;

static CUresult logged(const char *api, CUresult rc) {
    int enabled = __atomic_load_n(&log_enabled, __ATOMIC_RELAXED);
    if (enabled < 0) {
        const char *value = getenv("KVT_STUB_LOG");
        enabled = value != NULL && strcmp(value, "1") == 0;
        __atomic_store_n(&log_enabled, enabled, __ATOMIC_RELAXED);
    }
    if (enabled)
        fprintf(stderr, "driver %s %d\n", api, rc);
    return rc;
}

/* Takes size_bytes (rounded up to whole granules) from *next; returns the start. */
static unsigned long long bump(unsigned long long *next, unsigned long long size_bytes) {
    unsigned long long span_bytes = (size_bytes + GRANULE_BYTES - 1) & ~(GRANULE_BYTES - 1);
    if (span_bytes == 0)
        span_bytes = GRANULE_BYTES;
    return __atomic_fetch_add(next, span_bytes, __ATOMIC_RELAXED);
}

static CUresult allocate(unsigned long long *next, unsigned long long *out, size_t size_bytes) {
    if (out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (size_bytes >= OUT_OF_MEMORY_BYTES)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = bump(next, size_bytes);
    return CUDA_SUCCESS;
}

static CUresult allocate_host(void **out, size_t size_bytes) {
    unsigned long long address = 0;
    if (out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = allocate(&next_host_address, &address, size_bytes);
    if (rc == CUDA_SUCCESS)
        *out = (void *)address;
    return rc;
}

static CUresult release(unsigned long long address_or_handle) {
    return address_or_handle == INVALID_ADDRESS ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

static CUresult context_for(CUcontext *out, CUdevice dev, unsigned long long base) {
    if (out == NULL)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= KVT_STUB_DEVICE_COUNT)
        return CUDA_ERROR_INVALID_DEVICE;
    *out = (CUcontext)(base + (unsigned long long)dev * 0x100);
    return CUDA_SUCCESS;
}

/* ---- device, managed and host memory ---- */

KVT_STUB_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    return logged(__func__, allocate(&next_device_address, dptr, bytesize));
}

KVT_STUB_API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    return logged(__func__, release(dptr));
}

KVT_STUB_API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    (void)hStream;
    return logged(__func__, allocate(&next_device_address, dptr, bytesize));
}

KVT_STUB_API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    (void)hStream;
    return logged(__func__, release(dptr));
}

KVT_STUB_API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return logged(__func__, allocate(&next_device_address, dptr, bytesize));
}

/* The pitch is the row width rounded up to 512 bytes; the allocation is pitch * Height bytes. */
KVT_STUB_API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                         size_t Height, unsigned int ElementSizeBytes) {
    (void)ElementSizeBytes;
    if (dptr == NULL || pPitch == NULL)
        return logged(__func__, CUDA_ERROR_INVALID_VALUE);
    unsigned long long pitch_bytes =
        (WidthInBytes + PITCH_ALIGNMENT_BYTES - 1) & ~(PITCH_ALIGNMENT_BYTES - 1);
    /* Compared by division so that a huge width * height cannot wrap around. */
    if (Height != 0 && pitch_bytes >= OUT_OF_MEMORY_BYTES / Height)
        return logged(__func__, CUDA_ERROR_OUT_OF_MEMORY);
    CUresult rc = allocate(&next_device_address, dptr, pitch_bytes * Height);
    if (rc == CUDA_SUCCESS)
        *pPitch = pitch_bytes;
    return logged(__func__, rc);
}

KVT_STUB_API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) {
    return logged(__func__, allocate_host(pp, bytesize));
}

KVT_STUB_API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    (void)Flags;
    return logged(__func__, allocate_host(pp, bytesize));
}

KVT_STUB_API CUresult cuMemFreeHost(void *p) {
    return logged(__func__, release((unsigned long long)p));
}

/* ---- contexts ---- */

KVT_STUB_API CUresult cuCtxSetCurrent(CUcontext ctx) {
    (void)ctx;
    return logged(__func__, CUDA_SUCCESS);
}

KVT_STUB_API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (ctx == NULL)
        return logged(__func__, CUDA_ERROR_INVALID_VALUE);
    return logged(__func__, release((unsigned long long)ctx));
}

KVT_STUB_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    return logged(__func__, context_for(pctx, dev, 0xc0000ULL));
}

KVT_STUB_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return logged(__func__, context_for(pctx, dev, 0xd0000ULL));
}

/* ---- virtual memory management ---- */

KVT_STUB_API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                  const CUmemAllocationProp *prop, unsigned long long flags) {
    (void)flags;
    if (handle == NULL || prop == NULL)
        return logged(__func__, CUDA_ERROR_INVALID_VALUE);
    if (size >= OUT_OF_MEMORY_BYTES)
        return logged(__func__, CUDA_ERROR_OUT_OF_MEMORY);
    *handle = __atomic_fetch_add(&next_handle, 1, __ATOMIC_RELAXED);
    return logged(__func__, CUDA_SUCCESS);
}

KVT_STUB_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    return logged(__func__, release(handle));
}

KVT_STUB_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                               CUmemGenericAllocationHandle handle, unsigned long long flags) {
    (void)size;
    (void)offset;
    (void)flags;
    if (ptr == INVALID_ADDRESS || handle == INVALID_ADDRESS)
        return logged(__func__, CUDA_ERROR_INVALID_VALUE);
    return logged(__func__, CUDA_SUCCESS);
}

KVT_STUB_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    (void)size;
    return logged(__func__, release(ptr));
}

/* alignment and the addr hint are ignored: every reservation is 2 MiB aligned, which is all the
 * tests need. */
KVT_STUB_API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                          CUdeviceptr addr, unsigned long long flags) {
    (void)alignment;
    (void)addr;
    (void)flags;
    return logged(__func__, allocate(&next_reserved_address, ptr, size));
}

KVT_STUB_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    (void)size;
    return logged(__func__, release(ptr));
}

/* cuda_stub.h — the part of the CUDA driver and runtime API that the test stubs implement.
 *
 * Signatures are the real ones with the types reduced to their ABI equivalents, so the probes read
 * arguments exactly where they would in libcuda/libcudart. Included by cuda_stub.c, cudart_stub.c
 * and the workloads; not a CUDA header, nothing outside tests/integration uses it.
 */
#ifndef KVT_CUDA_STUB_H
#define KVT_CUDA_STUB_H

#include <stddef.h>

/* Every stub API is a real out-of-line exported function so that a uprobe on its symbol fires on
 * every call, also when the caller sits in the same object (workload_static). */
#define KVT_STUB_API __attribute__((noinline, used, visibility("default")))

/* ---- driver API ---- */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;
typedef int CUdevice;
typedef unsigned long long CUmemGenericAllocationHandle;

/* The real layout: the probe of cuMemCreate reads location {type, id} at byte offset 8. */
typedef struct {
    int type;                 /* CUmemAllocationType: 1 = pinned */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    struct {
        int type; /* CUmemLocationType: 1 = device */
        int id;   /* device ordinal when type is 1 */
    } location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

_Static_assert(offsetof(CUmemAllocationProp, location.type) == 8, "location.type at 8");
_Static_assert(offsetof(CUmemAllocationProp, location.id) == 12, "location.id at 12");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_INVALID_DEVICE 101
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1

/* The stubs pretend to have this many GPUs: ordinals 0..7. */
#define KVT_STUB_DEVICE_COUNT 8

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                            unsigned int ElementSizeBytes);
CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
CUresult cuMemFreeHost(void *p);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);

/* ---- runtime API ---- */
typedef int cudaError_t;
typedef void *cudaStream_t;

#define cudaSuccess 0
#define cudaErrorInvalidValue 1
#define cudaErrorMemoryAllocation 2
#define cudaErrorInvalidDevice 101
#define cudaErrorUnknown 999
#define cudaMemAttachGlobal 1
#define cudaHostAllocDefault 0

cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaFree(void *devPtr);
cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream);
cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream);
cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags);
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaMallocPitch(void **devPtr, size_t *pitch, size_t width, size_t height);
cudaError_t cudaSetDevice(int device);

#endif

/* cudart_stub.c — a fake CUDA runtime, built as libcudart.so.12, for the integration tests.
 *
 * Each runtime call forwards to the driver call the real runtime makes underneath (cudaMalloc ->
 * cuMemAlloc_v2, cudaSetDevice -> cuDevicePrimaryCtxRetain + cuCtxSetCurrent, ...), through
 * libcuda.so.1's exported symbols, so a tracer with probes on both libraries sees both layers for
 * one call, as it would on a real host. Out-parameters are written only on success.
 * Two calls stop here without reaching the driver, like the real runtime: cudaFree(NULL)
 * (success) and cudaSetDevice with an ordinal outside 0..7 (cudaErrorInvalidDevice).
 *
 * Build: gcc -shared -fPIC -O0 -fno-inline -Wl,-soname,libcudart.so.12 -L<dir> -l:libcuda.so.1
 *        -Wl,-rpath,'$ORIGIN' (see ../cuda_stubs.py).
 */
#include "cuda_stub.h"

static cudaError_t runtime_error(CUresult rc) {
    switch (rc) {
    case CUDA_SUCCESS:
        return cudaSuccess;
    case CUDA_ERROR_INVALID_VALUE:
        return cudaErrorInvalidValue;
    case CUDA_ERROR_OUT_OF_MEMORY:
        return cudaErrorMemoryAllocation;
    case CUDA_ERROR_INVALID_DEVICE:
        return cudaErrorInvalidDevice;
    default:
        return cudaErrorUnknown;
    }
}

/* Runs a driver allocation into a local so that *out is left alone when it fails. */
#define FORWARD_ALLOC(out, driver_call_with_address)                                               \
    do {                                                                                           \
        if ((out) == NULL)                                                                         \
            return cudaErrorInvalidValue;                                                          \
        CUdeviceptr address = 0;                                                                   \
        CUresult rc = driver_call_with_address;                                                    \
        if (rc == CUDA_SUCCESS)                                                                    \
            *(out) = (void *)address;                                                              \
        return runtime_error(rc);                                                                  \
    } while (0)

KVT_STUB_API cudaError_t cudaMalloc(void **devPtr, size_t size) {
    FORWARD_ALLOC(devPtr, cuMemAlloc_v2(&address, size));
}

KVT_STUB_API cudaError_t cudaFree(void *devPtr) {
    if (devPtr == NULL)
        return cudaSuccess; /* no-op; real code calls it to create the context */
    return runtime_error(cuMemFree_v2((CUdeviceptr)devPtr));
}

KVT_STUB_API cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t hStream) {
    FORWARD_ALLOC(devPtr, cuMemAllocAsync(&address, size, hStream));
}

KVT_STUB_API cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream) {
    return runtime_error(cuMemFreeAsync((CUdeviceptr)devPtr, hStream));
}

KVT_STUB_API cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags) {
    FORWARD_ALLOC(devPtr, cuMemAllocManaged(&address, size, flags));
}

KVT_STUB_API cudaError_t cudaMallocHost(void **ptr, size_t size) {
    if (ptr == NULL)
        return cudaErrorInvalidValue;
    void *host = NULL;
    CUresult rc = cuMemAllocHost_v2(&host, size);
    if (rc == CUDA_SUCCESS)
        *ptr = host;
    return runtime_error(rc);
}

KVT_STUB_API cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags) {
    if (pHost == NULL)
        return cudaErrorInvalidValue;
    void *host = NULL;
    CUresult rc = cuMemHostAlloc(&host, size, flags);
    if (rc == CUDA_SUCCESS)
        *pHost = host;
    return runtime_error(rc);
}

KVT_STUB_API cudaError_t cudaFreeHost(void *ptr) {
    return runtime_error(cuMemFreeHost(ptr));
}

KVT_STUB_API cudaError_t cudaMallocPitch(void **devPtr, size_t *pitch, size_t width, size_t height) {
    if (devPtr == NULL || pitch == NULL)
        return cudaErrorInvalidValue;
    CUdeviceptr address = 0;
    size_t pitch_bytes = 0;
    /* The runtime passes element size 4 (a word) to the driver; the stub ignores it anyway. */
    CUresult rc = cuMemAllocPitch_v2(&address, &pitch_bytes, width, height, 4);
    if (rc == CUDA_SUCCESS) {
        *devPtr = (void *)address;
        *pitch = pitch_bytes;
    }
    return runtime_error(rc);
}

KVT_STUB_API cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= KVT_STUB_DEVICE_COUNT)
        return cudaErrorInvalidDevice;
    CUcontext context = NULL;
    CUresult rc = cuDevicePrimaryCtxRetain(&context, device);
    if (rc == CUDA_SUCCESS)
        rc = cuCtxSetCurrent(context);
    return runtime_error(rc);
}

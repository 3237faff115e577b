// A stand-in for torch's c10/cuda/CUDACachingAllocator.h with only what kvtrace's PyTorch hook
// (agent/kvtrace/sources/torch_hook/hook.cpp) uses, under torch 2.11's names and with TraceEntry's fields, so that
// the hook builds and runs here without torch (tests/integration/test_torch_hook.py). The allocator behind it is
// fake_c10_cuda.cpp: a test fires events with fake_allocator_event().
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

namespace c10 {
using DeviceIndex = int8_t;
namespace CachingDeviceAllocator {
struct TraceEntry {
  enum Action { ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP,
                SNAPSHOT, OOM };
  Action action_;
  DeviceIndex device_;
  size_t addr_;
  void* stream_{};
  size_t size_;
};
using AllocatorTraceTracker = std::function<void(const TraceEntry&)>;
}  // namespace CachingDeviceAllocator
namespace cuda::CUDACachingAllocator {
using c10::CachingDeviceAllocator::AllocatorTraceTracker;
void attachAllocatorTraceTracker(AllocatorTraceTracker tracker);
struct CUDAAllocator {
  virtual ~CUDAAllocator() = default;
  virtual bool initialized() = 0;  // torch: false until CUDA's lazy init made the per-device allocators
};
CUDAAllocator* get();
}  // namespace cuda::CUDACachingAllocator
}  // namespace c10

extern "C" void fake_allocator_set_initialized(int initialized);  // default 1
extern "C" void fake_allocator_refuse_trackers(int refuse);        // default 0
extern "C" void fake_allocator_event(int action, uint64_t address, uint64_t size_bytes, int device, uint64_t stream);

// The fake caching allocator behind CUDACachingAllocator.h here: it keeps the trackers attached and calls each
// with the events a test fires, as torch's record_trace does (built as the fake torch's lib/libc10_cuda.so).
#include "c10/cuda/CUDACachingAllocator.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace {
std::recursive_mutex allocator_mutex;  // torch calls the trackers with its allocator's mutex held
std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers;
std::atomic<bool> initialized_now{true};
std::atomic<bool> refuse_trackers{false};  // as cudaMallocAsync's backend, whose attachAllocatorTraceTracker throws

struct FakeAllocator : c10::cuda::CUDACachingAllocator::CUDAAllocator {
  bool initialized() override { return initialized_now.load(); }
} fake_allocator;
}  // namespace

namespace c10::cuda::CUDACachingAllocator {
void attachAllocatorTraceTracker(AllocatorTraceTracker tracker) {
  if (refuse_trackers.load())
    throw std::runtime_error("this allocator does not support attachAllocatorTraceTracker");
  std::lock_guard<std::recursive_mutex> guard(allocator_mutex);
  trackers.push_back(std::move(tracker));
}
CUDAAllocator* get() {
  return &fake_allocator;
}
}  // namespace c10::cuda::CUDACachingAllocator

extern "C" void fake_allocator_refuse_trackers(int refuse) {
  refuse_trackers = refuse != 0;
}

extern "C" void fake_allocator_set_initialized(int initialized) {
  initialized_now = initialized != 0;
}

extern "C" void fake_allocator_event(int action, uint64_t address, uint64_t size_bytes, int device, uint64_t stream) {
  std::lock_guard<std::recursive_mutex> guard(allocator_mutex);
  c10::CachingDeviceAllocator::TraceEntry entry{};
  entry.action_ = static_cast<c10::CachingDeviceAllocator::TraceEntry::Action>(action);
  entry.device_ = static_cast<c10::DeviceIndex>(device);
  entry.addr_ = address;
  entry.size_ = size_bytes;
  entry.stream_ = reinterpret_cast<void*>(stream);
  for (const auto& tracker : trackers)
    tracker(entry);
}

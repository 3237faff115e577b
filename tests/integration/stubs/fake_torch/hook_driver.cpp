// A process that loads kvtrace's PyTorch hook over the fake allocator and fires block events on command
// (tests/integration/test_torch_hook.py). Lines on stdin, one answer line (JSON) each on stdout:
//   attach                      kvtrace_hook_attach()
//   arm                         kvtrace_hook_arm(): attached once the semaphore is up and the allocator initialised
//   attached                    whether the tracker is attached
//   initialized 0|1             the fake allocator's initialized()
//   refuse 0|1                  whether the fake allocator refuses trackers (as cudaMallocAsync's does)
//   blocks N SIZE [DEVICE]      N allocations of SIZE bytes at distinct addresses, then their N frees, each free
//                               as torch reports one (FREE_REQUESTED, then FREE_COMPLETED), a segment event between
//   keep N SIZE [DEVICE]        N allocations of SIZE bytes that stay (no free)
//   settings SAMPLE_BYTES BATCH [FLUSH_INTERVAL_MS]  the hook's settings, written in this process
//   sample_bytes                the hook's sample size now (the agent writes it from outside)
//   counts                      the hook's counts
//   semaphore                   the hook's semaphore (the kernel raises it while a probe is on the flush function)
//   exit
// argv[1]: the hook library. The first line out is {"ready": true, "pid": PID}.
#include "c10/cuda/CUDACachingAllocator.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

struct Counts { uint64_t events, entries, flushes, walks, dropped; };
struct Settings { uint64_t sample_bytes; uint32_t batch; uint32_t flush_interval_ms; };

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: hook_driver HOOK_LIBRARY\n");
    return 2;
  }
  void* hook = dlopen(argv[1], RTLD_NOW);
  if (!hook) {
    std::fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  auto attach = reinterpret_cast<int (*)()>(dlsym(hook, "kvtrace_hook_attach"));
  auto arm = reinterpret_cast<int (*)()>(dlsym(hook, "kvtrace_hook_arm"));
  auto is_attached = reinterpret_cast<int (*)()>(dlsym(hook, "kvtrace_hook_attached"));
  auto read_counts = reinterpret_cast<void (*)(Counts*)>(dlsym(hook, "kvtrace_hook_read_counts"));
  auto settings = reinterpret_cast<volatile Settings*>(dlsym(hook, "kvtrace_hook_settings_now"));
  auto semaphore = reinterpret_cast<volatile uint16_t*>(dlsym(hook, "kvtrace_blocks_semaphore"));
  if (!attach || !arm || !is_attached || !read_counts || !settings || !semaphore) {
    std::fprintf(stderr, "the hook library lacks a symbol: %s\n", dlerror());
    return 1;
  }
  std::printf("{\"ready\": true, \"pid\": %d}\n", static_cast<int>(getpid()));
  std::fflush(stdout);
  using Entry = c10::CachingDeviceAllocator::TraceEntry;
  uint64_t next_address = 0x7f0000000000ULL;
  char line[256];
  while (std::fgets(line, sizeof line, stdin)) {
    char op[32] = {};
    unsigned long long a = 0, b = 0, c = 0;
    int fields = std::sscanf(line, "%31s %llu %llu %llu", op, &a, &b, &c);
    if (fields < 1)
      continue;
    if (!std::strcmp(op, "attach")) {
      std::printf("{\"attached\": %d}\n", attach());
    } else if (!std::strcmp(op, "arm")) {
      std::printf("{\"armed\": %d}\n", arm());
    } else if (!std::strcmp(op, "attached")) {
      std::printf("{\"attached\": %d}\n", is_attached());
    } else if (!std::strcmp(op, "refuse")) {
      fake_allocator_refuse_trackers(static_cast<int>(a));
      std::printf("{}\n");
    } else if (!std::strcmp(op, "initialized")) {
      fake_allocator_set_initialized(static_cast<int>(a));
      std::printf("{}\n");
    } else if (!std::strcmp(op, "blocks")) {
      uint64_t first = next_address;
      for (unsigned long long i = 0; i < a; i++)
        fake_allocator_event(Entry::ALLOC, first + i * b, b, static_cast<int>(c), 7);
      fake_allocator_event(Entry::SEGMENT_ALLOC, first + a * b, 1 << 21, static_cast<int>(c), 7);
      for (unsigned long long i = 0; i < a; i++) {
        fake_allocator_event(Entry::FREE_REQUESTED, first + i * b, b, static_cast<int>(c), 7);
        fake_allocator_event(Entry::FREE_COMPLETED, first + i * b, b, static_cast<int>(c), 7);
      }
      next_address = first + a * b + (1 << 21);
      std::printf("{\"first\": %" PRIu64 "}\n", first);
    } else if (!std::strcmp(op, "keep")) {
      uint64_t first = next_address;
      for (unsigned long long i = 0; i < a; i++)
        fake_allocator_event(Entry::ALLOC, first + i * b, b, static_cast<int>(c), 7);
      next_address = first + a * b;
      std::printf("{\"first\": %" PRIu64 "}\n", first);
    } else if (!std::strcmp(op, "sample_bytes")) {
      std::printf("{\"sample_bytes\": %" PRIu64 "}\n", static_cast<uint64_t>(settings->sample_bytes));
    } else if (!std::strcmp(op, "settings")) {
      settings->sample_bytes = a;
      settings->batch = static_cast<uint32_t>(b);
      if (fields >= 4)
        settings->flush_interval_ms = static_cast<uint32_t>(c);
      std::printf("{}\n");
    } else if (!std::strcmp(op, "counts")) {
      Counts counts{};
      read_counts(&counts);
      std::printf("{\"events\": %" PRIu64 ", \"entries\": %" PRIu64 ", \"flushes\": %" PRIu64
                  ", \"walks\": %" PRIu64 ", \"dropped\": %" PRIu64 "}\n",
                  counts.events, counts.entries, counts.flushes, counts.walks, counts.dropped);
    } else if (!std::strcmp(op, "semaphore")) {
      std::printf("{\"semaphore\": %u}\n", static_cast<unsigned>(*semaphore));
    } else if (!std::strcmp(op, "exit")) {
      std::printf("{}\n");
      std::fflush(stdout);
      return 0;
    } else {
      std::printf("{\"error\": \"unknown op %s\"}\n", op);
    }
    std::fflush(stdout);
  }
  return 0;
}

// hook.cpp — kvtrace's hook inside a PyTorch process: the caching allocator's blocks handed to the kernel in
// batches, so that a block costs a function call instead of two traps.
//
// Why: at depth `blocks` every tensor the caching allocator hands out and takes back fires pytorch:malloc and
// pytorch:free, and each is a uprobe trap (0.5-0.7 us on the H100, bench/RESULTS.md section K) before kvtrace's
// program runs. A generation loop makes about 44 blocks a token, so the trap alone took 4.7-7.9 % of the loop's CPU:
// no per-block trap can meet issue 34's 3 %. This hook registers with the allocator's own trace tracker
// (c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker, called for every allocator event whether or not
// PyTorch's history is recorded) and appends each block event to a buffer; the buffer goes to the kernel in one
// call of kvtrace_hook_flush(entries, count, sample_bytes), whose body is one USDT probe site, kvtrace:blocks, the
// place kvtrace's uprobe sits: one trap for many blocks. A USDT site is a `nop`, which the kernel's uprobes emulate;
// a uprobe on the function's own first instruction (a `ret`) cost 9 us a hit on the H100 VM instead of 0.7.
//
// Loading: a process loads the library and arms it (kvtrace_hook_arm): the tracker is attached when the agent first
// raises the process, so a process never raised pays nothing. Attaching at once (kvtrace_hook_attach) is for tests
// and benches. kvtrace_hook_state tells the agent where it is (armed, attached, refused by the allocator).
//
// Depth: kvtrace_blocks_semaphore is the site's semaphore, the uprobe's reference counter (ref_ctr_offset), raised by
// the kernel while the agent's link on the site is attached: zero means depth `segments`, and every event returns at
// its first comparison. The allocator has no way to detach a tracker, so attaching is for the life of the process.
//
// Stacks: a block whose stack is to be walked (sampled: the heap profilers' byte countdown of probes/usdt.h, which the
// kernel keeps per thread and the hook per process) is flushed at once, last in its batch and marked `walk`, so that
// the program walks the stack that is allocating it. Blocks of at least the sample size are always walked; a sample
// size of 0 walks every block. A batch carries the S its entries were drawn at (a new S flushes first).
//
// Order: entries of every thread go into one buffer under one lock, in the order the allocator reported them, so a
// block's free never reaches the kernel before its allocation. A buffer left partly full is flushed by a helper
// thread within about twice kvtrace_hook_settings.flush_interval_ms, or dropped if the semaphore went down.
//
// No PyTorch call is made from the tracker (the allocator's rule: its mutex is held), and no Python.
// Built against the process's own torch headers (kvtrace/sources/torch_hook/__init__.py).
#include <c10/cuda/CUDACachingAllocator.h>

#define _SDT_HAS_SEMAPHORES 1
#include "sdt.h"  // vendored systemtap <sys/sdt.h> (CC0), beside this file

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <new>
#include <thread>

#include <pthread.h>

extern "C" {

// One block event as the kernel reads it (probes/hook.h struct kvt_hook_entry: the same 32 bytes).
struct kvtrace_hook_entry {
  uint64_t address;
  uint64_t size_bytes;  // the block's size; for a free, the size it was allocated with
  uint64_t stream;      // the cudaStream_t the block belongs to
  uint8_t kind;         // KVTRACE_HOOK_ALLOC or KVTRACE_HOOK_FREE
  int8_t device;
  uint8_t walk;         // 1: this block's stack is walked (always the last entry of its batch)
  uint8_t reserved[5];
};
static_assert(sizeof(kvtrace_hook_entry) == 32, "the kernel reads 32-byte entries");

enum { KVTRACE_HOOK_ALLOC = 1, KVTRACE_HOOK_FREE = 2 };
// The most entries one flush carries (probes/hook.h KVT_HOOK_BATCH: the kernel takes them one tail call each, and a
// chain of tail calls stops at 33).
enum { KVTRACE_HOOK_BATCH_MAX = 32 };
// The sample size until the agent writes its own (the agent's default, --block-sample-bytes).
constexpr uint64_t KVTRACE_HOOK_SAMPLE_BYTES = 512 * 1024;

// The settings, read at each event: in .probes (file-backed, writable) so that the agent can find them by symbol
// and write them in a running process (/proc/PID/mem) as it raises the depth.
struct kvtrace_hook_settings {
  uint64_t sample_bytes;       // mean bytes between walked stacks (0: every block's stack)
  uint32_t batch;              // entries a flush carries, 1 .. KVTRACE_HOOK_BATCH_MAX
  uint32_t flush_interval_ms;  // a partly full buffer waits no longer than this
};

// Named as <sys/sdt.h> requires (provider_name_semaphore); in .probes, file-backed and writable, as torch's are.
__attribute__((section(".probes"), used, visibility("default")))
volatile unsigned short kvtrace_blocks_semaphore = 0;
__attribute__((section(".probes"), used, visibility("default")))
volatile kvtrace_hook_settings kvtrace_hook_settings_now = {KVTRACE_HOOK_SAMPLE_BYTES, KVTRACE_HOOK_BATCH_MAX, 100};

// Where the tracker is, for the agent (it reads this byte before it traces a process through the hook): a hook
// the allocator refused (cudaMallocAsync, a pluggable allocator) must not keep PyTorch's own sites off.
enum { KVTRACE_HOOK_LOADED = 0, KVTRACE_HOOK_ARMED = 1, KVTRACE_HOOK_ATTACHED = 2, KVTRACE_HOOK_REFUSED = 3 };
__attribute__((section(".probes"), used, visibility("default")))
volatile unsigned char kvtrace_hook_state = KVTRACE_HOOK_LOADED;

// What the hook has done, for tests and benches (never read by the kernel).
struct kvtrace_hook_counts {
  uint64_t events;   // block events heard while the semaphore was raised
  uint64_t entries;  // block entries flushed
  uint64_t flushes;  // calls of kvtrace_hook_flush
  uint64_t walks;    // entries marked walk
  uint64_t dropped;  // entries dropped because the semaphore went down before their flush
};

// The probe site the agent's uprobe is on, kvtrace:blocks(entries, count, sample_bytes): a nop and a note (its
// arguments' registers, its semaphore). sample_bytes is the S the walked entries were drawn at, so that the kernel
// records what the hook did. noipa keeps the compiler from removing the call or assuming what it does.
__attribute__((noipa, used, visibility("default")))
void kvtrace_hook_flush(const kvtrace_hook_entry* entries, uint32_t count, uint64_t sample_bytes) {
  STAP_PROBE3(kvtrace, blocks, entries, count, sample_bytes);
  asm volatile("" : : : "memory");
}

}  // extern "C"

namespace {

using c10::CachingDeviceAllocator::TraceEntry;

std::mutex buffer_lock;
kvtrace_hook_entry buffer[KVTRACE_HOOK_BATCH_MAX];
uint32_t buffered = 0;
std::chrono::steady_clock::time_point oldest;  // when the first entry of the buffer came
kvtrace_hook_counts counts = {};
std::atomic<bool> attached{false};
std::atomic<bool> armed{false};
std::atomic<bool> flusher_started{false};
std::atomic<bool> waiting{false};  // buffered != 0, readable without the lock (a hint, checked again under it)

// The sampling state, under buffer_lock like the buffer (so no thread-local storage, which costs a call a use in a
// dlopen'ed library): one byte countdown for the whole process. The points where it crosses zero are a Poisson
// process over the process's bytes, whichever thread allocates them, so the estimates stay unbiased.
uint64_t random_state = 0;
int64_t countdown = 0;
bool countdown_drawn = false;
uint64_t batch_sample_bytes = KVTRACE_HOOK_SAMPLE_BYTES;  // the S the buffered entries were drawn at (sent along)

// xorshift64*: the countdown's draws need no quality beyond independence from the sizes.
uint64_t next_random() {
  if (random_state == 0) {
    random_state = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                   0x9E3779B97F4A7C15ULL;
  }
  random_state ^= random_state >> 12;
  random_state ^= random_state << 25;
  random_state ^= random_state >> 27;
  return random_state * 0x2545F4914F6CDD1DULL;
}

// A draw of the exponential distribution of mean `mean` (bytes until the next walked block).
int64_t draw(uint64_t mean) {
  double uniform = (static_cast<double>(next_random() >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  return static_cast<int64_t>(-std::log(uniform) * static_cast<double>(mean));
}

// Whether the stack of a block of `size_bytes` is walked: the byte countdown of probes/usdt.h (buffer_lock held).
bool walked_locked(uint64_t size_bytes, uint64_t mean) {
  if (mean == 0 || size_bytes >= mean)
    return true;
  if (!countdown_drawn) {
    countdown = draw(mean);
    countdown_drawn = true;
  }
  countdown -= static_cast<int64_t>(size_bytes);
  if (countdown >= 0)
    return false;
  countdown = draw(mean);
  return true;
}

void flush_locked() {
  if (buffered == 0)
    return;
  kvtrace_hook_flush(buffer, buffered, batch_sample_bytes);
  counts.flushes += 1;
  counts.entries += buffered;
  buffered = 0;
  waiting.store(false, std::memory_order_relaxed);
}

// What waits for a link that went (the semaphore is down): never handed to a later one.
void drop_waiting() {
  std::lock_guard<std::mutex> guard(buffer_lock);
  if (kvtrace_blocks_semaphore != 0)
    return;
  counts.dropped += buffered;
  buffered = 0;
  waiting.store(false, std::memory_order_relaxed);
}

// Flushes a buffer left partly full by threads that stopped allocating; drops it when the semaphore went down.
void flusher() {
  for (;;) {
    uint32_t interval_ms = kvtrace_hook_settings_now.flush_interval_ms;
    std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms ? interval_ms : 100));
    if (kvtrace_blocks_semaphore == 0) {
      if (waiting.load(std::memory_order_relaxed))
        drop_waiting();
      continue;
    }
    std::lock_guard<std::mutex> guard(buffer_lock);
    if (buffered == 0)
      continue;
    if (std::chrono::steady_clock::now() - oldest >= std::chrono::milliseconds(interval_ms)) {
      flush_locked();
    }
  }
}

// In a forked child: a lock another thread of the parent held at the fork would never be let go, and what the
// buffer holds is the parent's. Both start afresh (no thread of the parent came along to use them).
void after_fork_in_child() {
  new (&buffer_lock) std::mutex();
  buffered = 0;
  waiting.store(false, std::memory_order_relaxed);
}
const int fork_handler_registered = pthread_atfork(nullptr, nullptr, after_fork_in_child);

// The flusher thread, once per process (and again in a forked child: kvtrace_hook_rearm_after_fork). Outside the
// allocator's lock: a thread that cannot be made leaves partial batches to the next full one.
void start_flusher() {
  if (flusher_started.exchange(true))
    return;
  try {
    std::thread(flusher).detach();
  } catch (...) {
    flusher_started = false;
  }
}

void on_trace(const TraceEntry& event) {
  if (__builtin_expect(kvtrace_blocks_semaphore == 0, 1)) {
    // Lowered with entries waiting: they belong to the link that went, not to a next one (dropped at the first
    // event after, or by the flusher).
    if (__builtin_expect(waiting.load(std::memory_order_relaxed), 0))
      drop_waiting();
    return;
  }
  uint8_t kind;
  if (event.action_ == TraceEntry::ALLOC)
    kind = KVTRACE_HOOK_ALLOC;
  else if (event.action_ == TraceEntry::FREE_COMPLETED)
    kind = KVTRACE_HOOK_FREE;
  else
    return;
  std::lock_guard<std::mutex> guard(buffer_lock);
  uint64_t sample_bytes = kvtrace_hook_settings_now.sample_bytes;
  uint32_t batch = kvtrace_hook_settings_now.batch;
  if (batch == 0 || batch > KVTRACE_HOOK_BATCH_MAX)
    batch = KVTRACE_HOOK_BATCH_MAX;
  if (sample_bytes != batch_sample_bytes) {  // the agent set another S: what was drawn at the old one goes first
    flush_locked();
    batch_sample_bytes = sample_bytes;
    countdown_drawn = false;
  }
  bool walk = kind == KVTRACE_HOOK_ALLOC && walked_locked(event.size_, sample_bytes);
  counts.events += 1;
  if (buffered == 0) {
    oldest = std::chrono::steady_clock::now();
    waiting.store(true, std::memory_order_relaxed);
  }
  kvtrace_hook_entry& entry = buffer[buffered++];
  entry.address = event.addr_;
  entry.size_bytes = event.size_;
  entry.stream = reinterpret_cast<uint64_t>(event.stream_);
  entry.kind = kind;
  entry.device = static_cast<int8_t>(event.device_);
  entry.walk = walk;
  if (walk)
    counts.walks += 1;
  if (walk || buffered >= batch)
    flush_locked();
}

}  // namespace

extern "C" {

// Registers the tracker with the caching allocator, once per process (later calls do nothing). Returns 0, or -1
// when the allocator refused (a PyTorch error: CUDA not initialised, or an allocator without trace trackers).
__attribute__((visibility("default"))) int kvtrace_hook_attach() {
  if (attached.exchange(true))
    return 0;
  try {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&on_trace);
  } catch (...) {
    attached = false;
    kvtrace_hook_state = KVTRACE_HOOK_REFUSED;
    return -1;
  }
  kvtrace_hook_state = KVTRACE_HOOK_ATTACHED;
  start_flusher();
  return 0;
}

// Attaches the tracker only once the agent first raises this process (its semaphore goes up) and the caching
// allocator is initialised (a tracker attached before that would be lost: the allocator keeps trackers per device).
// Until then a watcher thread reads the semaphore every 100 ms and the allocator pays nothing; from then on the
// tracker stays: while the process is at depth segments PyTorch still builds a TraceEntry for every allocator event
// and calls it (its idle cost, measured in bench/block_hook_cost.py). Returns 0 (idempotent).
__attribute__((visibility("default"))) int kvtrace_hook_arm() {
  if (armed.exchange(true) || attached.load())
    return 0;
  kvtrace_hook_state = KVTRACE_HOOK_ARMED;
  try {
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (kvtrace_blocks_semaphore == 0)
          continue;
        bool ready = false;
        try {
          auto* allocator = c10::cuda::CUDACachingAllocator::get();
          ready = allocator != nullptr && allocator->initialized();
        } catch (...) {
        }
        if (ready) {
          kvtrace_hook_attach();  // attached, or refused for good (its state says which): either way, done
          return;
        }
      }
    }).detach();
  } catch (...) {  // no thread to be had: not armed (the agent then uses PyTorch's own sites)
    armed = false;
    kvtrace_hook_state = KVTRACE_HOOK_LOADED;
    return -1;
  }
  return 0;
}

// In a forked child (the parent's threads do not come along): the watcher again, unless attached; and the flusher
// is started again by the next event.
__attribute__((visibility("default"))) void kvtrace_hook_rearm_after_fork() {
  flusher_started = false;
  if (attached.load())
    start_flusher();
  else if (armed.exchange(false))
    kvtrace_hook_arm();
}

// Whether the tracker is attached (tests, benches).
__attribute__((visibility("default"))) int kvtrace_hook_attached() {
  return attached.load() ? 1 : 0;
}

// Copies the hook's counts (tests and benches).
__attribute__((visibility("default"))) void kvtrace_hook_read_counts(kvtrace_hook_counts* out) {
  std::lock_guard<std::mutex> guard(buffer_lock);
  *out = counts;
}

// Flushes what is buffered now (tests and benches, before they read the counts).
__attribute__((visibility("default"))) void kvtrace_hook_flush_now() {
  std::lock_guard<std::mutex> guard(buffer_lock);
  if (kvtrace_blocks_semaphore != 0)
    flush_locked();
}

}  // extern "C"

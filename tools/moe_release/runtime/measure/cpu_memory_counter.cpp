// Copyright (c) 2026, moe-release contributors. All rights reserved.
//
// A counting CPU allocator for measuring megatron-core on hosts without a GPU: it wraps c10's
// CPU allocator and keeps, across all threads, the bytes currently allocated and the peak since
// the last reset -- the host counterpart of torch.cuda.memory_allocated/max_memory_allocated.
// Optionally it records (time, live bytes) after every allocation and free for a timeline, with
// each event's block and signed size (which blocks are live at the peak: cpu_runtime.peak_tensors).
// Loaded through ctypes by cpu_memory.py; nothing here is megatron-specific.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

std::atomic<long long> g_current{0};
std::atomic<long long> g_peak{0};
std::atomic<long long> g_allocations{0};
c10::Allocator* g_inner = nullptr;

// Timeline recording: a fixed buffer, filled while enabled, entries claimed atomically.
std::vector<long long> g_times;
std::vector<long long> g_bytes;
std::vector<long long> g_ptrs;    // the block's data pointer
std::vector<long long> g_deltas;  // +size for an allocation, -size for a free
std::atomic<long long> g_next{0};
std::atomic<bool> g_recording{false};

void record(long long now, const void* ptr, long long delta) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  long long i = g_next.fetch_add(1);
  if (i < static_cast<long long>(g_times.size())) {
    g_times[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now().time_since_epoch())
                     .count();
    g_bytes[i] = now;
    g_ptrs[i] = reinterpret_cast<long long>(ptr);
    g_deltas[i] = delta;
  }
}

// Blocks are handed out as "simple" data pointers (context == data), as c10's raw_allocate
// requires; the size and the wrapped allocator's deleter and context live in a side table.
struct Block {
  size_t nbytes;
  c10::DeleterFnPtr deleter;
  void* context;
};
std::mutex g_mutex;
std::unordered_map<void*, Block> g_blocks;

void release(void* data) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(data);
    if (it == g_blocks.end()) return;  // not ours (cannot happen for our own deleter)
    block = it->second;
    g_blocks.erase(it);
  }
  if (block.deleter != nullptr) block.deleter(block.context);
  long long now = g_current.fetch_sub(static_cast<long long>(block.nbytes)) -
                  static_cast<long long>(block.nbytes);
  record(now, data, -static_cast<long long>(block.nbytes));
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = g_inner->allocate(n);
    void* data = inner.get();
    c10::DeleterFnPtr deleter = inner.get_deleter();
    void* context = inner.release_context();
    if (data == nullptr) {  // zero-size: nothing to count or free later
      if (deleter != nullptr && context != nullptr) deleter(context);
      return {nullptr, nullptr, nullptr, c10::Device(c10::DeviceType::CPU)};
    }
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_blocks[data] = Block{n, deleter, context};
    }
    long long now = g_current.fetch_add(static_cast<long long>(n)) + static_cast<long long>(n);
    long long seen = g_peak.load();
    while (now > seen && !g_peak.compare_exchange_weak(seen, now)) {
    }
    g_allocations.fetch_add(1);
    record(now, data, static_cast<long long>(n));
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

CountingAllocator g_counting;

}  // namespace

extern "C" {

// Route every later CPU tensor allocation through the counter; returns 1 when it is active.
int moe_counter_install() {
  if (g_inner == nullptr) {
    g_inner = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&g_counting, /*priority=*/100);
  }
  return c10::GetCPUAllocator() == &g_counting ? 1 : 0;
}
long long moe_counter_current() { return g_current.load(); }
long long moe_counter_peak() { return g_peak.load(); }
long long moe_counter_allocations() { return g_allocations.load(); }
void moe_counter_reset_peak() { g_peak.store(g_current.load()); }
long long moe_counter_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
void moe_counter_start_recording(long long capacity) {
  g_recording.store(false);
  g_times.assign(static_cast<size_t>(capacity), 0);
  g_bytes.assign(static_cast<size_t>(capacity), 0);
  g_ptrs.assign(static_cast<size_t>(capacity), 0);
  g_deltas.assign(static_cast<size_t>(capacity), 0);
  g_next.store(0);
  g_recording.store(true);
}
// Stops recording; returns the number of entries written (capped at the capacity).
long long moe_counter_stop_recording() {
  g_recording.store(false);
  long long n = g_next.load();
  return n < static_cast<long long>(g_times.size()) ? n : static_cast<long long>(g_times.size());
}
void moe_counter_copy_timeline(long long* times, long long* bytes, long long n) {
  std::memcpy(times, g_times.data(), sizeof(long long) * n);
  std::memcpy(bytes, g_bytes.data(), sizeof(long long) * n);
}
void moe_counter_copy_events(long long* ptrs, long long* deltas, long long n) {
  std::memcpy(ptrs, g_ptrs.data(), sizeof(long long) * n);
  std::memcpy(deltas, g_deltas.data(), sizeof(long long) * n);
}
// Events recorded so far (while recording; may exceed the capacity).
long long moe_counter_events() { return g_next.load(); }
}

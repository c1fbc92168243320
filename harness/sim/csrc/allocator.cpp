// sim's device allocator (as OpenReg's OpenRegDeviceAllocator): the c10::DeviceAllocator of every sim
// storage, which torch.accelerator's memory API requires. Its memory is host memory, counted per simulated
// device against the device's memory size (and, on a shared device, against the budget its processes
// share: placement.cpp), so an allocation beyond it raises torch.OutOfMemoryError as a real device's does.
// Nothing is cached: reserved is allocated, and freed memory goes back at once.
#include "sim.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <mutex>

namespace sim {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::CachingDeviceAllocator::DeviceStats;
using Stat = c10::CachingAllocator::Stat;
using StatType = c10::CachingAllocator::StatType;

constexpr size_t kLargeBytes = 1 << 20;  // CUDA's small/large pool boundary, for memory_stats()

struct DeviceMemory {
  Stat bytes[3];  // indexed by StatType: aggregate, small pool, large pool
  Stat blocks[3];
  int64_t num_ooms = 0;
  int64_t limit = INT64_MAX;
};

std::mutex memory_mutex;
std::array<DeviceMemory, kMaxDevices> memory;

size_t pool_of(size_t bytes) {
  return static_cast<size_t>(bytes >= kLargeBytes ? StatType::LARGE_POOL : StatType::SMALL_POOL);
}

struct Block {
  c10::DataPtr host;
  c10::intrusive_ptr<c10::StorageImpl> keep;
  int dev;
  size_t bytes;
};

void release_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  account_free(block->dev, block->bytes);
  delete block;  // frees the host memory (or drops the CPU storage that holds it)
}

std::string format_bytes(double n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (n >= 1024 && u < 3) {
    n /= 1024;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%.0f B", n);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", n, units[u]);
  }
  return buf;
}

struct SimAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    int dev = current_device();
    if (!account_alloc(dev, n)) throw_oom(dev, n);
    c10::DataPtr host;
    try {
      host = c10::GetCPUAllocator()->allocate(n);
    } catch (...) {
      account_free(dev, n);
      throw;
    }
    void* data = host.get();
    return device_data(std::move(host), {}, data, dev, n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*unused*/) override {}  // nothing is cached: freed means freed
  void recordStream(const c10::DataPtr& /*unused*/, Stream /*unused*/) override {}
  DeviceStats getDeviceStats(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory_mutex);
    const DeviceMemory& m = memory.at(device);
    DeviceStats s;
    for (size_t i = 0; i < 3; ++i) {
      // Nothing is cached, so reserved == allocated == active, one segment per block.
      s.allocated_bytes[i] = s.reserved_bytes[i] = s.active_bytes[i] = s.requested_bytes[i] = m.bytes[i];
      s.allocation[i] = s.segment[i] = s.active[i] = m.blocks[i];
    }
    s.num_ooms = m.num_ooms;
    s.num_device_alloc = m.blocks[0].allocated;
    s.num_device_free = m.blocks[0].freed;
    return s;
  }
  void resetAccumulatedStats(DeviceIndex device) override { reset_accumulated(device); }
  void resetPeakStats(DeviceIndex device) override { reset_peak(device); }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    auto [free, total] = memory_info(device);
    return {static_cast<size_t>(free), static_cast<size_t>(total)};
  }
};

// Never destroyed: torch may still call them while the process exits.
SimAllocator& the_allocator = *new SimAllocator();

}  // namespace

c10::Allocator* allocator() { return &the_allocator; }

bool account_alloc(int dev, size_t bytes) {
  claim(dev);  // the device's first use by this process: taken, joined, or refused
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory[dev];
  auto& total = m.bytes[static_cast<size_t>(StatType::AGGREGATE)];
  const int64_t n = static_cast<int64_t>(bytes);
  const double f = fraction(dev);
  const bool own_ok = f >= 1.0 || total.current + n <= static_cast<int64_t>(f * static_cast<double>(m.limit));
  // a shared device's limit is its ledger's (every tenant's bytes count); otherwise this process's count
  const bool fit = shared(dev) ? own_ok && ledger_take(dev, n) : own_ok && total.current + n <= m.limit;
  if (!fit) {
    m.num_ooms++;
    return false;
  }
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool_of(bytes)}) {
    m.bytes[i].increase(bytes);
    m.blocks[i].increase(1);
  }
  return true;
}

void account_free(int dev, size_t bytes) {
  if (shared(dev)) ledger_give(dev, static_cast<int64_t>(bytes));
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory[dev];
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool_of(bytes)}) {
    m.bytes[i].decrease(bytes);
    m.blocks[i].decrease(1);
  }
}

void throw_oom(int dev, size_t bytes) {
  MemoryStats s = memory_stats(dev);
  auto [free, total] = memory_info(dev);
  std::string context = oom_context(dev, bytes, s.current, s.limit);
  std::string label = device_label(dev);
  if (!context.empty()) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, label, " out of memory. Tried to allocate ",
                     format_bytes(static_cast<double>(bytes)), ". ", label, " has a total capacity of ",
                     format_bytes(static_cast<double>(total)), " of which ", format_bytes(static_cast<double>(free)),
                     " is free. ", context, " (simulated device memory: set PORTHARNESS_SIM_MEMORY_MB or "
                     "harness.sim.set_memory_size() to change it)");
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, label, " out of memory. Tried to allocate ",
                   format_bytes(static_cast<double>(bytes)), ". ", label, " has a total capacity of ",
                   format_bytes(static_cast<double>(s.limit)), " of which ",
                   format_bytes(static_cast<double>(s.limit > s.current ? s.limit - s.current : 0)), " is free; ",
                   format_bytes(static_cast<double>(s.current)),
                   " is allocated by tensors (simulated device memory: set PORTHARNESS_SIM_MEMORY_MB or "
                   "harness.sim.set_memory_size() to change it)");
  __builtin_unreachable();
}

std::pair<int64_t, int64_t> memory_info(int dev) {
  claim(dev);  // asking a device about its memory is using it, as on CUDA
  if (shared(dev)) {
    auto [used, limit] = shared_info(dev);
    return {limit > used ? limit - used : 0, limit};
  }
  MemoryStats s = memory_stats(dev);
  return {s.limit > s.current ? s.limit - s.current : 0, s.limit};
}

c10::DataPtr device_data(c10::DataPtr host, c10::intrusive_ptr<c10::StorageImpl> keep, void* data, int dev,
                         size_t bytes) {
  return c10::DataPtr(data, new Block{std::move(host), std::move(keep), dev, bytes}, &release_block,
                      Device(kSim, static_cast<DeviceIndex>(dev)));
}

bool is_device_data(const c10::DataPtr& dp) { return dp.get_deleter() == &release_block; }

MemoryStats memory_stats(int dev) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  const DeviceMemory& m = memory.at(dev);
  const Stat& b = m.bytes[0];
  return {b.current, b.peak, b.allocated, b.freed, m.blocks[0].current, m.blocks[0].peak, m.num_ooms, m.limit};
}

void set_memory_limit(int dev, int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(memory_mutex);
    memory.at(dev).limit = bytes;
  }
  ledger_set_limit(dev, bytes);  // a shared device has one size, whichever tenant sets it
}

bool fits(int dev, int64_t bytes) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory.at(dev);
  if (m.bytes[0].current + bytes <= m.limit) return true;
  m.num_ooms++;
  return false;
}

void reset_peak(int dev) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory.at(dev);
  for (size_t i = 0; i < 3; ++i) {
    m.bytes[i].reset_peak();
    m.blocks[i].reset_peak();
  }
}

void reset_accumulated(int dev) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory.at(dev);
  for (size_t i = 0; i < 3; ++i) {
    m.bytes[i].reset_accumulated();
    m.blocks[i].reset_accumulated();
  }
  m.num_ooms = 0;
}

}  // namespace sim

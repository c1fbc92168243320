// The runtime half of sim's native backend (see harness/sim/native.py):
//
// - a device guard: torch's Python-registered PrivateUse1 guard reports one device and ignores
//   setDevice, so the autograd engine would have a ready queue for sim:0 only. This one tracks a
//   per-thread current device and stream, reports the live device count, and keeps events (with
//   timestamps) and streams as no-ops that order trivially: every sim kernel has finished when it
//   returns.
// - the c10::DeviceAllocator of every sim storage (torch.accelerator's memory API requires one): host
//   memory, counted per simulated device against its memory size, so allocations beyond it raise
//   torch.OutOfMemoryError as a real device's do.
#include "sim.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace sim {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;
using c10::CachingDeviceAllocator::DeviceStats;
using Stat = c10::CachingAllocator::Stat;
using StatType = c10::CachingAllocator::StatType;

constexpr size_t kLargeBytes = 1 << 20;  // CUDA's small/large pool boundary, for memory_stats()

// Per thread, as on CUDA: the autograd engine's worker for sim:1 sets its own current device.
thread_local DeviceIndex current = 0;
thread_local std::array<StreamId, kMaxDevices> current_streams{};
std::atomic<StreamId> next_stream_id{1};

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
    int dev = current;
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

struct Event {
  std::chrono::steady_clock::time_point at;
};

struct SimGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kSim, current); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kSim, "sim device guard got a ", d.type(), " device");
    current = static_cast<DeviceIndex>(check_index(d.index()));
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kMaxDevices) current = d.index();
  }
  Stream getStream(Device d) const override { return Stream(Stream::UNSAFE, d, current_streams.at(d.index())); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getStreamFromGlobalPool(Device d, bool /*isHighPriority*/) const override { return getNewStream(d, 0); }
  Stream getNewStream(Device d, int /*priority*/) const override {
    return Stream(Stream::UNSAFE, d, next_stream_id++);
  }
  Stream exchangeStream(Stream s) const override {
    Stream old = getStream(s.device());
    current_streams.at(s.device_index()) = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(device_count()); }
  // Kernels run synchronously on the host: every stream is idle, every event has completed.
  void record(void** event, const Stream& /*stream*/, const DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) *event = new Event();
    static_cast<Event*>(*event)->at = std::chrono::steady_clock::now();
  }
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}
  double elapsedTime(void* event1, void* event2, const DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(event1 != nullptr && event2 != nullptr,
                "Both events must be recorded before calculating elapsed time.");
    auto dt = static_cast<Event*>(event2)->at - static_cast<Event*>(event1)->at;
    return std::chrono::duration<double, std::milli>(dt).count();
  }
};

SimGuard& the_guard = *new SimGuard();

}  // namespace

// Same variables and default as harness/sim/indices.py: the visible devices, else every simulated one.
int device_count() noexcept {
  int visible = visible_count();
  if (visible >= 0) return visible < 1 ? 1 : visible;
  const char* raw = std::getenv("PORTHARNESS_SIM_DEVICES");
  if (raw == nullptr || *raw == '\0') return 2;
  long n = std::strtol(raw, nullptr, 10);
  return n < 1 ? 1 : (n > kMaxDevices ? kMaxDevices : static_cast<int>(n));
}

DeviceIndex current_device() noexcept { return current; }

void set_current_device(DeviceIndex index) noexcept { current = index; }

int check_index(int index) {
  int count = device_count();
  TORCH_CHECK(index >= 0 && index < count, "sim device index ", index, " out of range: ", count,
              visible_count() >= 0 ? " visible simulated devices (PORTHARNESS_SIM_VISIBLE_DEVICES)" : " simulated devices",
              " (set PORTHARNESS_SIM_DEVICES to simulate more)");
  return index;
}

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

int64_t current_stream(int dev) { return current_streams.at(dev); }

void set_stream(int dev, int64_t id) { current_streams.at(dev) = id; }

void register_device() {
  c10::impl::registerDeviceGuard(kSim, &the_guard);
  c10::SetAllocator(kSim, &the_allocator, /*priority=*/UINT8_MAX);
}

}  // namespace sim

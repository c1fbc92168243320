// What the parts of sim's native backend share (see harness/sim/native.py for the why of each part).
//
// One file per device concept, as PyTorch's reference out-of-tree backend (torch_openreg) has them:
// devices.cpp (count, visibility, current device), guard.cpp (the device guard), streams.cpp (streams and
// events), allocator.cpp (device memory), host_allocator.cpp (pinned memory), generator.cpp (RNGs),
// hooks.cpp (the PrivateUse1 hooks), placement.cpp (which process holds a device); the dispatch path
// (dispatch.h maps its files), the c10d backend (backend.cpp) and the Python bindings (module.cpp).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace sim {

constexpr auto kSim = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;

// ---- devices (devices.cpp) ---------------------------------------------------------------------------
// The simulated device count (PORTHARNESS_SIM_DEVICES, read live) and this thread's current device.
int device_count() noexcept;
c10::DeviceIndex current_device() noexcept;
void set_current_device(c10::DeviceIndex index) noexcept;
// `index` if it names a simulated device, else the error torch.sim raises for it.
int check_index(int index);

// PORTHARNESS_SIM_VISIBLE_DEVICES, read live: the visible device count (-1: unset) and the physical device
// behind logical `index`; "sim:1 (physical sim:3)" for messages.
int visible_count() noexcept;
int physical_index(int index) noexcept;
std::string device_label(int dev);

// ---- placement (placement.cpp; harness/sim/placement.py says why) -------------------------------------
// The first use of `dev` by this process: it takes the device (exclusive) or joins its tenants (shared),
// or raises "sim:0 is in use by process N (...)". Cheap after the first call.
void claim(int dev);
bool claimed(int dev) noexcept;
bool shared(int dev) noexcept;  // claimed, and shared with other processes
void set_fraction(int dev, double fraction);  // the per-process memory fraction (1: none)
double fraction(int dev);
// A shared device's memory budget across its tenants: take / give back bytes (false: it is used up),
// its size, (bytes used by every tenant, size), and each tenant's (pid, bytes).
bool ledger_take(int dev, int64_t bytes);
void ledger_give(int dev, int64_t bytes);
void ledger_set_limit(int dev, int64_t bytes);
std::pair<int64_t, int64_t> shared_info(int dev);
std::vector<std::pair<int, int64_t>> ledger_tenants(int dev);
// The processes holding physical device `physical` (this one included): (pid, "exclusive" | "shared").
std::vector<std::pair<int, std::string>> holders(int physical);
// What an out-of-memory error adds on a shared device or past the per-process fraction ("" otherwise).
std::string oom_context(int dev, size_t bytes, int64_t own, int64_t limit);
// Held while a kernel runs on a shared device: its tenants' kernels take turns (nothing when the device
// is not shared, or inside another kernel of this thread).
class Turn {
 public:
  explicit Turn(int dev);
  ~Turn();
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;

 private:
  void* lock_ = nullptr;
};

// ---- memory (allocator.cpp) ----------------------------------------------------------------------------
// A sim storage holds host memory counted on its device until the storage dies. Its DataPtr's context
// is a Block: the host memory is owned by `host` (allocator, resize) or kept alive by `keep` (a CPU
// kernel's output adopted without a copy).
c10::Allocator* allocator();
bool account_alloc(int dev, size_t bytes);  // false: the device (or this process) has no room
void account_free(int dev, size_t bytes);
[[noreturn]] void throw_oom(int dev, size_t bytes);
c10::DataPtr device_data(c10::DataPtr host, c10::intrusive_ptr<c10::StorageImpl> keep, void* data, int dev,
                         size_t bytes);
bool is_device_data(const c10::DataPtr& dp);

// ---- dispatch (register.cpp; the parts in dispatch.h) ------------------------------------------------
void register_dispatch();

}  // namespace sim

namespace sim {
// Memory counters of a device: bytes current, peak, allocated, freed; blocks current, peak; OOMs; limit.
struct MemoryStats {
  int64_t current, peak, allocated, freed, blocks, blocks_peak, num_ooms, limit;
};
MemoryStats memory_stats(int dev);
void set_memory_limit(int dev, int64_t bytes);
// (free, total) bytes of the device: on a shared device every tenant's use counts (claims the device)
std::pair<int64_t, int64_t> memory_info(int dev);
bool fits(int dev, int64_t bytes);  // counts an OOM when they do not
void reset_peak(int dev);
void reset_accumulated(int dev);
// ---- streams and events (streams.cpp) ----------------------------------------------------------------
int64_t current_stream(int dev);
void set_stream(int dev, int64_t id);
int64_t new_stream_id();
void record_event(void** event);  // makes the event on its first record
void destroy_event(void* event) noexcept;
double elapsed_ms(void* start, void* end);
void register_device();  // the device guard (guard.cpp) and the DeviceAllocator
}  // namespace sim

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <utility>
#include <vector>

namespace sim {
// The switches the dispatch path reads (each set from Python, see harness/sim/*.py).
void set_profile(std::optional<std::vector<std::string>> ops, const std::string& name);  // nullopt: every op
void set_reduced_precision(bool on);
void clear_round_cache();
void set_fallback_cpu(bool on);
// Planted slowdowns: each named op's kernel takes `factor` times as long (host time, spent busy).
void set_slow_ops(const std::map<std::string, double>& ops);
std::vector<std::pair<std::string, int64_t>> fallback_counts();
void reset_fallback_counts();
void start_trace();
std::vector<std::string> stop_trace();
// Devices with injected faults get `hook(device, fresh outputs)` after every kernel that made some.
using LaunchHook = void (*)(int dev, const std::vector<at::Tensor>& fresh);
void set_launch_hook(LaunchHook hook, uint64_t faulty_devices);
// Python kernels (planted bugs) report their op like the native path does: traced, profile-checked.
void enter_op(const std::string& qualified_name, const std::string& overload);

// Host memory of a sim tensor as a CPU tensor (keeps the device memory alive), and the reverse: a
// CPU tensor's memory as a sim tensor on `dev`, without a copy.
at::Tensor host_view(const at::Tensor& t);
at::Tensor adopt(const at::Tensor& cpu, int dev);
at::Generator generator(int dev);
}  // namespace sim

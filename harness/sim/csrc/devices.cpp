// The simulated devices themselves (as OpenReg's OpenRegFunctions): how many there are, which of them
// this process sees (PORTHARNESS_SIM_VISIBLE_DEVICES, as CUDA_VISIBLE_DEVICES), and this thread's
// current one. The same variables and defaults as harness/sim/indices.py and placement.py.
#include "sim.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace sim {
namespace {

const char* const kVisibleEnv = "PORTHARNESS_SIM_VISIBLE_DEVICES";

// Per thread, as on CUDA: the autograd engine's worker for sim:1 sets its own current device.
thread_local c10::DeviceIndex current = 0;

int physical_devices() noexcept {
  const char* raw = std::getenv("PORTHARNESS_SIM_DEVICES");
  if (raw == nullptr || *raw == '\0') return 2;
  long n = std::strtol(raw, nullptr, 10);
  return n < 1 ? 1 : (n > kMaxDevices ? kMaxDevices : static_cast<int>(n));
}

// The visible physical devices in logical order, as CUDA reads CUDA_VISIBLE_DEVICES: up to the first
// entry that is not a device (harness/sim/placement.py refuses such a value at import). Empty: unset.
std::vector<int> visible() {
  std::vector<int> out;
  const char* raw = std::getenv(kVisibleEnv);
  if (raw == nullptr) return out;
  int count = physical_devices();
  std::stringstream in(raw);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 0 || v >= count) break;
    bool seen = false;
    for (int d : out) seen = seen || d == v;
    if (seen) break;
    out.push_back(static_cast<int>(v));
  }
  return out;
}

}  // namespace

int visible_count() noexcept {
  try {
    return std::getenv(kVisibleEnv) == nullptr ? -1 : static_cast<int>(visible().size());
  } catch (...) {
    return -1;
  }
}

int physical_index(int index) noexcept {
  try {
    std::vector<int> v = visible();
    return std::getenv(kVisibleEnv) == nullptr || index < 0 || index >= static_cast<int>(v.size()) ? index : v[index];
  } catch (...) {
    return index;
  }
}

std::string device_label(int dev) {
  int phys = physical_index(dev);
  return "sim:" + std::to_string(dev) + (phys == dev ? "" : " (physical sim:" + std::to_string(phys) + ")");
}

// The visible devices, else every simulated one.
int device_count() noexcept {
  int visible = visible_count();
  if (visible >= 0) return visible < 1 ? 1 : visible;
  return physical_devices();
}

c10::DeviceIndex current_device() noexcept { return current; }

void set_current_device(c10::DeviceIndex index) noexcept { current = index; }

int check_index(int index) {
  int count = device_count();
  TORCH_CHECK(index >= 0 && index < count, "sim device index ", index, " out of range: ", count,
              visible_count() >= 0 ? " visible simulated devices (PORTHARNESS_SIM_VISIBLE_DEVICES)" : " simulated devices",
              " (set PORTHARNESS_SIM_DEVICES to simulate more)");
  return index;
}

}  // namespace sim

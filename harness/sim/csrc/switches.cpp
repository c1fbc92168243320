// The switches sim's dispatch path reads (op profile, precision, CPU fallback, traces, faults, planted
// slowdowns), each set from Python (harness/sim/*.py), and the per-op entry every kernel goes through.
#include "dispatch.h"

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_set>

namespace sim::detail {
namespace {

std::mutex switch_mutex;  // guards the profile's contents, the trace and the fallback counts
std::shared_ptr<const std::unordered_set<std::string>> profile_ops;  // null: every op
std::string profile_name = "young";
std::atomic<uint64_t> profile_gen{1};
std::atomic<bool> reduced_precision_flag{true};
std::atomic<bool> fallback_cpu{false};
std::map<std::string, int64_t> fallback_calls;
std::atomic<bool> tracing{false};
std::atomic<uint64_t> trace_epoch{1};
std::set<std::string> traced;
std::atomic<uint64_t> faulty_mask{0};
std::map<std::string, double> slow_ops;  // planted slowdowns by op name (guarded by switch_mutex)
std::atomic<uint64_t> slow_gen{1};
std::atomic<bool> any_slow_flag{false};
std::atomic<LaunchHook> launch_hook_ptr{nullptr};

bool allowed(OpInfo& info) {
  uint64_t gen = profile_gen.load(std::memory_order_acquire);
  if (info.profile_gen.load(std::memory_order_acquire) != gen) {
    std::lock_guard<std::mutex> lock(switch_mutex);
    bool ok = profile_ops == nullptr || profile_ops->count(info.base) > 0 || profile_ops->count(info.full) > 0;
    for (const std::string& f : info.functional) ok = ok || profile_ops->count(f) > 0;
    info.allowed.store(ok, std::memory_order_relaxed);
    info.profile_gen.store(profile_gen.load(), std::memory_order_release);
  }
  return info.allowed.load(std::memory_order_relaxed);
}

}  // namespace


[[noreturn]] void unsupported(const OpInfo& info, bool missing_host_kernel) {
  if (missing_host_kernel) {
    not_implemented(info, "sim runs ops on host (CPU) kernels, and the CPU has no kernel for '" + info.display +
                              "' with these args.");
  }
  std::string why;
  {
    std::lock_guard<std::mutex> lock(switch_mutex);
    why = "'" + info.display + "' is not in the sim op profile '" + profile_name +
          "' (set PORTHARNESS_SIM_OPS=full to allow all).";
  }
  not_implemented(info, why);
}

[[noreturn]] void not_implemented(const OpInfo& info, const std::string& why) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "Could not run '", info.display,
                              "' with arguments from the 'sim' backend. This could be because the operator "
                              "doesn't exist for this backend, or was omitted during the selective/custom build "
                              "process. ",
                              why);
  __builtin_unreachable();
}

// The planted slowdown of `info` (1: none). Names as the census spells them; aten::softmax also means
// aten::_softmax (the kernel under the composite the user calls).
double slowdown_of(OpInfo& info) {
  uint64_t gen = slow_gen.load(std::memory_order_acquire);
  if (info.slow_gen.load(std::memory_order_acquire) != gen) {
    std::lock_guard<std::mutex> lock(switch_mutex);
    double factor = 1.0;
    std::string plain = info.base;
    if (plain.rfind("aten::_", 0) == 0) plain = "aten::" + plain.substr(7);
    for (const std::string& name : {info.display, info.full, info.base, plain}) {
      auto it = slow_ops.find(name);
      if (it != slow_ops.end()) factor = it->second;
    }
    info.slowdown.store(factor);
    info.slow_gen.store(slow_gen.load(), std::memory_order_release);
  }
  return info.slowdown.load(std::memory_order_relaxed);
}

// Busy, not asleep: a slow kernel keeps the (host) device working, so profilers see it as the op's time.
void busy_for(std::chrono::steady_clock::duration d) {
  auto end = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < end) {
  }
}

// Every sim kernel starts here: the trace, then the profile (or the fallback counter). False: the op is
// outside the profile and has a composite to run instead.
bool enter(OpInfo& info) {
  if (!allowed(info) && info.composite) return false;
  if (tracing.load(std::memory_order_relaxed)) {
    uint64_t epoch = trace_epoch.load();
    if (info.traced_in.load(std::memory_order_relaxed) != epoch) {
      std::lock_guard<std::mutex> lock(switch_mutex);
      if (tracing.load()) traced.insert(info.display);
      info.traced_in.store(epoch);
    }
  }
  if (!allowed(info)) {
    if (info.composite) return false;
    if (!fallback_cpu.load(std::memory_order_relaxed)) unsupported(info, false);
    std::lock_guard<std::mutex> lock(switch_mutex);
    fallback_calls[info.display]++;
  }
  return true;
}

bool any_slow() { return any_slow_flag.load(std::memory_order_relaxed); }
bool reduced_precision() { return reduced_precision_flag.load(std::memory_order_relaxed); }
bool faulty(int dev) { return (faulty_mask.load(std::memory_order_relaxed) >> dev) & 1u; }
LaunchHook launch_hook() { return launch_hook_ptr.load(); }

}  // namespace sim::detail

namespace sim {
using namespace detail;

void set_profile(std::optional<std::vector<std::string>> ops, const std::string& name) {
  std::lock_guard<std::mutex> lock(switch_mutex);
  profile_ops = ops.has_value() ? std::make_shared<const std::unordered_set<std::string>>(ops->begin(), ops->end())
                                : nullptr;
  profile_name = name;
  profile_gen.fetch_add(1);
}

void set_reduced_precision(bool on) { reduced_precision_flag.store(on); }

void set_fallback_cpu(bool on) { fallback_cpu.store(on); }

void set_slow_ops(const std::map<std::string, double>& ops) {
  std::lock_guard<std::mutex> lock(switch_mutex);
  slow_ops = ops;
  slow_gen.fetch_add(1);
  any_slow_flag.store(!ops.empty());
}

std::vector<std::pair<std::string, int64_t>> fallback_counts() {
  std::lock_guard<std::mutex> lock(switch_mutex);
  return {fallback_calls.begin(), fallback_calls.end()};
}

void reset_fallback_counts() {
  std::lock_guard<std::mutex> lock(switch_mutex);
  fallback_calls.clear();
}

void start_trace() {
  std::lock_guard<std::mutex> lock(switch_mutex);
  traced.clear();
  trace_epoch.fetch_add(1);
  tracing.store(true);
}

std::vector<std::string> stop_trace() {
  std::lock_guard<std::mutex> lock(switch_mutex);
  tracing.store(false);
  std::vector<std::string> out(traced.begin(), traced.end());
  traced.clear();
  return out;
}

void set_launch_hook(LaunchHook hook, uint64_t faulty_devices) {
  launch_hook_ptr.store(hook);
  faulty_mask.store(faulty_devices);
}

void enter_op(const std::string& qualified_name, const std::string& overload) {
  enter(info_of(c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name.c_str(), overload.c_str())));
}

}  // namespace sim

// What sim's dispatch files share (internal to csrc/; harness/sim/native.py says why each part exists).
//
// A sim tensor is a plain tensor whose dispatch key is PrivateUse1 and whose storage is host memory
// (allocator.cpp). One boxed kernel (kernel.cpp) serves every op: it checks the op against the active
// profile (switches.cpp), views each sim argument as a CPU tensor on the same memory (hostview.cpp),
// rounds the multiplier operands of the matmul family to bf16 at `default` precision (rounding.cpp),
// enforces the same-device rule, runs the CPU kernel, and adopts the CPU outputs into sim storage.
// The few kernels that must not go through the CPU are in native_kernels.cpp; those sim computes on the host
// otherwise than the CPU (defective or missing CPU kernels) in semantics.cpp and accelerator_kernels.cpp;
// register.cpp installs them all.
#pragma once

#include "sim.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace sim::detail {

// ---- per-op facts, read from the schema once (ops.cpp) ------------------------------------------
// A kernel that runs on the host views in place of the op's CPU kernel (semantics.cpp,
// accelerator_kernels.cpp): the stack holds the converted arguments, as the CPU kernel would get them.
using HostKernel = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);

struct OpInfo {
  std::string display;  // aten::add.Tensor; the default overload is just aten::add
  std::string base;     // aten::add: a profile entry for every overload
  std::string full;     // aten::add.default / aten::add.Tensor
  std::vector<std::string> functional;  // for an out= overload: its functional overloads (one kernel serves both)
  std::atomic<uint64_t> profile_gen{0};
  std::atomic<bool> allowed{true};
  std::atomic<uint64_t> traced_in{0};  // the trace that last recorded it
  std::atomic<uint64_t> slow_gen{0};
  std::atomic<double> slowdown{1.0};  // planted slowdown: the kernel takes this many times as long
  std::vector<int> reduced;     // operands a bf16 multiplier sees at `default` precision
  std::vector<int> generators;  // Generator? arguments: sim passes the device's own RNG
  std::vector<int> writes;      // arguments written (in-place, out=)
  std::vector<int> return_arg;  // per return: the written argument it is, or -1
  // The op has a device-generic composite (CompositeExplicitAutograd): outside the profile it runs that,
  // as on a backend that lacks the op's own kernel. (The NonFunctional composites of structured ops are
  // their functional forms written over out=: a backend implements the functional op, as profiles say.)
  // For the few ops sim runs on the CPU's kernel over a CompositeImplicitAutograd one (silu_backward),
  // that decomposition is the composite.
  bool composite = false;
  c10::DispatchKey composite_key = c10::DispatchKey::CompositeExplicitAutograd;
  bool cross_ok = false;        // moves data between devices
  bool cpu_indices_ok = false;  // index tensors may stay on the host, as CUDA allows
  // Takes host-side (CPU) arguments next to device ones: runs its device-generic composite on the sim
  // tensors themselves, as CUDA does, so its device checks and its outputs' devices are CUDA's.
  bool device_composite = false;
  bool histc = false;
  HostKernel host_kernel = nullptr;  // where sim's kernel is not the CPU's
};

// Kernels sim runs on the host instead of the CPU's, by op (aten::name.overload): where the CPU kernel is
// defective (semantics.cpp) or missing because the kernel is an accelerator's (accelerator_kernels.cpp).
const std::map<std::string, HostKernel>& host_kernels();
void add_semantic_kernels(std::map<std::string, HostKernel>& table);
void add_accelerator_kernels(std::map<std::string, HostKernel>& table);
void add_lane_kernels(std::map<std::string, HostKernel>& table);  // semantics_lanes.cpp

OpInfo& info_of(const c10::OperatorHandle& op);

// ---- switches (switches.cpp) ---------------------------------------------------------------------
// The backend's missing-kernel error for `info`: outside the profile, or no CPU kernel for these args.
[[noreturn]] void unsupported(const OpInfo& info, bool missing_host_kernel);
// The same error with another reason after the standard text.
[[noreturn]] void not_implemented(const OpInfo& info, const std::string& why);
// Every sim kernel starts here: the trace, then the profile (or the fallback counter). False: the op is
// outside the profile and has a composite to run instead.
bool enter(OpInfo& info);
double slowdown_of(OpInfo& info);
void busy_for(std::chrono::steady_clock::duration d);
bool any_slow();
bool reduced_precision();
bool faulty(int dev);
LaunchHook launch_hook();

// ---- host views and adoption (hostview.cpp) ------------------------------------------------------
extern const c10::DispatchKeySet kSimKeys;
bool is_sim(const at::Tensor& t);
void release_ref(void* ctx);
at::Tensor alias_of(const at::Tensor& t);  // alias_on(t, host_storage(t))
c10::Storage host_storage(const at::Tensor& t);
at::Tensor alias_on(const at::Tensor& t, c10::Storage host);
c10::Storage adopt_storage(const c10::Storage& cpu, int dev);
at::Tensor on_storage(c10::Storage storage, const at::Tensor& like, c10::DispatchKeySet keys, bool view);
void sync_back(const at::Tensor& sim, const at::Tensor& alias, c10::StorageImpl* made, int dev);

// ---- bf16 rounding at `default` precision (rounding.cpp) ------------------------------------------
at::Tensor round_bf16(const at::Tensor& x);
at::Tensor rounded_operand(const at::Tensor& sim, const at::Tensor& host);
void drop_rounded(c10::StorageImpl* s);
void clear_rounded();

// ---- device APIs: generators (generator.cpp), pinned memory (host_allocator.cpp), hooks (hooks.cpp) ----
// The CPU generator a CPU kernel draws from for a Generator? argument on sim:dev.
at::Generator host_generator(const std::optional<at::Generator>& g, int dev);
at::Generator make_generator(c10::DeviceIndex index, uint64_t seed);
const at::Generator& default_generator(int dev);
c10::Allocator* pinned_allocator();
bool is_pinned(const void* data);
void register_hooks();

// ---- a boxed kernel's argument by name, where the dispatcher left it on the stack ----------------------
inline c10::IValue& arg(const c10::OperatorHandle& op, torch::jit::Stack* stack, const char* name) {
  const c10::FunctionSchema& s = op.schema();
  auto i = s.argumentIndexWithName(name);
  TORCH_INTERNAL_ASSERT(i.has_value(), "sim: ", s.name(), " has no argument ", name);
  return (*stack)[stack->size() - s.arguments().size() + *i];
}

// ---- kernels (kernel.cpp, native_kernels.cpp) -------------------------------------------------------
void sim_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The kernels that must not go through the CPU; returns the op names it registered.
std::vector<std::string> register_native_kernels(torch::Library& aten, torch::Library& autograd);

}  // namespace sim::detail

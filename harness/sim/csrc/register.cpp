// Installing sim's kernels: the boxed kernel as PrivateUse1's fallback and for the device-generic
// composites, the native kernels, and the DispatchStub entries (see the comments below for which).
//
// Which ops the kernel sees is what a PrivateUse1 backend sees, plus the CompositeExplicitAutograd
// ops that take tensors (convolution, sum.default, copy_, _to_copy, _foreach_add_...): registering it
// for those by name keeps them whole, as a backend that implements them does, and as the op profiles
// name them. One of those outside the active profile runs its device-generic composite instead
// (decomposed into ops the profile may have), as on a backend that lacks that kernel. Views whose
// composite is device-generic stay native.
#include "dispatch.h"

#include <memory>
#include <set>

namespace sim::detail {
namespace {

// Factories whose composite calls a DispatchStub with the new sim tensors: the stub looks its kernel up
// by device type and has none for sim (an internal assert). Their CPU kernel runs them whole, as for a
// tensor op; outside the profile their composite fails with the backend's missing-kernel error
// (kernel.cpp). Found by the OpInfo sweep (scripts/opinfo_table.py --fidelity).
const std::set<std::string> kStubFactories = {"aten::kaiser_window"};

std::unique_ptr<torch::Library> fallback_lib;
std::unique_ptr<torch::Library> aten_lib;
std::unique_ptr<torch::Library> autograd_lib;

// Factories (no tensor argument) dispatch on their device argument; their composites (empty + fill_)
// reach sim as the ops they are made of, as on any backend.
bool takes_tensors(const c10::FunctionSchema& s) {
  for (const auto& a : s.arguments()) {
    const c10::TypePtr& t = a.type();
    if (t->isSubtypeOf(*c10::TensorType::get()) || t->isSubtypeOf(*c10::OptionalType::ofTensor()) ||
        t->isSubtypeOf(*c10::ListType::ofTensors()) || t->isSubtypeOf(*c10::ListType::ofOptionalTensors())) {
      return true;
    }
  }
  return false;
}

bool returns_view(const c10::FunctionSchema& s) {
  for (const auto& r : s.returns()) {
    const c10::AliasInfo* a = r.alias_info();
    if (a != nullptr && !a->isWrite()) return true;
  }
  return false;
}

}  // namespace
}  // namespace sim::detail

namespace sim {
using namespace detail;

void register_dispatch() {
  if (fallback_lib) return;
  register_hooks();
  fallback_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                                  __FILE__, __LINE__);
  fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&sim_kernel>());
  aten_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                              __LINE__);
  autograd_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                                  __FILE__, __LINE__);
  std::vector<std::string> native = register_native_kernels(*aten_lib, *autograd_lib);
  const std::set<std::string> native_here(native.begin(), native.end());
  // CompositeExplicitAutograd ops stay whole on sim (see the top of this file); device-generic views too.
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    std::string spec = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    if (native_here.count(spec)) continue;
    auto op = dispatcher.findOp(name);
    if (!op.has_value() || !op->hasSchema()) continue;
    bool explicit_composite = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                              op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    // An op that also has a CompositeImplicitAutograd kernel is decomposed above the backend unless the
    // backend has a kernel of its own for it. The CPU has one for a few (silu_backward, mish_backward:
    // fused, 1 ulp from the decomposition): sim runs those as the CPU does.
    bool implicit = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
    bool cpu_over_implicit = implicit && op->hasKernelForDispatchKey(c10::DispatchKey::CPU);
    if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) || (!cpu_over_implicit &&
        (!explicit_composite || implicit))) {
      continue;
    }
    if (returns_view(op->schema()) || (!takes_tensors(op->schema()) && !kStubFactories.count(name.name))) continue;
    aten_lib->impl(spec.c_str(), torch::CppFunction::makeFromBoxedFunction<&sim_kernel>());
  }
  // Ops sim computes on the host whose only kernel is a CompositeImplicitAutograd one (the fallback does not
  // see those): a kernel of sim's own, as a backend that implements them has.
  for (const auto& [full, kernel] : host_kernels()) {
    auto dot = full.rfind('.');
    std::string name = full.substr(0, dot), overload = full.substr(dot + 1);
    auto op = dispatcher.findOp({name, overload == "default" ? "" : overload});
    if (!op.has_value() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) continue;
    std::string spec = name.substr(6) + (overload == "default" ? "" : "." + overload);
    aten_lib->impl(spec.c_str(), torch::CppFunction::makeFromBoxedFunction<&sim_kernel>());
  }
}

}  // namespace sim

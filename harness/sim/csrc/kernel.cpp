// sim's boxed kernel: every ATen op on a sim tensor that has no kernel of its own below (see dispatch.h).
//
// Outputs that alias an argument (views, in-place, out=) come back as views of, or as, the argument.
// Python runs only where a switch asks for it: faults call back after a kernel (set_launch_hook),
// planted bugs register their own kernels over these.
#include "dispatch.h"

#include <c10/util/SmallVector.h>

namespace sim::detail {
namespace {

using c10::IValue;

struct Converted {
  size_t pos;  // stack position of the argument
  at::Tensor sim;
  at::Tensor alias;
  c10::StorageImpl* made;
  bool written;
};

[[noreturn]] void mixed(const OpInfo& info, const std::string& a, const std::string& b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a, " and ",
              b, "! (when running '", info.display, "' on the sim backend)");
  __builtin_unreachable();
}

struct Call {
  OpInfo& info;
  int dev = -1;
  bool cpu_seen = false;
  std::optional<c10::Device> target;  // an explicit device argument
  c10::SmallVector<Converted, 8> converted;

  explicit Call(OpInfo& i) : info(i) {}

  void see_sim(const at::Tensor& t) {
    int j = t.device().index();
    if (dev != j) {
      if (dev < 0) {
        dev = j;
      } else if (!info.cross_ok) {
        mixed(info, "sim:" + std::to_string(dev), "sim:" + std::to_string(j));
      }
    }
  }

  // `t` for the CPU kernel: an alias for a sim tensor, itself otherwise. Within a call one sim tensor has
  // one alias and one sim storage one host storage, so the CPU kernel's overlap checks (an out= that is
  // an input, or overlaps one) see what they would see on the CPU, and refuse what the CPU refuses.
  at::Tensor convert(const at::Tensor& t, size_t pos, bool written, bool host_indices) {
    if (!t.defined()) return t;
    if (is_sim(t)) {
      see_sim(t);
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
      at::Tensor a;
      for (const Converted& c : converted) {
        if (c.sim.unsafeGetTensorImpl() == impl) {
          a = c.alias;
          break;
        }
      }
      for (size_t k = 0; !a.defined() && k < converted.size(); ++k) {
        if (converted[k].sim.storage().unsafeGetStorageImpl() == storage) {
          a = alias_on(t, converted[k].alias.storage());
        }
      }
      if (!a.defined()) a = alias_of(t);
      converted.push_back({pos, t, a, a.storage().unsafeGetStorageImpl(), written});
      return a;
    }
    if (t.dim() > 0 && !host_indices) cpu_seen = true;  // 0-dim host tensors act as scalars, as on CUDA
    return t;
  }
};

// The op's device-generic composite on the sim tensors themselves. A kernel it reaches through a
// DispatchStub that has none for sim is the op missing on this backend (not an internal assert).
void run_composite(const c10::OperatorHandle& op, const OpInfo& info, torch::jit::Stack* stack) {
  try {
    op.callBoxedForDispatchKey(info.composite_key, *stack);
  } catch (const c10::Error& e) {
    if (e.msg().find("DispatchStub: missing kernel for") != std::string::npos) {
      not_implemented(info, "Its device-generic composite reaches a kernel (a DispatchStub) that sim lacks.");
    }
    throw;
  }
}

}  // namespace

void sim_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // a planted slowdown stretches the whole op as the device runs it (argument views, the kernel, adopting its
  // outputs), which is what a profiler attributes to the op; the clock is read only while one is planted
  const bool timing = any_slow();
  const auto entered = timing ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const c10::FunctionSchema& schema = op.schema();
  OpInfo& info = info_of(op);
  if (!enter(info) || info.device_composite) {
    run_composite(op, info, stack);
    return;
  }
  const auto& args = schema.arguments();
  const size_t nargs = args.size();
  const size_t begin = stack->size() - nargs;
  Call call(info);
  c10::SmallVector<IValue, 4> originals;  // written arguments as the caller passed them
  c10::SmallVector<size_t, 4> original_pos;
  for (size_t i = 0; i < nargs; ++i) {
    IValue& v = (*stack)[begin + i];
    const c10::AliasInfo* alias = args[i].alias_info();
    bool written = alias != nullptr && alias->isWrite();
    if (written) {
      originals.push_back(v);
      original_pos.push_back(i);
    }
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (is_sim(t)) {
        v = call.convert(t, begin + i, written, false);
      } else {
        call.convert(t, begin + i, written, false);
      }
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      bool any = false;
      for (size_t k = 0; k < list.size() && !any; ++k) any = is_sim(list.get(k));
      if (any) {
        c10::List<at::Tensor> out;
        out.reserve(list.size());
        for (size_t k = 0; k < list.size(); ++k) out.push_back(call.convert(list.get(k), begin + i, written, false));
        v = IValue(std::move(out));
      } else {
        for (size_t k = 0; k < list.size(); ++k) call.convert(list.get(k), begin + i, written, false);
      }
    } else if (v.isOptionalTensorList()) {
      auto list = v.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> out;
      out.reserve(list.size());
      for (size_t k = 0; k < list.size(); ++k) {
        std::optional<at::Tensor> e = list.get(k);
        if (e.has_value()) e = call.convert(*e, begin + i, written, info.cpu_indices_ok);
        out.push_back(std::move(e));
      }
      v = IValue(std::move(out));
    } else if (v.isDevice()) {
      c10::Device d = v.toDevice();
      if (d.type() == kSim) {
        int idx = d.has_index() ? check_index(d.index()) : current_device();
        call.target = c10::Device(kSim, static_cast<c10::DeviceIndex>(idx));
        v = IValue(c10::Device(c10::kCPU));
      } else {
        call.target = d;
      }
    }
  }
  if (call.cpu_seen && !info.cross_ok) mixed(info, "sim:" + std::to_string(std::max(call.dev, 0)), "cpu");
  int dev = call.dev;
  if (call.target.has_value() && call.target->type() == kSim) dev = call.target->index();
  if (dev < 0) dev = current_device();
  claim(dev);  // a kernel is a use of its device (its first one may be refused)

  for (int g : info.generators) {
    IValue& v = (*stack)[begin + g];
    v = IValue(host_generator(v.toOptional<at::Generator>(), dev));
  }
  if (!info.reduced.empty() && reduced_precision()) {
    for (int p : info.reduced) {
      IValue& v = (*stack)[begin + p];
      if (!v.isTensor()) continue;
      at::Tensor rounded;
      for (const Converted& c : call.converted) {
        if (c.pos == begin + p) rounded = rounded_operand(c.sim, v.toTensor());
      }
      v = IValue(rounded.defined() ? rounded : round_bf16(v.toTensor()));
    }
  }
  std::optional<at::ScalarType> histc_dtype;
  if (info.histc) {
    // The CPU has no integer histc; CUDA (what transformers' MoE routing targets on any non-CPU device)
    // has, with an output of the input's dtype.
    IValue& self = (*stack)[begin];
    if (self.isTensor() && !self.toTensor().is_floating_point()) {
      histc_dtype = self.toTensor().scalar_type();
      self = IValue(self.toTensor().to(at::kDouble));
    }
  }

  const double slowdown = timing ? slowdown_of(info) : 1.0;
  try {
    Turn turn(dev);  // a shared device runs one kernel at a time, whichever process launched it
    if (info.host_kernel != nullptr) {
      info.host_kernel(op, stack);
    } else {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    }
  } catch (const c10::NotImplementedError& e) {
    if (e.msg().find("from the 'CPU' backend") != std::string::npos) unsupported(info, true);
    throw;
  }
  for (const Converted& c : call.converted) {
    if (!c.written) continue;
    drop_rounded(c.sim.storage().unsafeGetStorageImpl());
    sync_back(c.sim, c.alias, c.made, c.sim.device().index());
  }

  const size_t nret = schema.returns().size();
  const size_t ret_begin = stack->size() - nret;
  const bool to_host = call.target.has_value() && call.target->type() != kSim;
  const bool faulty_dev = faulty(dev);
  std::vector<at::Tensor> fresh;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 4> adopted;  // outputs may share a storage
  auto out_of = [&](at::Tensor t) -> at::Tensor {
    if (!t.defined() || !t.device().is_cpu()) return t;
    if (t.layout() != c10::kStrided && !to_host) {  // a CPU sparse tensor must not pass for a sim one
      not_implemented(info, "sim simulates strided tensors only, and this op's output is " +
                                c10::str(t.layout()) + ".");
    }
    c10::StorageImpl* s = t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
    for (const Converted& c : call.converted) {
      if (c.made == s) {  // a view of an argument: a view of the sim tensor's memory
        if (to_host) return t.clone();
        return on_storage(c.sim.storage(), t, c.sim.key_set(), true);
      }
    }
    if (to_host || s == nullptr) return t;
    if (histc_dtype.has_value()) t = t.to(*histc_dtype);
    s = t.storage().unsafeGetStorageImpl();
    c10::Storage* storage = nullptr;
    for (auto& [cpu, sim] : adopted) {
      if (cpu == s) storage = &sim;
    }
    if (storage == nullptr) storage = &adopted.emplace_back(s, adopt_storage(t.storage(), dev)).second;
    // An efficient zero tensor (sgn's gradient of a real input) has no memory: it keeps its ZeroTensor key.
    at::Tensor out = on_storage(*storage, t, t._is_zerotensor() ? kSimKeys.add(c10::DispatchKey::ZeroTensor) : kSimKeys,
                                false);
    if (faulty_dev) fresh.push_back(out);
    return out;
  };
  for (size_t r = 0; r < nret; ++r) {
    IValue& v = (*stack)[ret_begin + r];
    int arg = info.return_arg[r];
    if (arg >= 0) {
      for (size_t k = 0; k < original_pos.size(); ++k) {
        if (static_cast<int>(original_pos[k]) == arg) v = originals[k];
      }
    } else if (v.isTensor()) {
      v = IValue(out_of(v.toTensor()));
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (size_t k = 0; k < list.size(); ++k) out.push_back(out_of(list.get(k)));
      v = IValue(std::move(out));
    }
  }
  if (!fresh.empty()) {
    LaunchHook hook = launch_hook();
    if (hook != nullptr) hook(dev, fresh);
  }
  if (slowdown > 1.0) {
    Turn turn(dev);  // a slow kernel keeps the device busy, not only this process
    busy_for(std::chrono::duration_cast<std::chrono::steady_clock::duration>((std::chrono::steady_clock::now() - entered) * (slowdown - 1.0)));
  }
}

}  // namespace sim::detail

// sim's dispatch path: every ATen op on a sim tensor, in C++ (see harness/sim/native.py).
//
// A sim tensor is a plain tensor whose dispatch key is PrivateUse1 and whose storage is host memory
// (device.cpp). One boxed kernel serves every op: it checks the op against the active profile (or
// counts it as a CPU fallback), views each sim argument as a CPU tensor on the same memory, rounds
// the multiplier operands of the matmul family to bf16 at `default` precision, enforces the
// same-device rule, runs the CPU kernel, and adopts the CPU outputs into sim storage (no copies).
// Outputs that alias an argument (views, in-place, out=) come back as views of, or as, the argument.
//
// Which ops the kernel sees is what a PrivateUse1 backend sees, plus the CompositeExplicitAutograd
// ops that take tensors (convolution, sum.default, copy_, _to_copy, _foreach_add_...): registering it
// for those by name keeps them whole, as a backend that implements them does, and as the op profiles
// name them. One of those outside the active profile runs its device-generic composite instead
// (decomposed into ops the profile may have), as on a backend that lacks that kernel. Views whose
// composite is device-generic stay native. Python runs only where a switch asks for it: faults call
// back after a kernel (set_launch_hook), planted bugs register their own kernels over these.
#include "sim.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace sim {
namespace {

using c10::IValue;

// ---- per-op facts, read from the schema once ----------------------------------------------------

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
  bool composite = false;
  bool cross_ok = false;        // moves data between devices
  bool cpu_indices_ok = false;  // index tensors may stay on the host, as CUDA allows
  bool histc = false;
};

const std::map<std::string, std::vector<int>>& reduced_ops() {
  static const std::map<std::string, std::vector<int>> ops = {
      {"aten::mm.default", {0, 1}},      {"aten::bmm.default", {0, 1}},         {"aten::addmm.default", {1, 2}},
      {"aten::baddbmm.default", {1, 2}}, {"aten::addbmm.default", {1, 2}},      {"aten::convolution.default", {0, 1}},
      {"aten::dot.default", {0, 1}},     {"aten::mv.default", {0, 1}},          {"aten::addmv.default", {1, 2}},
  };
  return ops;
}

const std::set<std::string> kCrossDevice = {"aten::copy_.default", "aten::_to_copy.default",
                                            "aten::_copy_from.default", "aten::_copy_from_and_resize.default",
                                            "aten::copy.default"};
const std::set<std::string> kCpuIndices = {"aten::index.Tensor",          "aten::index.Tensor_out",
                                           "aten::index_put.default",     "aten::index_put_.default",
                                           "aten::_index_put_impl_.default", "aten::_unsafe_index.Tensor",
                                           "aten::_unsafe_index_put.default"};

bool is_optional_generator(const c10::TypePtr& type) {
  if (type->kind() != c10::TypeKind::OptionalType) return false;
  return type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

// Overload names per op name (aten::add -> Tensor, Scalar, out...), read from the dispatcher once.
const std::unordered_map<std::string, std::vector<std::string>>& overloads() {
  static const auto* table = [] {
    auto* out = new std::unordered_map<std::string, std::vector<std::string>>();
    for (const c10::OperatorName& n : c10::Dispatcher::singleton().getAllOpNames()) {
      (*out)[n.name].push_back(n.overload_name);
    }
    return out;
  }();
  return *table;
}

// The arguments of an overload other than its out= ones: equal for an out= variant and its functional form.
std::vector<std::pair<std::string, std::string>> non_out_args(const c10::FunctionSchema& s) {
  std::vector<std::pair<std::string, std::string>> key;
  for (const auto& a : s.arguments()) {
    if (a.kwarg_only() && a.alias_info() != nullptr && a.alias_info()->isWrite()) continue;
    key.emplace_back(a.name(), a.type()->str());
  }
  return key;
}

bool is_out_variant(const c10::FunctionSchema& s) {
  for (const auto& a : s.arguments()) {
    if (a.kwarg_only() && a.alias_info() != nullptr && a.alias_info()->isWrite()) return true;
  }
  return false;
}

OpInfo* make_info(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& s = op.schema();
  auto* info = new OpInfo();
  info->composite = op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
  const std::string& ov = s.overload_name();
  info->base = s.name();
  info->full = info->base + "." + (ov.empty() ? "default" : ov);
  info->display = ov.empty() ? info->base : info->base + "." + ov;
  if (is_out_variant(s)) {  // compiled code calls out= variants (extern kernels writing Inductor's buffers)
    auto key = non_out_args(s);
    auto& dispatcher = c10::Dispatcher::singleton();
    auto it = overloads().find(info->base);
    for (const std::string& other : it == overloads().end() ? std::vector<std::string>{} : it->second) {
      auto h = dispatcher.findOp({info->base, other});
      if (h.has_value() && h->hasSchema() && !is_out_variant(h->schema()) && non_out_args(h->schema()) == key) {
        info->functional.push_back(info->base + "." + (other.empty() ? "default" : other));
      }
    }
  }
  const auto& args = s.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) info->writes.push_back(static_cast<int>(i));
    if (is_optional_generator(args[i].type())) info->generators.push_back(static_cast<int>(i));
  }
  for (const auto& ret : s.returns()) {
    int arg = -1;
    const c10::AliasInfo* alias = ret.alias_info();
    if (alias != nullptr && alias->isWrite()) {
      for (size_t i = 0; i < args.size(); ++i) {
        const c10::AliasInfo* a = args[i].alias_info();
        if (a != nullptr && *a == *alias) {
          arg = static_cast<int>(i);
          break;
        }
      }
    }
    info->return_arg.push_back(arg);
  }
  auto r = reduced_ops().find(info->full);
  for (size_t k = 0; r == reduced_ops().end() && k < info->functional.size(); ++k) {
    r = reduced_ops().find(info->functional[k]);  // mm.out multiplies like mm
  }
  if (r != reduced_ops().end()) info->reduced = r->second;
  info->cross_ok = kCrossDevice.count(info->full) > 0;
  info->cpu_indices_ok = kCpuIndices.count(info->full) > 0;
  info->histc = info->full == "aten::histc.default";
  return info;
}

std::mutex info_mutex;
std::unordered_map<const c10::FunctionSchema*, OpInfo*> infos;  // never freed: operators live forever

OpInfo& info_of(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  thread_local std::unordered_map<const c10::FunctionSchema*, OpInfo*> cache;
  auto hit = cache.find(&schema);
  if (hit != cache.end()) return *hit->second;
  std::lock_guard<std::mutex> lock(info_mutex);
  OpInfo*& slot = infos[&schema];
  if (slot == nullptr) slot = make_info(op);
  cache.emplace(&schema, slot);
  return *slot;
}

// ---- switches ------------------------------------------------------------------------------------

std::mutex switch_mutex;  // guards the profile's contents, the trace and the fallback counts
std::shared_ptr<const std::unordered_set<std::string>> profile_ops;  // null: every op
std::string profile_name = "young";
std::atomic<uint64_t> profile_gen{1};
std::atomic<bool> reduced_precision{true};
std::atomic<bool> fallback_cpu{false};
std::map<std::string, int64_t> fallback_calls;
std::atomic<bool> tracing{false};
std::atomic<uint64_t> trace_epoch{1};
std::set<std::string> traced;
std::atomic<uint64_t> faulty{0};
std::map<std::string, double> slow_ops;  // planted slowdowns by op name (guarded by switch_mutex)
std::atomic<uint64_t> slow_gen{1};
std::atomic<bool> any_slow{false};
std::atomic<LaunchHook> launch_hook{nullptr};

[[noreturn]] void unsupported(const OpInfo& info, bool missing_host_kernel) {
  std::string why;
  if (missing_host_kernel) {
    why = "sim runs ops on host (CPU) kernels, and the CPU has no kernel for '" + info.display + "' with these args.";
  } else {
    std::lock_guard<std::mutex> lock(switch_mutex);
    why = "'" + info.display + "' is not in the sim op profile '" + profile_name +
          "' (set PORTHARNESS_SIM_OPS=full to allow all).";
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "Could not run '", info.display,
                              "' with arguments from the 'sim' backend. This could be because the operator "
                              "doesn't exist for this backend, or was omitted during the selective/custom build "
                              "process. ",
                              why);
  __builtin_unreachable();
}

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

// ---- host views and adoption ---------------------------------------------------------------------

void release_ref(void* ctx) { delete static_cast<c10::intrusive_ptr<c10::StorageImpl>*>(ctx); }

bool is_sim(const at::Tensor& t) { return t.defined() && t.device().type() == kSim; }

// A CPU tensor on a sim tensor's memory. Its storage is new (resizable by the CPU allocator, so an
// out= kernel may grow it: `sync_back` then moves the new memory to the device) and keeps the sim
// storage alive. It carries the sim tensor's requires_grad: some CPU kernels choose a path by it.
at::Tensor alias_of(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const c10::DataPtr& sdp = s->_mutable_data_ptr_no_checks();
  TORCH_CHECK(is_device_data(sdp) || sdp.get() == nullptr,
              "this sim tensor has no sim memory behind it (a fake or meta storage reached the sim kernels)");
  auto* ref = new c10::intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
  c10::DataPtr dp(sdp.get(), ref, &release_ref, c10::Device(c10::kCPU));
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), s->nbytes(),
                                                       std::move(dp), c10::GetCPUAllocator(), /*resizable=*/true);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(std::move(storage)),
                                                   c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  at::Tensor out(std::move(impl));
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  if (t.requires_grad()) out.set_requires_grad(true);
  return out;
}

c10::Storage adopt_storage(const c10::Storage& cpu, int dev) {
  c10::StorageImpl* s = cpu.unsafeGetStorageImpl();
  size_t n = s->nbytes();
  if (!account_alloc(dev, n, true)) throw_oom(dev, n);
  void* data = n ? s->mutable_data() : s->_mutable_data_ptr_no_checks().get();  // materialises a lazy clone
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), n,
      device_data({}, c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s), data, dev, n), allocator(),
      /*resizable=*/true));
}

at::Tensor on_storage(c10::Storage storage, const at::Tensor& like, c10::DispatchKeySet keys, bool view) {
  c10::intrusive_ptr<c10::TensorImpl> impl =
      view ? c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, std::move(storage), keys, like.dtype())
           : c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  at::Tensor out(std::move(impl));
  out._set_conj(like.is_conj());
  out._set_neg(like.is_neg());
  return out;
}

const c10::DispatchKeySet kSimKeys(c10::DispatchKey::PrivateUse1);

// After a kernel wrote through `alias`: carry any resize (new memory, new geometry) or set_ back to the
// sim tensor, as the same op on a device would have left it.
void sync_back(const at::Tensor& sim, const at::Tensor& alias, c10::StorageImpl* made, int dev) {
  c10::TensorImpl* si = sim.unsafeGetTensorImpl();
  c10::TensorImpl* ai = alias.unsafeGetTensorImpl();
  c10::StorageImpl* now = ai->has_storage() ? ai->storage().unsafeGetStorageImpl() : nullptr;
  if (now != made && now != nullptr) {
    si->set_storage_keep_dtype(adopt_storage(ai->storage(), dev));
  } else if (made->_mutable_data_ptr_no_checks().get_deleter() != &release_ref) {
    // The CPU kernel grew the memory: the new allocation becomes the device storage's.
    c10::StorageImpl* dst = si->storage().unsafeGetStorageImpl();
    size_t n = made->nbytes();
    c10::DataPtr fresh = made->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
    if (!account_alloc(dev, n, true)) throw_oom(dev, n);
    void* data = fresh.get();
    dst->set_data_ptr_noswap(device_data(std::move(fresh), {}, data, dev, n));
    dst->set_nbytes(n);
  }
  if (si->sizes() != ai->sizes() || si->strides() != ai->strides() || si->storage_offset() != ai->storage_offset()) {
    si->set_sizes_and_strides(ai->sizes(), ai->strides(), ai->storage_offset());
  }
}

// bf16 rounding of an fp32 operand (round to nearest even, NaN -> canonical NaN), what a bf16
// multiplier sees; same layout as the operand, so the CPU kernel takes the same path.
at::Tensor round_bf16(const at::Tensor& x) {
  if (x.scalar_type() != at::kFloat || x.numel() == 0) return x;
  if (!x.is_non_overlapping_and_dense()) return x.to(at::kBFloat16).to(at::kFloat);
  at::Tensor out = at::empty_strided(x.sizes(), x.strides(), x.options());
  const auto* src = reinterpret_cast<const uint32_t*>(x.const_data_ptr<float>());
  auto* dst = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<float>());
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t u = src[i];
      bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0;
      uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      dst[i] = nan ? 0x7fc00000u : r;
    }
  });
  return out;
}

// Rounding a weight costs as much as a small model's matmul, and a weight does not change between
// calls: the rounded copy of a leaf that requires grad (a parameter), or of a view of one (weight.t()
// in linear), is kept per storage and view geometry until anything writes that storage (every write
// the sim kernels see: in-place, out=, copies into it, resize_, host views handed out) or it dies.
// Activations are rounded afresh. Bounded by PORTHARNESS_SIM_ROUND_CACHE_MB (default 128 MiB; a 355M
// model checked with 512 ran no faster than with 128 and peaked 400 MiB higher).
struct Rounded {
  int64_t offset;
  std::vector<int64_t> sizes, strides;
  at::Tensor value;
};
struct RoundEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> owner;  // also keeps the address from being reused
  std::vector<Rounded> views;
};
std::mutex round_mutex;
std::unordered_map<c10::StorageImpl*, RoundEntry> round_cache;
std::atomic<size_t> round_entries{0};
size_t round_bytes = 0;

size_t round_budget() {
  static const size_t budget = [] {
    const char* raw = std::getenv("PORTHARNESS_SIM_ROUND_CACHE_MB");
    double mb = raw != nullptr && *raw != '\0' ? std::strtod(raw, nullptr) : 128.0;
    return static_cast<size_t>(std::max(mb, 0.0) * (1 << 20));
  }();
  return budget;
}

void drop_rounded(c10::StorageImpl* s) {
  if (round_entries.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(round_mutex);
  auto it = round_cache.find(s);
  if (it == round_cache.end()) return;
  for (const Rounded& r : it->second.views) round_bytes -= r.value.nbytes();
  round_cache.erase(it);
  round_entries.store(round_cache.size());
}

void clear_rounded() {
  std::lock_guard<std::mutex> lock(round_mutex);
  round_cache.clear();
  round_bytes = 0;
  round_entries.store(0);
}

// Entries of storages that died (their weak reference keeps the address from being reused, so they
// are never looked up again). Called with round_mutex held.
void sweep_dead() {
  for (auto it = round_cache.begin(); it != round_cache.end();) {
    if (it->second.owner.expired()) {
      for (const Rounded& r : it->second.views) round_bytes -= r.value.nbytes();
      it = round_cache.erase(it);
    } else {
      ++it;
    }
  }
  round_entries.store(round_cache.size());
}

bool weight_like(const at::Tensor& t) {
  if (t.requires_grad()) return t.is_leaf();
  if (!t.is_view()) return false;
  const at::TensorBase& base = t._base();
  return base.requires_grad() && base.is_leaf();
}

// `host` (the host view of `sim`) rounded, from the cache when `sim` is (a view of) a parameter.
at::Tensor rounded_operand(const at::Tensor& sim, const at::Tensor& host) {
  if (host.scalar_type() != at::kFloat || host.numel() == 0 || !weight_like(sim)) return round_bf16(host);
  c10::StorageImpl* s = sim.storage().unsafeGetStorageImpl();
  {
    std::lock_guard<std::mutex> lock(round_mutex);
    auto it = round_cache.find(s);
    if (it != round_cache.end()) {
      for (const Rounded& r : it->second.views) {
        if (r.offset == host.storage_offset() && host.sizes().equals(r.sizes) && host.strides().equals(r.strides)) {
          return r.value;
        }
      }
    }
  }
  at::Tensor value = round_bf16(host);
  std::lock_guard<std::mutex> lock(round_mutex);
  if (round_bytes + value.nbytes() > round_budget() || round_cache.size() % 256 == 255) sweep_dead();
  if (round_bytes + value.nbytes() > round_budget()) return value;
  auto it = round_cache.find(s);
  if (it == round_cache.end()) {
    auto owner = c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
    it = round_cache.emplace(s, RoundEntry{std::move(owner), {}}).first;
  }
  it->second.views.push_back({host.storage_offset(), host.sizes().vec(), host.strides().vec(), value});
  round_bytes += value.nbytes();
  round_entries.store(round_cache.size());
  return value;
}

// ---- generators ------------------------------------------------------------------------------------

std::mutex generator_mutex;
std::array<at::Generator, kMaxDevices> generators;

// ---- the boxed kernel --------------------------------------------------------------------------------

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

  // `t` for the CPU kernel: an alias for a sim tensor, itself otherwise.
  at::Tensor convert(const at::Tensor& t, size_t pos, bool written, bool host_indices) {
    if (!t.defined()) return t;
    if (is_sim(t)) {
      see_sim(t);
      at::Tensor a = alias_of(t);
      converted.push_back({pos, t, a, a.storage().unsafeGetStorageImpl(), written});
      return a;
    }
    if (t.dim() > 0 && !host_indices) cpu_seen = true;  // 0-dim host tensors act as scalars, as on CUDA
    return t;
  }
};

void sim_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // a planted slowdown stretches the whole op as the device runs it (argument views, the kernel, adopting its
  // outputs), which is what a profiler attributes to the op; the clock is read only while one is planted
  const bool timing = any_slow.load(std::memory_order_relaxed);
  const auto entered = timing ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const c10::FunctionSchema& schema = op.schema();
  OpInfo& info = info_of(op);
  if (!enter(info)) {
    op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, *stack);
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

  for (int g : info.generators) {
    IValue& v = (*stack)[begin + g];
    if (v.isNone()) v = IValue(generator(dev));
  }
  if (!info.reduced.empty() && reduced_precision.load(std::memory_order_relaxed)) {
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
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
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
  const bool faulty_dev = (faulty.load(std::memory_order_relaxed) >> dev) & 1u;
  std::vector<at::Tensor> fresh;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 4> adopted;  // outputs may share a storage
  auto out_of = [&](at::Tensor t) -> at::Tensor {
    if (!t.defined() || !t.device().is_cpu()) return t;
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
    at::Tensor out = on_storage(*storage, t, kSimKeys, false);
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
    LaunchHook hook = launch_hook.load();
    if (hook != nullptr) hook(dev, fresh);
  }
  if (slowdown > 1.0) {
    busy_for(std::chrono::duration_cast<std::chrono::steady_clock::duration>((std::chrono::steady_clock::now() - entered) * (slowdown - 1.0)));
  }
}

// ---- kernels that must not go through the CPU ------------------------------------------------------

// Ops whose sim kernel is not the boxed one still enter like it (trace, profile).
struct Entered {
  OpInfo* info = nullptr;
  explicit Entered(const char* name, const char* overload) {
    info = &info_of(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload));
  }
  void operator()() const { enter(*info); }
};

int device_of(std::optional<c10::Device> device) {
  if (!device.has_value() || !device->has_index()) return current_device();
  return check_index(device->index());
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "sim supports strided tensors only");
  c10::DeviceGuard guard(c10::Device(kSim, static_cast<c10::DeviceIndex>(device_of(device))));
  return at::detail::empty_generic(size, allocator(), kSimKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "sim supports strided tensors only");
  c10::DeviceGuard guard(c10::Device(kSim, static_cast<c10::DeviceIndex>(device_of(device))));
  return at::detail::empty_strided_generic(size, stride, allocator(), kSimKeys, c10::dtype_or_default(dtype));
}

at::Tensor host_or_self(const at::Tensor& t) { return is_sim(t) ? alias_of(t) : t; }

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (is_sim(dst)) drop_rounded(dst.storage().unsafeGetStorageImpl());
  at::Tensor d = host_or_self(dst);
  d.copy_(host_or_self(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

#define SIM_ENTER(name, overload)                    \
  static const Entered entered_here(name, overload); \
  entered_here()

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  SIM_ENTER("aten::view", "");
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

// as_strided and _reshape_alias are view plumbing (autograd's view replay, reshape) every backend
// implements: not op-profile material, and not in the census.
at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> offset) {
  std::optional<int64_t> o;
  if (offset.has_value()) o = offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride), o);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  SIM_ENTER("aten::unfold", "");
  return at::native::unfold(self, dimension, size, step);
}

at::Tensor view_as_real(const at::Tensor& self) {
  SIM_ENTER("aten::view_as_real", "");
  return at::native::view_as_real(self);
}

at::Tensor view_as_complex(const at::Tensor& self) {
  SIM_ENTER("aten::view_as_complex", "");
  return at::native::view_as_complex(self);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size, std::optional<c10::MemoryFormat> mf) {
  SIM_ENTER("aten::resize_", "");
  drop_rounded(self.storage().unsafeGetStorageImpl());
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), mf);
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  SIM_ENTER("aten::set_", "source_Tensor");
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source) {
  SIM_ENTER("aten::set_", "source_Storage");
  return at::native::set_(self, source);
}

at::Tensor& set_storage_offset(at::Tensor& self, at::Storage source, c10::SymInt offset, c10::SymIntArrayRef size,
                               c10::SymIntArrayRef stride) {
  SIM_ENTER("aten::set_", "source_Storage_storage_offset");
  return at::native::set_storage_cpu_(self, source, offset.expect_int(), C10_AS_INTARRAYREF_SLOW(size),
                                      C10_AS_INTARRAYREF_SLOW(stride));
}

bool is_set_to(const at::Tensor& self, const at::Tensor& tensor) {
  SIM_ENTER("aten::is_set_to", "");
  return at::native::is_set_to(self, tensor);
}

// What the CPU's attention selector should look at for `t`: its host view, or while torch.compile traces
// (fake tensors: no memory) an empty host tensor of its layout; none for symbolic shapes.
std::optional<at::Tensor> selector_view(const at::Tensor& t) {
  if (!t.defined()) return t;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->has_storage() && is_device_data(impl->storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks())) {
    return alias_of(t);
  }
  if (impl->has_symbolic_sizes_strides()) return std::nullopt;
  at::Tensor p = at::empty_strided(t.sizes(), t.strides(), at::TensorOptions().dtype(t.scalar_type()));
  if (t.requires_grad()) p.set_requires_grad(true);
  return p;
}

// The CPU's choice of attention kernel (flash for most shapes), asked about host views that carry the sim
// tensors' requires_grad (a mask that needs grad rules out the fused kernel). An unknown PrivateUse1
// device gets the unfused math path, which differs from the CPU reference by ~1e-7 for reasons
// unrelated to the backend's numerics. Asked of the selector op directly: it is not a kernel of sim's.
int64_t sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                   const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                   std::optional<double> scale, bool enable_gqa) {
  constexpr int64_t kMath = 0;  // sdp::SDPBackend::math
  auto q = selector_view(query), k = selector_view(key), v = selector_view(value);
  std::optional<at::Tensor> mask;
  if (attn_mask.has_value()) {
    mask = selector_view(*attn_mask);
    if (!mask.has_value()) return kMath;
  }
  if (!q || !k || !v) return kMath;
  // Not through a Python dispatch mode (torch.compile's fake mode): these are real host tensors.
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  return at::_fused_sdp_choice(*q, *k, *v, mask, dropout_p, is_causal, scale, enable_gqa);
}

// `param.data = t` and Module.to keep a Parameter (and so tied weights) only between tensor types that
// torch calls shallow-copy compatible: dense CPU/CUDA/XPU/... but not PrivateUse1. Host memory and sim
// memory are the same kind of memory, so sim says yes for strided CPU and sim tensors, as CUDA does.
bool shallow_copy_compatible(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.device().is_cpu() || t.device().type() == kSim) &&
           !t.unsafeGetTensorImpl()->is_python_dispatch();
  };
  if (plain(self) && plain(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

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

void register_dispatch() {
  if (fallback_lib) return;
  fallback_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                                  __FILE__, __LINE__);
  fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&sim_kernel>());
  aten_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                              __LINE__);
  aten_lib->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten_lib->impl("empty_strided", TORCH_FN(empty_strided));
  aten_lib->impl("_copy_from", TORCH_FN(copy_from));
  aten_lib->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  aten_lib->impl("view", TORCH_FN(view));
  aten_lib->impl("as_strided", TORCH_FN(as_strided));
  aten_lib->impl("_reshape_alias", TORCH_FN(reshape_alias));
  aten_lib->impl("unfold", TORCH_FN(unfold));
  aten_lib->impl("view_as_real", TORCH_FN(view_as_real));
  aten_lib->impl("view_as_complex", TORCH_FN(view_as_complex));
  aten_lib->impl("resize_", TORCH_FN(resize_));
  aten_lib->impl("set_.source_Tensor", TORCH_FN(set_tensor));
  aten_lib->impl("set_.source_Storage", TORCH_FN(set_storage));
  aten_lib->impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  aten_lib->impl("is_set_to", TORCH_FN(is_set_to));
  autograd_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                                  __FILE__, __LINE__);
  autograd_lib->impl("_has_compatible_shallow_copy_type", TORCH_FN(shallow_copy_compatible));
  static const std::set<std::string> native_here = {
      "empty.memory_format", "empty_strided", "_copy_from", "_copy_from_and_resize", "view", "as_strided",
      "_reshape_alias", "unfold", "view_as_real", "view_as_complex", "resize_", "set_.source_Tensor",
      "set_.source_Storage", "set_.source_Storage_storage_offset", "is_set_to"};
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
    // backend has a kernel of its own for it (silu_backward): registering would change that.
    if (!explicit_composite || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      continue;
    }
    if (returns_view(op->schema()) || !takes_tensors(op->schema())) continue;
    aten_lib->impl(spec.c_str(), torch::CppFunction::makeFromBoxedFunction<&sim_kernel>());
  }
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&sdp_choice);
}

void set_profile(std::optional<std::vector<std::string>> ops, const std::string& name) {
  std::lock_guard<std::mutex> lock(switch_mutex);
  profile_ops = ops.has_value() ? std::make_shared<const std::unordered_set<std::string>>(ops->begin(), ops->end())
                                : nullptr;
  profile_name = name;
  profile_gen.fetch_add(1);
}

void set_reduced_precision(bool on) { reduced_precision.store(on); }

void clear_round_cache() { clear_rounded(); }

void set_fallback_cpu(bool on) { fallback_cpu.store(on); }

void set_slow_ops(const std::map<std::string, double>& ops) {
  std::lock_guard<std::mutex> lock(switch_mutex);
  slow_ops = ops;
  slow_gen.fetch_add(1);
  any_slow.store(!ops.empty());
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
  launch_hook.store(hook);
  faulty.store(faulty_devices);
}

void enter_op(const std::string& qualified_name, const std::string& overload) {
  enter(info_of(c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name.c_str(), overload.c_str())));
}

at::Tensor host_view(const at::Tensor& t) {
  TORCH_CHECK(is_sim(t), "host_view expects a sim tensor, got one on ", t.device());
  drop_rounded(t.storage().unsafeGetStorageImpl());  // whoever holds it may write through it
  return alias_of(t);
}

at::Tensor adopt(const at::Tensor& cpu, int dev) {
  TORCH_CHECK(cpu.device().is_cpu(), "adopt expects a CPU tensor, got one on ", cpu.device());
  return on_storage(adopt_storage(cpu.storage(), check_index(dev)), cpu, kSimKeys, false);
}

at::Generator generator(int dev) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  at::Generator& g = generators.at(dev);
  if (!g.defined()) g = at::detail::createCPUGenerator();
  return g;
}

}  // namespace sim

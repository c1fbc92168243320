// Per-op facts sim's kernel needs, read from each op's schema once and cached per schema.
#include "dispatch.h"

#include <map>
#include <mutex>
#include <set>
#include <unordered_map>

namespace sim::detail {
namespace {

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

// Composites whose arguments must partly stay on the host (lengths, batch sizes), and out= wrappers of
// functional ops sim implements itself (their composite calls the functional op, which the CPU lacks):
// see OpInfo. So is every out= wrapper of an op with a host kernel (make_info).
const std::set<std::string> kDeviceComposite = {"aten::_pack_padded_sequence.default",
                                                "aten::_pack_padded_sequence.out", "aten::_resize_output.out"};

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
  if (!info->composite && op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    info->composite = true;
    info->composite_key = c10::DispatchKey::CompositeImplicitAutograd;
  }
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
  auto hk = host_kernels().find(info->full);
  if (hk != host_kernels().end()) info->host_kernel = hk->second;
  bool wraps_host_kernel = false;
  for (const std::string& f : info->functional) wraps_host_kernel = wraps_host_kernel || host_kernels().count(f) > 0;
  // A Storage argument has no host view: a composite taking one (set.source_Storage, the functional set_)
  // runs on the sim tensors, its set_ on sim's storage.
  bool takes_storage = false;
  for (const auto& a : args) takes_storage = takes_storage || a.type()->kind() == c10::TypeKind::StorageType;
  info->device_composite = info->composite && (kDeviceComposite.count(info->full) > 0 || takes_storage ||
                                               (info->host_kernel == nullptr && wraps_host_kernel));
  info->histc = info->full == "aten::histc.default";
  return info;
}

}  // namespace

const std::map<std::string, HostKernel>& host_kernels() {
  static const auto* table = [] {
    auto* t = new std::map<std::string, HostKernel>();
    add_semantic_kernels(*t);
    add_lane_kernels(*t);
    add_accelerator_kernels(*t);
    return t;
  }();
  return *table;
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

}  // namespace sim::detail

// The kernels sim implements itself rather than through the CPU: allocation, copies between devices,
// views (they must share the sim tensor's storage), resize/set_, and the CPU attention selector's
// view of sim tensors. Each still enters like the boxed kernel (trace, profile).
#include "dispatch.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/is_set_to_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>

namespace sim::detail {
namespace {

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

// A negative view of a wide unsigned tensor (_neg_view) materializes as -x mod 2^bits, the two's-complement
// negation of its signed view: the CPU's copy_ negates through its neg kernel, which has no uint16/32/64 (sim's
// neg is semantics_lanes.cpp's).
at::Tensor without_neg_bit(const at::Tensor& src) {
  c10::ScalarType t = src.scalar_type();
  if (!src.is_neg() || (t != at::kUInt16 && t != at::kUInt32 && t != at::kUInt64)) return src;
  c10::ScalarType s = t == at::kUInt16 ? at::kShort : t == at::kUInt32 ? at::kInt : at::kLong;
  return at::_neg_view(src).view(s).neg().view(t);  // (_neg_view flips the bit off)
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (is_sim(dst)) drop_rounded(dst.storage().unsafeGetStorageImpl());
  at::Tensor d = host_or_self(dst);
  int dev = is_sim(dst) ? dst.device().index() : self.device().index();
  claim(dev);
  Turn turn(dev);  // a copy to or from a shared device takes its turn like a kernel
  d.copy_(without_neg_bit(host_or_self(self)), non_blocking);
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

// What torch's refs and out= wrappers call to size an out= tensor (it has a Meta kernel only): the
// device check and resize_output's semantics (a warning when a non-empty tensor is resized).
const at::Tensor& resize_output_(const at::Tensor& self, c10::SymIntArrayRef size, c10::Device device) {
  SIM_ENTER("aten::_resize_output_", "");
  // "sim" without an index is the current device, as in every other device argument
  c10::Device want = device.type() == kSim && !device.has_index()
                         ? c10::Device(kSim, static_cast<c10::DeviceIndex>(current_device()))
                         : device;
  TORCH_CHECK(self.device() == want, "out Tensor doesn't have the correct device set");
  at::native::resize_output(self, C10_AS_INTARRAYREF_SLOW(size));
  return self;
}

at::Tensor resize_output(const at::Tensor& self, c10::SymIntArrayRef size, c10::Device device) {
  SIM_ENTER("aten::_resize_output", "");
  at::Tensor out = self.clone();
  resize_output_(out, size, device);
  return out;
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

}  // namespace

std::vector<std::string> register_native_kernels(torch::Library& aten, torch::Library& autograd) {
  aten.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten.impl("empty_strided", TORCH_FN(empty_strided));
  aten.impl("_copy_from", TORCH_FN(copy_from));
  aten.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  aten.impl("view", TORCH_FN(view));
  aten.impl("as_strided", TORCH_FN(as_strided));
  aten.impl("_reshape_alias", TORCH_FN(reshape_alias));
  aten.impl("unfold", TORCH_FN(unfold));
  aten.impl("view_as_real", TORCH_FN(view_as_real));
  aten.impl("view_as_complex", TORCH_FN(view_as_complex));
  aten.impl("resize_", TORCH_FN(resize_));
  aten.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  aten.impl("set_.source_Storage", TORCH_FN(set_storage));
  aten.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  aten.impl("is_set_to", TORCH_FN(is_set_to));
  aten.impl("_resize_output_", TORCH_FN(resize_output_));
  aten.impl("_resize_output", TORCH_FN(resize_output));
  autograd.impl("_has_compatible_shallow_copy_type", TORCH_FN(shallow_copy_compatible));
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&sdp_choice);
  return {"empty.memory_format", "empty_strided", "_copy_from", "_copy_from_and_resize", "view", "as_strided",
          "_reshape_alias", "unfold", "view_as_real", "view_as_complex", "resize_", "set_.source_Tensor",
          "set_.source_Storage", "set_.source_Storage_storage_offset", "is_set_to", "_resize_output_",
          "_resize_output"};
}

}  // namespace sim::detail

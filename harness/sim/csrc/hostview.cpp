// Host views and adoption: a sim tensor's memory seen as a CPU tensor (what the CPU kernel runs on), a
// CPU kernel's output taken over as sim memory without a copy, and writes carried back.
#include "dispatch.h"

#include <c10/core/CPUAllocator.h>

namespace sim::detail {

const c10::DispatchKeySet kSimKeys(c10::DispatchKey::PrivateUse1);

void release_ref(void* ctx) { delete static_cast<c10::intrusive_ptr<c10::StorageImpl>*>(ctx); }

bool is_sim(const at::Tensor& t) { return t.defined() && t.device().type() == kSim; }

// The host side of a sim storage: a CPU storage on the same memory. It is new (resizable by the CPU
// allocator, so an out= kernel may grow it: `sync_back` then moves the new memory to the device) and
// keeps the sim storage alive.
c10::Storage host_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const c10::DataPtr& sdp = s->_mutable_data_ptr_no_checks();
  TORCH_CHECK(is_device_data(sdp) || sdp.get() == nullptr,
              "this sim tensor has no sim memory behind it (a fake or meta storage reached the sim kernels)");
  auto* ref = new c10::intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
  c10::DataPtr dp(sdp.get(), ref, &release_ref, c10::Device(c10::kCPU));
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), s->nbytes(),
                                                            std::move(dp), c10::GetCPUAllocator(),
                                                            /*resizable=*/true));
}

// A CPU tensor with `t`'s geometry on `host` (the host side of t's storage). It carries the sim
// tensor's requires_grad (some CPU kernels choose a path by it) and its ZeroTensor key.
at::Tensor alias_on(const at::Tensor& t, c10::Storage host) {
  c10::DispatchKeySet keys(c10::DispatchKey::CPU);
  if (t._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);  // no memory behind it to read
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(host), keys, t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  at::Tensor out(std::move(impl));
  if (t.is_conj()) out._set_conj(true);
  if (t.is_neg()) out._set_neg(true);
  if (t.requires_grad()) out.set_requires_grad(true);
  return out;
}

at::Tensor alias_of(const at::Tensor& t) { return alias_on(t, host_storage(t)); }

c10::Storage adopt_storage(const c10::Storage& cpu, int dev) {
  c10::StorageImpl* s = cpu.unsafeGetStorageImpl();
  size_t n = s->nbytes();
  if (!account_alloc(dev, n)) throw_oom(dev, n);
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

// After a kernel wrote through `alias`: carry any resize (new memory, new geometry) or set_ back to the
// sim tensor, as the same op on a device would have left it.
void sync_back(const at::Tensor& sim, const at::Tensor& alias, c10::StorageImpl* made, int dev) {
  c10::TensorImpl* si = sim.unsafeGetTensorImpl();
  c10::TensorImpl* ai = alias.unsafeGetTensorImpl();
  c10::StorageImpl* now = ai->has_storage() ? ai->storage().unsafeGetStorageImpl() : nullptr;
  if (now != made && now != nullptr) {
    si->set_storage_keep_dtype(adopt_storage(ai->storage(), dev));
  } else if (made->_mutable_data_ptr_no_checks().get_deleter() != &release_ref) {
    // The CPU kernel grew the memory: the new allocation becomes the device storage's, and the host
    // storage (which other arguments of the call may share) views it again, so this happens once.
    c10::StorageImpl* dst = si->storage().unsafeGetStorageImpl();
    size_t n = made->nbytes();
    c10::DataPtr fresh = made->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
    if (!account_alloc(dev, n)) throw_oom(dev, n);
    void* data = fresh.get();
    dst->set_data_ptr_noswap(device_data(std::move(fresh), {}, data, dev, n));
    dst->set_nbytes(n);
    auto* ref = new c10::intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(dst));
    made->set_data_ptr_noswap(c10::DataPtr(data, ref, &release_ref, c10::Device(c10::kCPU)));
  }
  if (si->sizes() != ai->sizes() || si->strides() != ai->strides() || si->storage_offset() != ai->storage_offset()) {
    si->set_sizes_and_strides(ai->sizes(), ai->strides(), ai->storage_offset());
  }
}

}  // namespace sim::detail

namespace sim {
using namespace detail;

at::Tensor host_view(const at::Tensor& t) {
  TORCH_CHECK(is_sim(t), "host_view expects a sim tensor, got one on ", t.device());
  drop_rounded(t.storage().unsafeGetStorageImpl());  // whoever holds it may write through it
  return alias_of(t);
}

at::Tensor adopt(const at::Tensor& cpu, int dev) {
  TORCH_CHECK(cpu.device().is_cpu(), "adopt expects a CPU tensor, got one on ", cpu.device());
  return on_storage(adopt_storage(cpu.storage(), check_index(dev)), cpu, kSimKeys, false);
}

}  // namespace sim

// The hooks torch asks a PrivateUse1 backend for (as OpenReg's OpenRegHooks): the device count and the
// current device, pinned host memory (host_allocator.cpp), generators (generator.cpp), and resizing a
// storage in place (untyped_storage().resize_()).
#include "dispatch.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstring>

namespace sim::detail {
namespace {

struct SimHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(device_count()); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_current_device(static_cast<c10::DeviceIndex>(check_index(device)));
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    c10::DeviceIndex old = current_device();
    setCurrentDevice(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    c10::DeviceIndex old = current_device();
    if (device >= 0 && device < device_count()) set_current_device(device);
    return old;
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index < 0 ? current_device() : check_index(device_index));
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    int dev = device_index < 0 ? current_device() : check_index(device_index);
    return make_generator(static_cast<c10::DeviceIndex>(dev), c10::default_rng_seed_val);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* s = storage.unsafeGetStorageImpl();
    TORCH_CHECK(s->resizable(), "Trying to resize storage that is not resizable");
    drop_rounded(s);
    c10::Device device = s->data_ptr().device();
    c10::DeviceGuard guard(device);
    c10::DataPtr fresh = allocator()->allocate(newsize);
    size_t keep = std::min(newsize, s->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), s->data(), keep);
    s->set_data_ptr_noswap(std::move(fresh));
    s->set_nbytes(newsize);
  }
};

}  // namespace

void register_hooks() {
  static bool done = false;
  if (done || at::isPrivateUse1HooksRegistered()) return;
  at::RegisterPrivateUse1HooksInterface(new SimHooks());
  done = true;
}

}  // namespace sim::detail

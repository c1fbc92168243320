// The device APIs torch asks a PrivateUse1 backend's hooks for: pinned host memory (Tensor.pin_memory,
// DataLoader(pin_memory=True)), generators (torch.Generator("sim"), each device's default RNG), and
// resizing a storage in place (untyped_storage().resize_()).
//
// Pinned memory is host memory from the CPU allocator, remembered so is_pinned() can answer: a copy from
// it to sim is what any host-to-sim copy is. A sim generator reports its sim device but keeps its state
// in a CPU generator (its twin), which the CPU kernels sim runs draw from (they accept CPU generators
// only): seeding sim:N and seeding a CPU generator alike give the same numbers.
#include "dispatch.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GeneratorImpl.h>

#include <array>
#include <cstring>
#include <map>
#include <mutex>

namespace sim::detail {
namespace {

// ---- pinned host memory ----------------------------------------------------------------------------

std::mutex pinned_mutex;
std::map<const char*, size_t> pinned;  // start -> bytes of every live pinned block

struct PinnedBlock {
  c10::DataPtr host;
};

void release_pinned(void* ctx) {
  auto* block = static_cast<PinnedBlock*>(ctx);
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(static_cast<const char*>(block->host.get()));
  }
  delete block;
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr host = c10::GetCPUAllocator()->allocate(n);
    void* data = host.get();
    if (data != nullptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned[static_cast<const char*>(data)] = n;
    }
    return c10::DataPtr(data, new PinnedBlock{std::move(host)}, &release_pinned, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PinnedAllocator& pinned_allocator = *new PinnedAllocator();  // never destroyed: storages may outlive statics

bool is_pinned(const void* data) {
  const char* p = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned.upper_bound(p);
  if (it == pinned.begin()) return false;
  --it;
  return p < it->first + it->second || p == it->first;
}

// ---- generators ------------------------------------------------------------------------------------

struct SimGenerator final : c10::GeneratorImpl {
  at::Generator twin;
  SimGenerator(c10::DeviceIndex index, at::Generator cpu)
      : c10::GeneratorImpl(c10::Device(kSim, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        twin(std::move(cpu)) {}
  void set_current_seed(uint64_t seed) override { twin.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { twin.set_offset(offset); }
  uint64_t get_offset() const override { return twin.get_offset(); }
  uint64_t current_seed() const override { return twin.current_seed(); }
  uint64_t seed() override { return twin.seed(); }
  void set_state(const c10::TensorImpl& state) override { twin.unsafeGetGeneratorImpl()->set_state(state); }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return twin.unsafeGetGeneratorImpl()->get_state();
  }

 private:
  SimGenerator* clone_impl() const override { return new SimGenerator(device_.index(), twin.clone()); }
};

std::mutex generator_mutex;
std::array<at::Generator, kMaxDevices> generators;

at::Generator make_generator(c10::DeviceIndex index, uint64_t seed) {
  return at::make_generator<SimGenerator>(index, at::make_generator<at::CPUGeneratorImpl>(seed));
}

const at::Generator& default_generator(int dev) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  at::Generator& g = generators.at(dev);
  if (!g.defined()) g = make_generator(static_cast<c10::DeviceIndex>(dev), c10::default_rng_seed_val);
  return g;
}

// ---- the hooks -------------------------------------------------------------------------------------

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
  at::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
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

// The CPU generator a CPU kernel draws from for `g` (sim's, or the default one of sim:dev when undefined):
// a sim generator's twin. A generator of another device is refused as CUDA refuses a CPU one.
at::Generator host_generator(const std::optional<at::Generator>& g, int dev) {
  if (!g.has_value() || !g->defined()) return static_cast<SimGenerator*>(default_generator(dev).unsafeGetGeneratorImpl())->twin;
  c10::GeneratorImpl* impl = g->unsafeGetGeneratorImpl();
  TORCH_CHECK(impl->device().type() == kSim, "Expected a 'sim' device type for generator but found '",
              impl->device().type(), "'");
  return static_cast<SimGenerator*>(impl)->twin;
}

void register_hooks() {
  static bool done = false;
  if (done || at::isPrivateUse1HooksRegistered()) return;
  at::RegisterPrivateUse1HooksInterface(new SimHooks());
  done = true;
}

}  // namespace sim::detail

namespace sim {

at::Generator generator(int dev) { return detail::default_generator(dev); }

}  // namespace sim

// sim's generators (as OpenReg's OpenRegGenerator): torch.Generator("sim") and each device's default RNG.
// A sim generator reports its sim device but keeps its state in a CPU generator (its twin), which the CPU
// kernels sim runs draw from (they accept CPU generators only): seeding sim:N and seeding a CPU generator
// alike give the same numbers.
#include "dispatch.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GeneratorImpl.h>

#include <array>
#include <mutex>

namespace sim::detail {
namespace {

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

}  // namespace

at::Generator make_generator(c10::DeviceIndex index, uint64_t seed) {
  return at::make_generator<SimGenerator>(index, at::make_generator<at::CPUGeneratorImpl>(seed));
}

const at::Generator& default_generator(int dev) {
  std::lock_guard<std::mutex> lock(generator_mutex);
  at::Generator& g = generators.at(dev);
  if (!g.defined()) g = make_generator(static_cast<c10::DeviceIndex>(dev), c10::default_rng_seed_val);
  return g;
}

// The CPU generator a CPU kernel draws from for `g` (sim's, or the default one of sim:dev when undefined):
// a sim generator's twin. A generator of another device is refused as CUDA refuses a CPU one.
at::Generator host_generator(const std::optional<at::Generator>& g, int dev) {
  if (!g.has_value() || !g->defined()) return static_cast<SimGenerator*>(default_generator(dev).unsafeGetGeneratorImpl())->twin;
  c10::GeneratorImpl* impl = g->unsafeGetGeneratorImpl();
  TORCH_CHECK(impl->device().type() == kSim, "Expected a 'sim' device type for generator but found '",
              impl->device().type(), "'");
  return static_cast<SimGenerator*>(impl)->twin;
}

}  // namespace sim::detail

namespace sim {

at::Generator generator(int dev) { return detail::default_generator(dev); }

}  // namespace sim

// sim's device guard (as OpenReg's OpenRegGuard). torch's Python-registered PrivateUse1 guard reports one
// device and ignores setDevice, so the autograd engine would have a ready queue for sim:0 only. This one
// reports the live device count, keeps this thread's current device (devices.cpp), and hands stream and
// event calls to streams.cpp: every stream is idle and every event complete, kernels being synchronous.
#include "sim.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

namespace sim {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;

struct SimGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kSim, current_device()); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kSim, "sim device guard got a ", d.type(), " device");
    set_current_device(static_cast<DeviceIndex>(check_index(d.index())));
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kMaxDevices) set_current_device(d.index());
  }
  // "sim" without an index is the current device (torch.Stream(device="sim")), as CUDA's streams take it
  Device indexed(Device d) const { return d.has_index() ? d : getDevice(); }
  Stream getStream(Device d) const override {
    d = indexed(d);
    return Stream(Stream::UNSAFE, d, current_stream(d.index()));
  }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, indexed(d)); }
  Stream getStreamFromGlobalPool(Device d, bool /*isHighPriority*/) const override { return getNewStream(d, 0); }
  Stream getNewStream(Device d, int /*priority*/) const override {
    return Stream(Stream::UNSAFE, indexed(d), new_stream_id());
  }
  Stream exchangeStream(Stream s) const override {
    Device d = indexed(s.device());
    Stream old = getStream(d);
    set_stream(d.index(), s.id());
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(device_count()); }
  // Kernels run synchronously on the host: every stream is idle, every event has completed.
  void record(void** event, const Stream& /*stream*/, const DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {
    record_event(event);
  }
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex /*device_index*/) const noexcept override { destroy_event(event); }
  bool queryStream(const Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}
  double elapsedTime(void* event1, void* event2, const DeviceIndex /*device_index*/) const override {
    return elapsed_ms(event1, event2);
  }
};

// Never destroyed: torch may still call it while the process exits.
SimGuard& the_guard = *new SimGuard();

}  // namespace

void register_device() {
  c10::impl::registerDeviceGuard(kSim, &the_guard);
  c10::SetAllocator(kSim, allocator(), /*priority=*/UINT8_MAX);
}

}  // namespace sim

// The part of the sim backend PyTorch only accepts from C++ (see harness/sim/native.py):
//
// - a device guard: torch's Python-registered PrivateUse1 guard (torch/csrc/acc/Module.cpp) reports
//   one device and ignores setDevice, so the autograd engine has a ready queue for sim:0 only and
//   backward through sim:1 trips an internal assert. This one tracks a per-thread current device and
//   stream, reports the live device count, and keeps events (with timestamps) and streams as no-ops
//   that order trivially: every sim kernel has finished when its Python call returns.
// - a c10::DeviceAllocator, which torch.accelerator's memory API requires of a backend; its
//   statistics are sim's simulated device memory (below).
// - device memory accounting: a sim tensor's memory is a host storage. The first time a host storage
//   backs a sim tensor it is "claimed": its DataPtr is wrapped so that freeing it credits the device,
//   and the claim carries the device-typed storage alias that `SimTensor.untyped_storage()` returns
//   (same data pointer, one alias per host storage, alive as long as the host storage).
//
// Only c10 and the CPython API are used, so this builds in seconds.
#include <Python.h>

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/COW.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;
using c10::CachingDeviceAllocator::DeviceStats;
using Stat = c10::CachingAllocator::Stat;
using StatType = c10::CachingAllocator::StatType;

constexpr auto kSim = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 64;
constexpr size_t kLargeBytes = 1 << 20;  // CUDA's small/large pool boundary, for memory_stats()

// Same variable and default as harness/sim/device.py, read live like torch.sim.device_count().
int device_count() noexcept {
  const char* raw = std::getenv("PORTHARNESS_SIM_DEVICES");
  if (raw == nullptr || *raw == '\0') return 2;
  long n = std::strtol(raw, nullptr, 10);
  return n < 1 ? 1 : (n > kMaxDevices ? kMaxDevices : static_cast<int>(n));
}

// Per thread, as on CUDA: the autograd engine's worker for sim:1 sets its own current device.
thread_local DeviceIndex current_device = 0;
thread_local std::array<StreamId, kMaxDevices> current_streams{};
std::atomic<StreamId> next_stream_id{1};

// ---- memory accounting ---------------------------------------------------------------------------

struct DeviceMemory {
  Stat bytes[3];  // indexed by StatType: aggregate, small pool, large pool
  Stat blocks[3];
  int64_t num_ooms = 0;
  int64_t limit = INT64_MAX;
};

std::mutex memory_mutex;
std::array<DeviceMemory, kMaxDevices> memory;

size_t pool_of(size_t bytes) {
  return static_cast<size_t>(bytes >= kLargeBytes ? StatType::LARGE_POOL : StatType::SMALL_POOL);
}

// Returns false (and counts an OOM) when `bytes` more would not fit on `dev`.
bool account_alloc(int dev, size_t bytes, bool enforce) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory[dev];
  auto& total = m.bytes[static_cast<size_t>(StatType::AGGREGATE)];
  if (enforce && total.current + static_cast<int64_t>(bytes) > m.limit) {
    m.num_ooms++;
    return false;
  }
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool_of(bytes)}) {
    m.bytes[i].increase(bytes);
    m.blocks[i].increase(1);
  }
  return true;
}

void account_free(int dev, size_t bytes) {
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory[dev];
  for (size_t i : {static_cast<size_t>(StatType::AGGREGATE), pool_of(bytes)}) {
    m.bytes[i].decrease(bytes);
    m.blocks[i].decrease(1);
  }
}

// Context of a claimed host storage's DataPtr.
struct Claim {
  c10::DataPtr original;
  int dev;
  size_t bytes;
  c10::StorageImpl* host;  // the claimed storage (this Claim lives inside it)
  c10::intrusive_ptr<c10::StorageImpl> alias;  // the sim-typed view, created on first request
};

// Deleter of an alias's DataPtr, which owns nothing: it marks the context as the alias's Claim.
void alias_marker(void* /*unused*/) {}

// Deleter of a DeviceAllocator allocation's DataPtr: its context is a strong reference to the
// (claimed) host storage that holds the memory.
void release_host_ref(void* ctx) {
  delete static_cast<c10::intrusive_ptr<c10::StorageImpl>*>(ctx);
}

void release_claim(void* ctx) {
  auto* claim = static_cast<Claim*>(ctx);
  account_free(claim->dev, claim->bytes);
  if (claim->alias) {
    // Someone still holding the alias after every tensor on it died gets an empty storage, never a
    // dangling pointer.
    claim->alias->set_data_ptr_noswap(c10::DataPtr(nullptr, Device(kSim, claim->dev)));
    claim->alias->set_nbytes(0);
  }
  delete claim;  // frees the host memory through the original DataPtr
}

c10::StorageImpl* claimable_storage(PyObject* cdata) {
  auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(cdata));
  if (impl == nullptr || !impl->has_storage()) return nullptr;
  c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
  // Only real host memory: not fake/meta/functional tensors (torch.compile tracing), not empty ones,
  // not copy-on-write storages (wrapping their DataPtr would hide the COW context).
  if (storage == nullptr || storage->device_type() != c10::DeviceType::CPU) return nullptr;
  const c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get() == nullptr || c10::impl::cow::is_cow_data_ptr(dp)) return nullptr;
  return storage;
}

Claim* claim_of(c10::StorageImpl* storage) {
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  return dp.get_deleter() == &release_claim ? static_cast<Claim*>(dp.get_context()) : nullptr;
}

// 0: claimed (now or before) or nothing to claim; otherwise the bytes that did not fit.
int64_t claim(c10::StorageImpl* storage, int dev, bool enforce) {
  if (claim_of(storage) != nullptr) return 0;
  size_t bytes = storage->nbytes();
  if (!account_alloc(dev, bytes, enforce)) return static_cast<int64_t>(bytes);
  c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  void* data = dp.get();
  Device device = dp.device();
  auto* ctx = new Claim{std::move(dp), dev, bytes, storage, {}};
  storage->set_data_ptr_noswap(c10::DataPtr(data, ctx, &release_claim, device));
  return 0;
}

struct SimAllocator final : c10::DeviceAllocator {
  // A device storage made directly (torch.UntypedStorage(n, device="sim"), how torch.load maps
  // storages to a device): its memory is a claimed host storage, which sim tensors set_ to it use.
  c10::DataPtr allocate(size_t n) override {
    int dev = current_device;
    auto host = c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), n, c10::GetAllocator(c10::DeviceType::CPU), /*resizable=*/false);
    TORCH_CHECK_WITH(OutOfMemoryError, claim(host.get(), dev, true) == 0, "sim:", dev, " out of memory. Tried to allocate ",
                     n, " bytes (simulated device memory; set PORTHARNESS_SIM_MEMORY_MB to change it)");
    void* data = host->mutable_data();
    return c10::DataPtr(data, new c10::intrusive_ptr<c10::StorageImpl>(std::move(host)), &release_host_ref,
                        Device(kSim, dev));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*unused*/) override {}  // nothing is cached: freed means freed
  void recordStream(const c10::DataPtr& /*unused*/, Stream /*unused*/) override {}
  DeviceStats getDeviceStats(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory_mutex);
    const DeviceMemory& m = memory.at(device);
    DeviceStats s;
    for (size_t i = 0; i < 3; ++i) {
      // Nothing is cached, so reserved == allocated == active, one segment per block.
      s.allocated_bytes[i] = s.reserved_bytes[i] = s.active_bytes[i] = s.requested_bytes[i] = m.bytes[i];
      s.allocation[i] = s.segment[i] = s.active[i] = m.blocks[i];
    }
    s.num_ooms = m.num_ooms;
    s.num_device_alloc = m.blocks[0].allocated;
    s.num_device_free = m.blocks[0].freed;
    return s;
  }
  void resetAccumulatedStats(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory_mutex);
    DeviceMemory& m = memory.at(device);
    for (size_t i = 0; i < 3; ++i) {
      m.bytes[i].reset_accumulated();
      m.blocks[i].reset_accumulated();
    }
    m.num_ooms = 0;
  }
  void resetPeakStats(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory_mutex);
    DeviceMemory& m = memory.at(device);
    for (size_t i = 0; i < 3; ++i) {
      m.bytes[i].reset_peak();
      m.blocks[i].reset_peak();
    }
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(memory_mutex);
    const DeviceMemory& m = memory.at(device);
    int64_t used = m.bytes[0].current;
    return {static_cast<size_t>(m.limit > used ? m.limit - used : 0), static_cast<size_t>(m.limit)};
  }
};

// Never destroyed: torch may still call them while the process exits.
SimAllocator& allocator = *new SimAllocator();

// ---- device guard --------------------------------------------------------------------------------

struct Event {
  std::chrono::steady_clock::time_point at;
};

struct SimGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(kSim, current_device); }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kSim, "sim device guard got a ", d.type(), " device");
    TORCH_CHECK(d.index() >= 0 && d.index() < device_count(), "sim device index ", static_cast<int>(d.index()),
                " out of range: ", device_count(), " simulated devices (set PORTHARNESS_SIM_DEVICES to simulate more)");
    current_device = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < kMaxDevices) current_device = d.index();
  }
  Stream getStream(Device d) const override {
    return Stream(Stream::UNSAFE, d, current_streams.at(d.index()));
  }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream getStreamFromGlobalPool(Device d, bool /*isHighPriority*/) const override {
    return getNewStream(d, 0);
  }
  Stream getNewStream(Device d, int /*priority*/) const override {
    return Stream(Stream::UNSAFE, d, next_stream_id++);
  }
  Stream exchangeStream(Stream s) const override {
    Stream old = getStream(s.device());
    current_streams.at(s.device_index()) = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return static_cast<DeviceIndex>(device_count()); }
  // Kernels run synchronously on the host: every stream is idle, every event has completed.
  void record(void** event, const Stream& /*stream*/, const DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) *event = new Event();
    static_cast<Event*>(*event)->at = std::chrono::steady_clock::now();
  }
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* event, const DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const Stream& /*stream*/) const override {}
  void synchronizeEvent(void* /*event*/) const override {}
  void synchronizeDevice(const DeviceIndex /*device_index*/) const override {}
  double elapsedTime(void* event1, void* event2, const DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(event1 != nullptr && event2 != nullptr,
                "Both events must be recorded before calculating elapsed time.");
    auto dt = static_cast<Event*>(event2)->at - static_cast<Event*>(event1)->at;
    return std::chrono::duration<double, std::milli>(dt).count();
  }
};

SimGuard& guard = *new SimGuard();

// ---- Python functions ----------------------------------------------------------------------------

// A C++ exception must not cross the CPython boundary: turn it into a RuntimeError.
#define SIM_TRY try {
#define SIM_CATCH                                      \
  }                                                    \
  catch (const std::exception& e) {                    \
    PyErr_SetString(PyExc_RuntimeError, e.what());     \
    return nullptr;                                    \
  }

bool device_arg(PyObject* obj, int* dev) {
  long d = PyLong_AsLong(obj);
  if (d == -1 && PyErr_Occurred()) return false;
  if (d < 0 || d >= kMaxDevices) {
    PyErr_Format(PyExc_IndexError, "sim device index %ld out of range", d);
    return false;
  }
  *dev = static_cast<int>(d);
  return true;
}

PyObject* py_register(PyObject* /*self*/, PyObject* /*unused*/) {
  SIM_TRY
  c10::impl::registerDeviceGuard(kSim, &guard);
  c10::SetAllocator(kSim, &allocator, /*priority=*/UINT8_MAX);
  Py_RETURN_NONE;
  SIM_CATCH
}

PyObject* py_current_device(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyLong_FromLong(current_device);
}

PyObject* py_set_device(PyObject* /*self*/, PyObject* arg) {
  int dev = 0;
  if (!device_arg(arg, &dev)) return nullptr;
  current_device = static_cast<DeviceIndex>(dev);
  Py_RETURN_NONE;
}

// claim(tensor._cdata, device, enforce) -> 0, or the bytes that did not fit on the device.
PyObject* py_claim(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  int dev = 0;
  if (nargs != 3 || !device_arg(args[1], &dev)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "claim(cdata, device, enforce)");
    return nullptr;
  }
  SIM_TRY
  c10::StorageImpl* storage = claimable_storage(args[0]);
  if (PyErr_Occurred()) return nullptr;
  return PyLong_FromLongLong(storage == nullptr ? 0 : claim(storage, dev, PyObject_IsTrue(args[2])));
  SIM_CATCH
}

// alias(tensor._cdata, device) -> address of the sim-typed StorageImpl aliasing the tensor's host
// storage (for torch.UntypedStorage._new_with_weak_ptr), or 0 if it has no host memory.
PyObject* py_alias(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  int dev = 0;
  if (nargs != 2 || !device_arg(args[1], &dev)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "alias(cdata, device)");
    return nullptr;
  }
  SIM_TRY
  c10::StorageImpl* storage = claimable_storage(args[0]);
  if (PyErr_Occurred()) return nullptr;
  if (storage == nullptr) return PyLong_FromLong(0);
  claim(storage, dev, /*enforce=*/false);  // already live memory: count it, never refuse it
  Claim* c = claim_of(storage);
  if (!c->alias) {
    c->alias = c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), c->bytes,
        c10::DataPtr(c->original.get(), c, &alias_marker, Device(kSim, c->dev)), &allocator, /*resizable=*/false);
  }
  return PyLong_FromVoidPtr(c->alias.get());
  SIM_CATCH
}

// host(storage._cdata) -> address of the host storage holding a sim storage's memory (for
// torch.UntypedStorage._new_with_weak_ptr), or 0 if it has none (freed, or not made by sim).
PyObject* py_host(PyObject* /*self*/, PyObject* arg) {
  auto* storage = static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(arg));
  if (storage == nullptr) return PyErr_Occurred() ? nullptr : PyLong_FromLong(0);
  const c10::DataPtr& dp = storage->_mutable_data_ptr_no_checks();
  if (dp.get_deleter() == &alias_marker) return PyLong_FromVoidPtr(static_cast<Claim*>(dp.get_context())->host);
  if (dp.get_deleter() == &release_host_ref) {
    return PyLong_FromVoidPtr(static_cast<c10::intrusive_ptr<c10::StorageImpl>*>(dp.get_context())->get());
  }
  return PyLong_FromLong(0);
}

PyObject* py_check(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  int dev = 0;
  if (nargs != 2 || !device_arg(args[0], &dev)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "fits(device, nbytes)");
    return nullptr;
  }
  long long bytes = PyLong_AsLongLong(args[1]);
  if (bytes == -1 && PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(memory_mutex);
  DeviceMemory& m = memory[dev];
  if (m.bytes[0].current + bytes <= m.limit) Py_RETURN_TRUE;
  m.num_ooms++;
  Py_RETURN_FALSE;
}

// stats(device) -> (bytes current, peak, allocated, freed, blocks current, peak, num_ooms, limit)
PyObject* py_stats(PyObject* /*self*/, PyObject* arg) {
  int dev = 0;
  if (!device_arg(arg, &dev)) return nullptr;
  std::lock_guard<std::mutex> lock(memory_mutex);
  const DeviceMemory& m = memory[dev];
  const Stat& b = m.bytes[0];
  return Py_BuildValue("(LLLLLLLL)", b.current, b.peak, b.allocated, b.freed, m.blocks[0].current,
                       m.blocks[0].peak, m.num_ooms, m.limit);
}

PyObject* py_set_limit(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  int dev = 0;
  if (nargs != 2 || !device_arg(args[0], &dev)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "set_limit(device, nbytes)");
    return nullptr;
  }
  long long bytes = PyLong_AsLongLong(args[1]);
  if (bytes == -1 && PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(memory_mutex);
  memory[dev].limit = bytes;
  Py_RETURN_NONE;
}

PyObject* py_reset_peak(PyObject* /*self*/, PyObject* arg) {
  int dev = 0;
  if (!device_arg(arg, &dev)) return nullptr;
  allocator.resetPeakStats(static_cast<DeviceIndex>(dev));
  Py_RETURN_NONE;
}

PyObject* py_reset_accumulated(PyObject* /*self*/, PyObject* arg) {
  int dev = 0;
  if (!device_arg(arg, &dev)) return nullptr;
  allocator.resetAccumulatedStats(static_cast<DeviceIndex>(dev));
  Py_RETURN_NONE;
}

PyObject* py_current_stream(PyObject* /*self*/, PyObject* arg) {
  int dev = 0;
  if (!device_arg(arg, &dev)) return nullptr;
  return PyLong_FromLongLong(current_streams[dev]);
}

PyObject* py_set_stream(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  int dev = 0;
  if (nargs != 2 || !device_arg(args[0], &dev)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "set_stream(device, stream_id)");
    return nullptr;
  }
  long long id = PyLong_AsLongLong(args[1]);
  if (id == -1 && PyErr_Occurred()) return nullptr;
  current_streams[dev] = id;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"register", py_register, METH_NOARGS, "install the device guard and allocator for PrivateUse1"},
    {"current_device", py_current_device, METH_NOARGS, "this thread's current sim device"},
    {"set_device", py_set_device, METH_O, "set this thread's current sim device"},
    {"claim", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(py_claim)), METH_FASTCALL,
     "count a tensor's host storage as sim device memory"},
    {"alias", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(py_alias)), METH_FASTCALL,
     "the sim storage aliasing a tensor's host storage"},
    {"host", py_host, METH_O, "the host storage behind a sim storage"},
    {"fits", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(py_check)), METH_FASTCALL,
     "whether nbytes more fit on the device (counts an OOM if not)"},
    {"stats", py_stats, METH_O, "memory counters of a device"},
    {"set_limit", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(py_set_limit)), METH_FASTCALL,
     "set a device's memory size in bytes"},
    {"reset_peak", py_reset_peak, METH_O, "reset a device's peak memory counters"},
    {"reset_accumulated", py_reset_accumulated, METH_O, "reset a device's cumulative memory counters"},
    {"current_stream", py_current_stream, METH_O, "id of this thread's current stream on a device"},
    {"set_stream", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(py_set_stream)), METH_FASTCALL,
     "make a stream id this thread's current stream on a device"},
    {nullptr, nullptr, 0, nullptr}};

#define SIM_STR2(x) #x
#define SIM_STR(x) SIM_STR2(x)
#define SIM_CAT2(a, b) a##b
#define SIM_CAT(a, b) SIM_CAT2(a, b)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, SIM_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC SIM_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return PyModule_Create(&module_def);
}

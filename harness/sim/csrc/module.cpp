// The Python face of sim's native backend: what harness/sim/*.py calls (register, switches, memory,
// streams, generators, host views) and the trampoline through which an injected fault reaches Python.
#include "sim.h"

#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>
#include <pybind11/stl.h>

namespace {

namespace py = pybind11;

// Owned by the module (freed with the interpreter is not worth the ordering trouble).
py::object* fault_hook = new py::object();

// Called by the dispatch path (no GIL) after a kernel on a faulty device made `fresh` outputs.
void call_fault_hook(int dev, const std::vector<at::Tensor>& fresh) {
  py::gil_scoped_acquire gil;
  if (!*fault_hook || fault_hook->is_none()) return;
  try {
    (*fault_hook)(dev, fresh);
  } catch (py::error_already_set& e) {
    // Keep the Python exception (SimDeviceError) whole, also across autograd's worker threads.
    e.restore();
    python_error err;
    err.persist();
    throw err;
  }
}

void set_fault_hook(py::object hook, const std::vector<int>& devices) {
  uint64_t mask = 0;
  for (int d : devices) mask |= uint64_t{1} << sim::check_index(d);
  *fault_hook = hook;
  sim::set_launch_hook(hook.is_none() ? nullptr : &call_fault_hook, hook.is_none() ? 0 : mask);
}

py::tuple stats(int dev) {
  sim::MemoryStats s = sim::memory_stats(dev);
  return py::make_tuple(s.current, s.peak, s.allocated, s.freed, s.blocks, s.blocks_peak, s.num_ooms, s.limit);
}

int device_arg(int dev) {
  TORCH_CHECK_INDEX(dev >= 0 && dev < sim::kMaxDevices, "sim device index ", dev, " out of range");
  return dev;
}

}  // namespace

namespace sim {
void bind_backend(pybind11::module_& m);  // backend.cpp: the c10d backend
}  // namespace sim

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sim's native backend (harness/sim/csrc)";
  m.def("register", [] {
    sim::register_device();
    sim::register_dispatch();
  }, "install the device guard, the allocator and the dispatch path for PrivateUse1");
  m.def("current_device", [] { return static_cast<int>(sim::current_device()); });
  m.def("set_device", [](int dev) { sim::set_current_device(static_cast<c10::DeviceIndex>(device_arg(dev))); });
  m.def("stats", [](int dev) { return stats(device_arg(dev)); },
        "(bytes current, peak, allocated, freed, blocks current, peak, num_ooms, limit)");
  m.def("set_limit", [](int dev, int64_t bytes) { sim::set_memory_limit(device_arg(dev), bytes); });
  m.def("mem_info", [](int dev) {
    HANDLE_TH_ERRORS
    return sim::memory_info(device_arg(dev));
    END_HANDLE_TH_ERRORS_PYBIND
  }, "(free, total) bytes; on a shared device every process's use counts (a use of the device)");
  m.def("claim", [](int dev) {
    HANDLE_TH_ERRORS
    sim::claim(device_arg(dev));
    END_HANDLE_TH_ERRORS_PYBIND
  }, "take the device for this process, as its first use does (raises if another process holds it)");
  m.def("claimed", [](int dev) { return sim::claimed(device_arg(dev)); });
  m.def("shared", [](int dev) { return sim::shared(device_arg(dev)); });
  m.def("physical_index", [](int dev) { return sim::physical_index(device_arg(dev)); });
  m.def("set_fraction", [](int dev, double f) { sim::set_fraction(device_arg(dev), f); });
  m.def("fraction", [](int dev) { return sim::fraction(device_arg(dev)); });
  m.def("tenants", [](int dev) { return sim::ledger_tenants(device_arg(dev)); },
        "(pid, bytes) of each process sharing the device (empty unless it is shared)");
  m.def("holders", [](int physical) { return sim::holders(device_arg(physical)); },
        "(pid, mode) of each process holding physical device `physical`");
  m.def("fits", [](int dev, int64_t bytes) { return sim::fits(device_arg(dev), bytes); });
  m.def("reset_peak", [](int dev) { sim::reset_peak(device_arg(dev)); });
  m.def("reset_accumulated", [](int dev) { sim::reset_accumulated(device_arg(dev)); });
  m.def("current_stream", [](int dev) { return sim::current_stream(device_arg(dev)); });
  m.def("set_stream", [](int dev, int64_t id) { sim::set_stream(device_arg(dev), id); });
  m.def("set_profile", &sim::set_profile, py::arg("ops"), py::arg("name"));
  m.def("set_reduced_precision", &sim::set_reduced_precision);
  m.def("clear_round_cache", &sim::clear_round_cache, "drop the bf16-rounded copies of parameters");
  m.def("set_fallback_cpu", &sim::set_fallback_cpu);
  m.def("set_slow_ops", &sim::set_slow_ops, py::arg("ops"), "op name -> slowdown factor (empty: none)");
  m.def("fallback_counts", [] {
    py::dict out;
    for (const auto& [name, n] : sim::fallback_counts()) out[py::str(name)] = n;
    return out;
  });
  m.def("reset_fallback_counts", &sim::reset_fallback_counts);
  m.def("start_trace", &sim::start_trace);
  m.def("stop_trace", &sim::stop_trace);
  m.def("set_fault_hook", &set_fault_hook, py::arg("hook"), py::arg("devices"));
  // torch's error translation (NotImplementedError, OutOfMemoryError...) for the calls that can fail.
  m.def("enter_op", [](const std::string& name, const std::string& overload) {
    HANDLE_TH_ERRORS
    sim::enter_op(name, overload);
    END_HANDLE_TH_ERRORS_PYBIND
  });
  m.def("host_view", [](const at::Tensor& t) {
    HANDLE_TH_ERRORS
    return sim::host_view(t);
    END_HANDLE_TH_ERRORS_PYBIND
  });
  m.def("adopt", [](const at::Tensor& t, int dev) {
    HANDLE_TH_ERRORS
    return sim::adopt(t, dev);
    END_HANDLE_TH_ERRORS_PYBIND
  });
  m.def("generator", [](int dev) { return sim::generator(device_arg(dev)); });
  sim::bind_backend(m);
}

// sim's c10d backend: a real `c10d::Backend` whose collectives are planned in Python.
//
// Why C++: DeviceMesh, DTensor, FSDP2 and the functional collectives find a process group by its name,
// which c10d keeps on the group's backends, and the functional ops (`_c10d_functional::*`) reach the
// backend registered for the tensor's device through the dispatcher, never a Python `ProcessGroup`
// subclass's methods. torch cannot construct a `c10d::Backend` from Python, so this one forwards each
// collective to a Python planner (`harness.comms.planner.ShapedCollectives`: the collective settings,
// over gloo on the host memory behind sim tensors) and wraps the future it returns in a Work.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>
#include <pybind11/chrono.h>

#include <algorithm>
#include <atomic>

namespace sim {

namespace py = pybind11;
using c10::ivalue::Future;

namespace {

// A Python exception raised by the planner, carried whole through the dispatcher to the caller.
[[noreturn]] void rethrow_python(py::error_already_set& e) {
  e.restore();
  python_error err;
  err.persist();
  throw err;
}

// Done when the planner's future is; its own future holds the caller's output tensors, as a c10d
// backend's must (DDP's reducer reads `value().toTensorVector()`), and `wait` raises a failed message.
class PlannedWork : public c10d::Work {
 public:
  PlannedWork(int rank, c10d::OpType op, const c10::intrusive_ptr<Future>& planned, std::vector<at::Tensor> outputs)
      : Work(rank, op),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<Future>(c10::ListType::create(c10::TensorType::get()))) {
    auto fut = future_;
    auto outs = outputs_;
    planned->addCallback([fut, outs](Future& done) {
      if (done.hasError()) {
        fut->setError(done.exception_ptr());
      } else {
        fut->markCompleted(c10::IValue(outs));
      }
    });
  }

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<Future> getFuture() override { return future_; }

  bool wait(std::chrono::milliseconds /*timeout: the transport's own applies*/) override {
    if (PyGILState_Check()) {  // the planner's callbacks need the GIL to complete the future
      py::gil_scoped_release nogil;
      future_->wait();
    } else {
      future_->wait();
    }
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<Future> future_;
};

// NCCL's PREMUL_SUM (FSDP2 uses it for a gradient divide factor) as a SUM of scaled inputs: the
// factor of `op`, or nullopt when `op` is not PREMUL_SUM.
std::optional<c10::Scalar> premul_factor(const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return std::nullopt;
  auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(s != nullptr, "PREMUL_SUM without a factor");
  if (s->tensor_factor.defined()) return s->tensor_factor.to(at::kCPU, at::kDouble).item();
  return c10::Scalar(s->double_factor);
}

template <typename Opts>
Opts summed(const Opts& opts) {
  Opts out = opts;
  out.reduceOp = c10d::ReduceOp(c10d::ReduceOp::SUM);
  return out;
}

class PlannedBackend : public c10d::Backend {
 public:
  PlannedBackend(py::object planner, int rank, int size, std::string name, std::chrono::milliseconds timeout)
      : Backend(rank, size), planner_(new py::object(std::move(planner))), name_(std::move(name)), timeout_(timeout) {}

  ~PlannedBackend() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete planner_;
    }  // else: the interpreter is gone, and the object with it
  }

  const std::string getBackendName() const override { return name_; }
  py::object planner() const { return *planner_; }

  // c10d names a group after making its backend; the planner's errors and harness.comms.planner.for_group use it.
  void setGroupUid(const std::string& pg_uid) override {
    Backend::setGroupUid(pg_uid);
    py::gil_scoped_acquire gil;
    planner_->attr("named")(pg_uid);
  }

  c10::intrusive_ptr<Options> getBackendOptions() override { return c10::make_intrusive<Options>(name_, timeout_); }

  // dist.split_group (DeviceMesh's way to make its groups once init_process_group bound a device, as NCCL does):
  // the planner makes the subgroup's planner over the store c10d gives; a rank outside `ranks` gets none.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    auto it = std::find(ranks.begin(), ranks.end(), getRank());
    if (it == ranks.end()) return nullptr;
    auto timeout = opts ? opts->timeout : timeout_;
    py::object sub;
    {
      py::gil_scoped_acquire gil;
      try {
        sub = planner_->attr("split")(store, ranks, timeout.count() / 1000.0);
      } catch (py::error_already_set& e) {
        rethrow_python(e);
      }
    }
    return c10::make_intrusive<PlannedBackend>(std::move(sub), static_cast<int>(it - ranks.begin()),
                                               static_cast<int>(ranks.size()), name_, timeout);
  }

  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return plan("broadcast", c10d::OpType::BROADCAST, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (auto f = premul_factor(opts.reduceOp)) {
      for (auto& t : tensors) t.mul_(*f);
      return plan("allreduce", c10d::OpType::ALLREDUCE, tensors, tensors, summed(opts));
    }
    return plan("allreduce", c10d::OpType::ALLREDUCE, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    if (auto f = premul_factor(opts.reduceOp)) {
      for (auto& t : tensors) t.mul_(*f);
      return plan("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, summed(opts));
    }
    return plan("allreduce_coalesced", c10d::OpType::ALLREDUCE_COALESCED, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    TORCH_CHECK(!premul_factor(opts.reduceOp), "sim supports PREMUL_SUM in all_reduce and reduce_scatter only");
    return plan("reduce", c10d::OpType::REDUCE, tensors, tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return plan("allgather", c10d::OpType::ALLGATHER, flat(outputs), outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return plan("allgather", c10d::OpType::ALLGATHER_COALESCED, flat(outputs), outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    return plan("all_gather_single", c10d::OpType::_ALLGATHER_BASE, {output}, output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return plan("allgather_into_tensor_coalesced", c10d::OpType::COALESCED, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return plan("gather", c10d::OpType::GATHER, flat(outputs), outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return plan("scatter", c10d::OpType::SCATTER, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    if (auto f = premul_factor(opts.reduceOp)) {
      std::vector<std::vector<at::Tensor>> scaled;
      for (auto& list : inputs) {
        scaled.emplace_back();
        for (auto& t : list) scaled.back().push_back(t.mul(*f));
      }
      return plan("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, outputs, scaled, summed(opts));
    }
    return plan("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    if (auto f = premul_factor(opts.reduceOp)) {
      return plan("reduce_scatter_single", c10d::OpType::_REDUCE_SCATTER_BASE, {output}, output, input.mul(*f),
                  summed(opts));
    }
    return plan("reduce_scatter_single", c10d::OpType::_REDUCE_SCATTER_BASE, {output}, output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    if (auto f = premul_factor(opts.reduceOp)) {
      std::vector<at::Tensor> scaled;
      for (auto& t : inputs) scaled.push_back(t.mul(*f));
      return plan("reduce_scatter_tensor_coalesced", c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, outputs, outputs,
                  scaled, summed(opts));
    }
    return plan("reduce_scatter_tensor_coalesced", c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, outputs, outputs,
                inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return plan("all_to_all_single", c10d::OpType::ALLTOALL_BASE, {output}, output, input, output_splits, input_splits,
                opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return plan("alltoall", c10d::OpType::ALLTOALL, outputs, outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return plan("send", c10d::OpType::SEND, tensors, tensors, dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return plan("recv", c10d::OpType::RECV, tensors, tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return plan("barrier", c10d::OpType::BARRIER, {}, opts);
  }

  void shutdown() override { call_if_defined("shutdown"); }
  void abort() override { call_if_defined("shutdown"); }

 private:
  static std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
    std::vector<at::Tensor> out;
    for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
    return out;
  }

  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> plan(const char* method, c10d::OpType op, std::vector<at::Tensor> outputs,
                                      Args&&... args) {
    seq_++;
    c10::intrusive_ptr<Future> planned;
    {
      py::gil_scoped_acquire gil;
      try {
        py::object fut = planner_->attr(method)(std::forward<Args>(args)...);
        planned = fut.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
      } catch (py::error_already_set& e) {
        rethrow_python(e);
      }
    }
    return c10::make_intrusive<PlannedWork>(getRank(), op, planned, std::move(outputs));
  }

  void call_if_defined(const char* method) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    try {
      if (py::hasattr(*planner_, method)) planner_->attr(method)();
    } catch (py::error_already_set& e) {
      rethrow_python(e);
    }
  }

  py::object* planner_;  // deleted under the GIL (see the destructor)
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::atomic<uint64_t> seq_{0};
};

}  // namespace

void bind_backend(py::module_& m) {
  // Registered so a group's backend is this type in Python: `dist.split_group` deep-copies `backend.options`.
  py::class_<PlannedBackend, c10d::Backend, c10::intrusive_ptr<PlannedBackend>>(m, "PlannedBackend")
      .def_property_readonly("options", [](const PlannedBackend& b) { return b.planner().attr("options")(); })
      .def_property_readonly("planner", &PlannedBackend::planner);
  m.def(
      "planned_backend",
      [](py::object planner, int rank, int size, const std::string& name,
         std::chrono::milliseconds timeout) -> c10::intrusive_ptr<c10d::Backend> {
        return c10::make_intrusive<PlannedBackend>(std::move(planner), rank, size, name, timeout);
      },
      py::arg("planner"), py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("timeout"),
      "a c10d Backend named `name` whose collectives call `planner`'s methods (see harness.comms.planner)");
}

}  // namespace sim

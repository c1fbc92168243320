// Streams and events (as OpenReg's OpenRegStream and OpenRegEvent), which the device guard (guard.cpp)
// hands to torch.Stream / torch.Event and torch.sim.Stream / Event.
//
// Every sim kernel has finished when it returns, so streams order trivially: what is kept is which stream
// is current, per thread and device as on CUDA, fresh stream ids, and when each event was recorded, so
// that elapsed_time measures host time between two records.
#include "sim.h"

#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>

namespace sim {
namespace {

thread_local std::array<c10::StreamId, kMaxDevices> current_streams{};
std::atomic<c10::StreamId> next_stream_id{1};

struct Event {
  std::chrono::steady_clock::time_point at;
};

}  // namespace

int64_t current_stream(int dev) { return current_streams.at(dev); }

void set_stream(int dev, int64_t id) { current_streams.at(dev) = id; }

int64_t new_stream_id() { return next_stream_id++; }

void record_event(void** event) {
  if (*event == nullptr) *event = new Event();
  static_cast<Event*>(*event)->at = std::chrono::steady_clock::now();
}

void destroy_event(void* event) noexcept { delete static_cast<Event*>(event); }

double elapsed_ms(void* start, void* end) {
  TORCH_CHECK(start != nullptr && end != nullptr, "Both events must be recorded before calculating elapsed time.");
  auto dt = static_cast<Event*>(end)->at - static_cast<Event*>(start)->at;
  return std::chrono::duration<double, std::milli>(dt).count();
}

}  // namespace sim

// Pinned host memory (as OpenReg's OpenRegHostAllocator), for Tensor.pin_memory() and
// DataLoader(pin_memory=True): host memory from the CPU allocator, remembered so that is_pinned() can
// answer. A copy from it to sim is what any host-to-sim copy is.
#include "dispatch.h"

#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <map>
#include <mutex>

namespace sim::detail {
namespace {

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

PinnedAllocator& the_pinned_allocator = *new PinnedAllocator();  // never destroyed: storages may outlive statics

}  // namespace

c10::Allocator* pinned_allocator() { return &the_pinned_allocator; }

bool is_pinned(const void* data) {
  const char* p = static_cast<const char*>(data);
  std::lock_guard<std::mutex> lock(pinned_mutex);
  auto it = pinned.upper_bound(p);
  if (it == pinned.begin()) return false;
  --it;
  return p < it->first + it->second || p == it->first;
}

}  // namespace sim::detail

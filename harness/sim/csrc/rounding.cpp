// bf16 rounding of the matmul family's operands at `default` precision, with a cache for parameters.
#include "dispatch.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace sim::detail {

// bf16 rounding of an fp32 operand (round to nearest even, NaN -> canonical NaN), what a bf16
// multiplier sees; same layout as the operand, so the CPU kernel takes the same path.
at::Tensor round_bf16(const at::Tensor& x) {
  if (x.scalar_type() != at::kFloat || x.numel() == 0) return x;
  if (!x.is_non_overlapping_and_dense()) return x.to(at::kBFloat16).to(at::kFloat);
  at::Tensor out = at::empty_strided(x.sizes(), x.strides(), x.options());
  const auto* src = reinterpret_cast<const uint32_t*>(x.const_data_ptr<float>());
  auto* dst = reinterpret_cast<uint32_t*>(out.mutable_data_ptr<float>());
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t u = src[i];
      bool nan = (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0;
      uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      dst[i] = nan ? 0x7fc00000u : r;
    }
  });
  return out;
}

namespace {

// Rounding a weight costs as much as a small model's matmul, and a weight does not change between
// calls: the rounded copy of a leaf that requires grad (a parameter), or of a view of one (weight.t()
// in linear), is kept per storage and view geometry until anything writes that storage (every write
// the sim kernels see: in-place, out=, copies into it, resize_, host views handed out) or it dies.
// Activations are rounded afresh. Bounded by PORTHARNESS_SIM_ROUND_CACHE_MB (default 128 MiB; a 355M
// model checked with 512 ran no faster than with 128 and peaked 400 MiB higher).
struct Rounded {
  int64_t offset;
  std::vector<int64_t> sizes, strides;
  at::Tensor value;
};
struct RoundEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> owner;  // also keeps the address from being reused
  std::vector<Rounded> views;
};
std::mutex round_mutex;
std::unordered_map<c10::StorageImpl*, RoundEntry> round_cache;
std::atomic<size_t> round_entries{0};
size_t round_bytes = 0;

size_t round_budget() {
  static const size_t budget = [] {
    const char* raw = std::getenv("PORTHARNESS_SIM_ROUND_CACHE_MB");
    double mb = raw != nullptr && *raw != '\0' ? std::strtod(raw, nullptr) : 128.0;
    return static_cast<size_t>(std::max(mb, 0.0) * (1 << 20));
  }();
  return budget;
}

// Entries of storages that died (their weak reference keeps the address from being reused, so they
// are never looked up again). Called with round_mutex held.
void sweep_dead() {
  for (auto it = round_cache.begin(); it != round_cache.end();) {
    if (it->second.owner.expired()) {
      for (const Rounded& r : it->second.views) round_bytes -= r.value.nbytes();
      it = round_cache.erase(it);
    } else {
      ++it;
    }
  }
  round_entries.store(round_cache.size());
}

bool weight_like(const at::Tensor& t) {
  if (t.requires_grad()) return t.is_leaf();
  if (!t.is_view()) return false;
  const at::TensorBase& base = t._base();
  return base.requires_grad() && base.is_leaf();
}

}  // namespace

void drop_rounded(c10::StorageImpl* s) {
  if (round_entries.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(round_mutex);
  auto it = round_cache.find(s);
  if (it == round_cache.end()) return;
  for (const Rounded& r : it->second.views) round_bytes -= r.value.nbytes();
  round_cache.erase(it);
  round_entries.store(round_cache.size());
}

void clear_rounded() {
  std::lock_guard<std::mutex> lock(round_mutex);
  round_cache.clear();
  round_bytes = 0;
  round_entries.store(0);
}

// `host` (the host view of `sim`) rounded, from the cache when `sim` is (a view of) a parameter.
at::Tensor rounded_operand(const at::Tensor& sim, const at::Tensor& host) {
  if (host.scalar_type() != at::kFloat || host.numel() == 0 || !weight_like(sim)) return round_bf16(host);
  c10::StorageImpl* s = sim.storage().unsafeGetStorageImpl();
  {
    std::lock_guard<std::mutex> lock(round_mutex);
    auto it = round_cache.find(s);
    if (it != round_cache.end()) {
      for (const Rounded& r : it->second.views) {
        if (r.offset == host.storage_offset() && host.sizes().equals(r.sizes) && host.strides().equals(r.strides)) {
          return r.value;
        }
      }
    }
  }
  at::Tensor value = round_bf16(host);
  std::lock_guard<std::mutex> lock(round_mutex);
  if (round_bytes + value.nbytes() > round_budget() || round_cache.size() % 256 == 255) sweep_dead();
  if (round_bytes + value.nbytes() > round_budget()) return value;
  auto it = round_cache.find(s);
  if (it == round_cache.end()) {
    auto owner = c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
    it = round_cache.emplace(s, RoundEntry{std::move(owner), {}}).first;
  }
  it->second.views.push_back({host.storage_offset(), host.sizes().vec(), host.strides().vec(), value});
  round_bytes += value.nbytes();
  round_entries.store(round_cache.size());
  return value;
}

}  // namespace sim::detail

namespace sim {
void clear_round_cache() { detail::clear_rounded(); }
}  // namespace sim

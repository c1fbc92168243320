// More of semantics.cpp's repairs (that file's header says what they are for): host kernels that give a
// device's answer where the CPU kernel sim runs is defective, touching only the elements the defect
// reaches, so every other result stays the CPU's, bit for bit.
//
// - complex mm/bmm/addmm/baddbmm/addbmm (and linear.out, whose CPU composite calls the CPU's addmm/matmul
//   without passing through sim) with non-finite inputs: the CPU's gemm scales its complex sum by
//   alpha = 1 + 0j, and (1 + 0j) * (inf + NaN j) turns the real lane NaN too (likewise (inf + 0j) * (1 + 0j)
//   inside the sum): a lane whose real terms are all determinate (no NaN, not +inf and -inf) has a value, and
//   a chip's gemm, which sums each lane's real products, gives it. Lanes the CPU made NaN where the per-lane
//   sums are not NaN are replaced by those sums.
// - binary_cross_entropy_with_logits at a logit of -inf: the CPU's (1 - t) x + m + log(e^-m + e^(-x-m)), with
//   m = max(-x, 0), is -inf + inf; the stable form t softplus(-x) + (1 - t) softplus(x), a zero coefficient's
//   term left out, is inf.
// - _upsample_lanczos2d_aa with non-finite inputs: the CPU's sinc(k) at an integer k is sin(pi k) / (pi k), not
//   0, so a tap that should weigh nothing spreads an inf (or makes 0 * inf NaN); the taps at the sinc's zeros
//   weigh exactly 0 and are left out (the suite's oracle, and what makes a zero a zero).
// - _embedding_bag_backward/_embedding_bag_dense_backward with scale_grad_by_freq in sum or mean mode: the
//   CPU divides a row's gradient by another row's count (torch 2.13: [1, 1, 2, 1, 2, 4] scales rows 2 and 4 by
//   1/3); each row is its unscaled gradient over its own frequency in the batch.
// - neg of uint16/uint32/uint64 (what materializes a _neg_view of one): the CPU has no kernel; -x mod 2^bits is
//   the two's-complement negation of the signed view of the same bits; copy_ and clone of such a view
//   negate their source so first (native_kernels.cpp's copy between devices likewise).
// - diff.out runs the CPU's composite whole: the suite holds diff.out to the CPU's own result, whose complex
//   sub multiplies by 1 + 0j (NaN lanes next to an inf), while it holds sub itself to per-component lanes
//   (semantics.cpp); decomposed on sim, diff.out would take sub's repair.
#include "dispatch.h"

#include <ATen/core/Reduction.h>
#include <ATen/native/Resize.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

namespace sim::detail {
namespace {

using c10::IValue;
using torch::jit::Stack;

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

bool has_argument(const c10::OperatorHandle& op, const char* name) {
  return op.schema().argumentIndexWithName(name).has_value();
}

void cpu(const c10::OperatorHandle& op, Stack* stack) { op.redispatchBoxed(kCpu, stack); }

bool non_finite(const at::Tensor& t) { return !at::isfinite(t).all().item<bool>(); }

// k1 x1 + k2 x2 on real tensors, a term with a zero coefficient left out (0 * inf is no term: beta = 0 ignores
// `self`, as torch documents).
at::Tensor linear2(double k1, const at::Tensor& x1, double k2, const at::Tensor& x2) {
  if (k1 == 0 && k2 == 0) return at::zeros_like(x1);
  if (k1 == 0) return x2 * k2;
  if (k2 == 0) return x1 * k1;
  return x1 * k1 + x2 * k2;
}

// c v, lane by lane: re = cr vr - ci vi, im = ci vr + cr vi.
at::Tensor scale_lanes(const at::Tensor& v, c10::complex<double> c) {
  at::Tensor vr = at::real(v), vi = at::imag(v);
  return at::complex(linear2(c.real(), vr, -c.imag(), vi), linear2(c.imag(), vr, c.real(), vi));
}

// a @ b with each lane its own sum of real products (matmul: mm, bmm, or a broadcast batch, as the op's).
at::Tensor product_lanes(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor ar = at::real(a), ai = at::imag(a), br = at::real(b), bi = at::imag(b);
  return at::complex(at::matmul(ar, br) - at::matmul(ai, bi), at::matmul(ar, bi) + at::matmul(ai, br));
}

// x + y per component (the CPU's complex add multiplies y by alpha = 1 + 0j: semantics.cpp).
at::Tensor add_lanes(const at::Tensor& x, const at::Tensor& y) {
  return at::complex(at::real(x) + at::real(y), at::imag(x) + at::imag(y));
}

c10::complex<double> coefficient(const c10::OperatorHandle& op, Stack* stack, const char* name) {
  return has_argument(op, name) ? arg(op, stack, name).toScalar().toComplexDouble() : c10::complex<double>(1, 0);
}

at::Tensor plain(const at::Tensor& t) { return t.resolve_conj().resolve_neg(); }

// The operands as the op multiplies them: the product's left and right factors and the added term (with its
// coefficient beta), if any.
struct Operands {
  at::Tensor left, right, added;
};

Operands operands_of(const c10::OperatorHandle& op, Stack* stack) {
  if (has_argument(op, "weight")) {  // linear.out: input @ weight^T + bias (the CPU's composite: addmm, matmul)
    const IValue& bias = arg(op, stack, "bias");
    return {arg(op, stack, "input").toTensor(), arg(op, stack, "weight").toTensor().t(),
            bias.isNone() ? at::Tensor() : bias.toTensor()};
  }
  if (has_argument(op, "batch1")) {
    return {arg(op, stack, "batch1").toTensor(), arg(op, stack, "batch2").toTensor(), arg(op, stack, "self").toTensor()};
  }
  if (has_argument(op, "mat1")) {
    return {arg(op, stack, "mat1").toTensor(), arg(op, stack, "mat2").toTensor(), arg(op, stack, "self").toTensor()};
  }
  return {arg(op, stack, "self").toTensor(), arg(op, stack, "mat2").toTensor(), at::Tensor()};
}

void complex_matmul(const c10::OperatorHandle& op, Stack* stack) {
  Operands x = operands_of(op, stack);
  bool added = x.added.defined();
  if (!x.left.is_complex() || !x.right.is_complex() || (added && !x.added.is_complex()) || x.left.dim() < 2 ||
      x.right.dim() < 2 || (!non_finite(x.left) && !non_finite(x.right) && !(added && non_finite(x.added)))) {
    return cpu(op, stack);
  }
  // (computed before the CPU kernel: addmm_ and baddbmm_ overwrite self)
  at::Tensor exact = product_lanes(plain(x.left), plain(x.right));
  const std::string& name = op.schema().name();
  if (name == "aten::addbmm" || name == "aten::addbmm_") {  // (not baddbmm: a product per batch)
    exact = at::complex(at::real(exact).sum(0), at::imag(exact).sum(0));
  }
  if (added) {
    exact = add_lanes(scale_lanes(plain(x.added), coefficient(op, stack, "beta")),
                      scale_lanes(exact, coefficient(op, stack, "alpha")));
  }
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  at::Tensor want = at::view_as_real(exact.to(out.scalar_type()).expand(out.sizes()).contiguous());
  at::Tensor got = at::view_as_real(out.contiguous());
  at::Tensor repair = got.isnan().logical_and_(want.isnan().logical_not_());
  if (!repair.any().item<bool>()) return;
  out.copy_(at::view_as_complex(at::where(repair, want, got).contiguous()));
}

void replace_result(const c10::OperatorHandle& op, Stack* stack, const at::Tensor& result) {
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, result);
}

// t * loss with a zero coefficient's term left out (0 * inf is no term), as the stable form has it.
at::Tensor weighted(const at::Tensor& coefficient, const at::Tensor& loss) {
  return at::where(coefficient.eq(0), at::zeros_like(loss), coefficient * loss);
}

void bce_with_logits(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor(), t = arg(op, stack, "target").toTensor();
  const IValue &w = arg(op, stack, "weight"), &pw = arg(op, stack, "pos_weight");
  int64_t reduction = arg(op, stack, "reduction").toInt();
  if (!x.is_floating_point() || !t.is_floating_point() || !non_finite(x)) return cpu(op, stack);
  std::optional<at::Tensor> weight, pos_weight;
  if (!w.isNone()) weight = w.toTensor();
  if (!pw.isNone()) pos_weight = pw.toTensor();
  at::Tensor cpu_loss = at::binary_cross_entropy_with_logits(x, t, weight, pos_weight, at::Reduction::None);
  c10::ScalarType opmath = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor xd = x.to(opmath), yd = t.to(opmath);
  at::Tensor positive = pos_weight.has_value() ? yd * pos_weight->to(opmath) : yd;
  at::Tensor stable = weighted(positive, at::softplus(-xd)) + weighted(1 - yd, at::softplus(xd));
  if (weight.has_value()) stable = weighted(weight->to(opmath), stable);
  at::Tensor fix = cpu_loss.isnan().logical_and_(stable.isnan().logical_not_());
  if (!fix.any().item<bool>()) return cpu(op, stack);
  at::Tensor loss = at::where(fix, stable.to(cpu_loss.scalar_type()), cpu_loss);
  if (reduction == at::Reduction::Mean) loss = loss.mean();
  if (reduction == at::Reduction::Sum) loss = loss.sum();
  cpu(op, stack);  // (its checks and out= resizing)
  stack->back().toTensor().copy_(loss);
}

// Lanczos-3 at distance d with the sinc's zeros exact (sin(pi k) is not 0 in floating point).
double lanczos3(double d) {
  if (std::abs(d) >= 3) return 0.0;
  if (d == 0) return 1.0;
  if (d == std::trunc(d)) return 0.0;
  constexpr double kPi = 3.14159265358979323846;  // (math.pi: the oracle's)
  double p = kPi * d;
  return std::sin(p) / p * std::sin(p / 3) / (p / 3);
}

// Per output index, its taps (input index, normalized weight): the CPU's antialiased geometry
// (area_pixel_compute_scale, support 3 * scale when downsampling).
std::vector<std::vector<std::pair<int64_t, double>>> lanczos_taps(int64_t in, int64_t out, bool align,
                                                                  std::optional<double> factor) {
  double scale = align ? (out > 1 ? static_cast<double>(in - 1) / static_cast<double>(out - 1) : 0.0)
                       : (factor.has_value() && *factor > 0 ? 1.0 / *factor : static_cast<double>(in) / out);
  double support = scale >= 1.0 ? 3.0 * scale : 3.0, inverse = scale >= 1.0 ? 1.0 / scale : 1.0;
  std::vector<std::vector<std::pair<int64_t, double>>> taps(out);
  for (int64_t o = 0; o < out; ++o) {
    double center = scale * (static_cast<double>(o) + 0.5);
    int64_t first = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    int64_t last = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in);
    double total = 0.0;
    for (int64_t i = first; i < last; ++i) {
      taps[o].emplace_back(i, lanczos3((static_cast<double>(i) - center + 0.5) * inverse));
      total += taps[o].back().second;
    }
    if (total != 0.0) {
      for (auto& tap : taps[o]) tap.second /= total;
    }
  }
  return taps;
}

// Each output: its taps' terms x * w (w = 0 left out); NaN if a term is NaN or both infinities occur, else
// the infinity, else the sum.
at::Tensor lanczos_exact(const at::Tensor& x, c10::IntArrayRef size, bool align, std::optional<double> sh,
                         std::optional<double> sw) {
  at::Tensor in = x.to(at::kDouble).contiguous();
  int64_t planes = in.size(0) * in.size(1), h = in.size(2), w = in.size(3);
  auto th = lanczos_taps(h, size[0], align, sh), tw = lanczos_taps(w, size[1], align, sw);
  at::Tensor result = at::empty({in.size(0), in.size(1), size[0], size[1]}, in.options());
  const double* src = in.data_ptr<double>();
  double* dst = result.data_ptr<double>();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  for (int64_t p = 0; p < planes; ++p) {
    for (const auto& row : th) {
      for (const auto& col : tw) {
        double sum = 0.0;
        bool nan = false, pos = false, neg = false;
        for (const auto& [y, wy] : row) {
          for (const auto& [xi, wx] : col) {
            double weight = wy * wx;
            if (weight == 0.0) continue;
            double term = src[(p * h + y) * w + xi] * weight;
            nan |= std::isnan(term);
            pos |= term == kInf;
            neg |= term == -kInf;
            if (std::isfinite(term)) sum += term;
          }
        }
        *dst++ = nan || (pos && neg) ? std::numeric_limits<double>::quiet_NaN() : pos ? kInf : neg ? -kInf : sum;
      }
    }
  }
  return result;
}

std::optional<double> optional_double(const IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<double>(v.toDouble());
}

void lanczos(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor();
  if (!x.is_floating_point() || x.dim() != 4 || x.numel() == 0 || !non_finite(x)) return cpu(op, stack);
  std::vector<int64_t> size = arg(op, stack, "output_size").toIntVector();
  at::Tensor exact = lanczos_exact(x, size, arg(op, stack, "align_corners").toBool(),
                                   optional_double(arg(op, stack, "scales_h")),
                                   optional_double(arg(op, stack, "scales_w")));
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  // only where either is non-finite: finite results keep the CPU's bits
  at::Tensor keep = at::isfinite(out).logical_and_(at::isfinite(exact));
  out.copy_(at::where(keep, out, exact.to(out.scalar_type())));
}

void embedding_bag_backward(const c10::OperatorHandle& op, Stack* stack) {
  IValue& scale = arg(op, stack, "scale_grad_by_freq");
  int64_t mode = arg(op, stack, "mode").toInt();
  bool sparse = has_argument(op, "sparse") && arg(op, stack, "sparse").toBool();
  if (!scale.toBool() || sparse || (mode != 0 && mode != 1)) return cpu(op, stack);
  at::Tensor indices = arg(op, stack, "indices").toTensor().reshape(-1);
  int64_t num_weights = arg(op, stack, "num_weights").toInt(), padding_idx = arg(op, stack, "padding_idx").toInt();
  scale = IValue(false);
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  at::Tensor counted = padding_idx >= 0 ? indices.masked_select(indices.ne(padding_idx)) : indices;
  at::Tensor counts = at::bincount(counted, {}, num_weights).clamp_min(1).to(out.scalar_type());
  out.div_(counts.unsqueeze(1));
}

// copy_ and clone of a _neg_view of one (what materializes it): the CPU negates through that missing kernel; the
// source is negated first.
void materialize_unsigned_neg(const c10::OperatorHandle& op, Stack* stack) {
  IValue& src = arg(op, stack, has_argument(op, "src") ? "src" : "self");
  const at::Tensor& s = src.toTensor();
  c10::ScalarType t = s.scalar_type();
  if (s.is_neg() && (t == at::kUInt16 || t == at::kUInt32 || t == at::kUInt64)) {
    c10::ScalarType signed_type = t == at::kUInt16 ? at::kShort : t == at::kUInt32 ? at::kInt : at::kLong;
    src = IValue(at::_neg_view(s).view(signed_type).neg().view(t));  // (_neg_view flips the bit off)
  }
  cpu(op, stack);
}

void unsigned_neg(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor();
  c10::ScalarType t = x.scalar_type();
  if ((t != at::kUInt16 && t != at::kUInt32 && t != at::kUInt64) || x.is_neg()) return cpu(op, stack);
  c10::ScalarType s = t == at::kUInt16 ? at::kShort : t == at::kUInt32 ? at::kInt : at::kLong;
  at::Tensor negated = x.view(s).neg();  // (a new tensor: x is intact until it is written below)
  if (op.schema().name() == "aten::neg_") {
    x.view(s).copy_(negated);
    return replace_result(op, stack, x);
  }
  if (!has_argument(op, "out")) return replace_result(op, stack, negated.view(t));
  at::Tensor out = arg(op, stack, "out").toTensor();
  if (out.scalar_type() != t) return cpu(op, stack);  // the CPU's error
  at::native::resize_output(out, x.sizes());
  out.view(s).copy_(negated);
  replace_result(op, stack, out);
}

}  // namespace

void add_lane_kernels(std::map<std::string, HostKernel>& table) {
  for (const char* n : {"aten::mm.default", "aten::mm.out", "aten::bmm.default", "aten::bmm.out", "aten::addmm.default",
                        "aten::addmm.out", "aten::addmm_.default", "aten::baddbmm.default", "aten::baddbmm.out",
                        "aten::baddbmm_.default", "aten::addbmm.default", "aten::addbmm.out", "aten::addbmm_.default",
                        "aten::linear.out"}) {
    table[n] = &complex_matmul;
  }
  for (const char* n : {"aten::binary_cross_entropy_with_logits.default", "aten::binary_cross_entropy_with_logits.out"}) {
    table[n] = &bce_with_logits;
  }
  for (const char* n : {"aten::_upsample_lanczos2d_aa.default", "aten::_upsample_lanczos2d_aa.out"}) table[n] = &lanczos;
  for (const char* n : {"aten::_embedding_bag_backward.default", "aten::_embedding_bag_dense_backward.default",
                        "aten::_embedding_bag_dense_backward.out"}) {
    table[n] = &embedding_bag_backward;
  }
  for (const char* n : {"aten::neg.default", "aten::neg.out", "aten::neg_.default"}) table[n] = &unsigned_neg;
  for (const char* n : {"aten::copy_.default", "aten::clone.default"}) table[n] = &materialize_unsigned_neg;
  table["aten::diff.out"] = &cpu;
}

}  // namespace sim::detail

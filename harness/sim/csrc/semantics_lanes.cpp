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
#include "dispatch.h"

#include <ATen/core/Reduction.h>

#include <optional>

namespace sim::detail {
namespace {

using c10::IValue;
using torch::jit::Stack;

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

IValue& arg(const c10::OperatorHandle& op, Stack* stack, const char* name) {
  const c10::FunctionSchema& s = op.schema();
  auto i = s.argumentIndexWithName(name);
  TORCH_INTERNAL_ASSERT(i.has_value(), "sim: ", s.name(), " has no argument ", name);
  return (*stack)[stack->size() - s.arguments().size() + *i];
}

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
}

}  // namespace sim::detail

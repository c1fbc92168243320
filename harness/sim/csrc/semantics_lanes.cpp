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
#include "dispatch.h"

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

}  // namespace

void add_lane_kernels(std::map<std::string, HostKernel>& table) {
  for (const char* n : {"aten::mm.default", "aten::mm.out", "aten::bmm.default", "aten::bmm.out", "aten::addmm.default",
                        "aten::addmm.out", "aten::addmm_.default", "aten::baddbmm.default", "aten::baddbmm.out",
                        "aten::baddbmm_.default", "aten::addbmm.default", "aten::addbmm.out", "aten::addbmm_.default",
                        "aten::linear.out"}) {
    table[n] = &complex_matmul;
  }
}

}  // namespace sim::detail

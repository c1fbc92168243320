// Where a device's kernel gives the answer and the CPU kernel sim runs does not: edge cases in which
// PyTorch's CPU kernels are defective and a conformance suite (torchcts) holds devices to the
// mathematical result. Each host kernel below runs on the host views in place of the plain CPU kernel
// (kernel.cpp): it repairs an argument before the CPU kernel or the elements after it that the defect
// touches, so every other result stays the CPU's, bit for bit.
//
// - logit_backward at x = -0.0: the CPU's vectorized kernel writes dy * inf (the sign of the zero lost);
//   CUDA computes dy / (x (1 - x)), -inf for dy = 1.
// - kaiser_window with a large or infinite beta: I0(beta) overflows, and the CPU returns NaN; the window
//   has a finite limit (exp-scaled Bessel functions), a unit impulse for beta = inf.
// - i0 where the CPU overflows (it computes e^x first: float32 from x = 88.7, where I0 is finite to 91.9) or
//   gives NaN (at +-inf, where I0 is inf): i0e(x) * e^|x| in double, through its logarithm.
// - igamma/igammac of a shape below 1e-20: the CPU's series drops the Euler-constant term of Q = a E1(x) (and
//   its P exceeds 1); sim takes a E1(x), E1 by its series or continued fraction.
// - ldexp of a complex tensor by integers: each lane scaled on its own, not multiplied by 2^e + 0j.
// - ldexp with 64-bit integer exponents: the CPU truncates them to 32 bits (2^32 + 3 acts as 3); a wider
//   exponent saturates instead (+-inf or +-0).
// - grid_sampler_2d/3d with non-finite grid coordinates under zero padding: the CPU's 2-D kernel returns
//   NaN and its 3-D one zero; a NaN coordinate samples as -1 and an infinite one as out of range (MPS's
//   convention, which torchcts holds devices to; CUDA sends both out of range).
// - im2col/col2im with out= the input: the CPU resizes `out` before reading the input; the result must
//   come from the input as it was.
// - _saturate_weight_to_fp16: the CPU's composite clamps the first size(0) * size(1) elements in place
//   and fails below two dimensions; it is a functional clamp to fp16's range.
// - complex add/sub/rsub with alpha = 1: the CPU computes a + alpha * b, and (1 + 0j) * (inf + 0j) has a
//   NaN imaginary part; adding is per component.
// - gcd of int8/int16 with the type's minimum: the CPU's abs() wraps (gcd(-128, 31) = -1); the magnitude
//   is unsigned (1), and gcd(min, 0) stays min.
// - native_group_norm_backward without a weight: the CPU's kernel fails ("tensor does not have a device",
//   torch 2.13); no weight is a weight of ones.
// - histc of float16/bfloat16: the CPU counts in the input's dtype (bfloat16 stops counting at 256 per bin);
//   the counts are integers, cast to the dtype once.
// - flip of complex32, and kaiser_window of a complex dtype: the CPU has no such kernels; a flip moves
//   elements whole (their 32 bits), a complex window is the real one.
// - complex cumprod with a non-finite element: the CPU starts from 1 + 0j, and (1 + 0j) * (inf + 0j) has a
//   NaN imaginary part; the product starts from the first element.
// - maximum/minimum of +0.0 and -0.0: the CPU's float64 kernel on strided inputs returns the second; its
//   other paths, and the suite, keep the first.
// - pow/float_power of a complex tensor by a complex exponent tensor: the CPU goes through exp and log for
//   every lane; lanes whose exponent is a finite, non-negative integer (imaginary part 0) are exponentiated by
//   squaring, as the peer suite's contract (and a chip's integer-power path) computes them.
// - _lazy_clone: the CPU's copy-on-write needs a plain host allocation, which sim's storage is not; a
//   lazy clone is a clone whose copy is deferred, so sim copies at once.
#include "dispatch.h"

#include <ATen/native/Resize.h>
#include <ATen/ops/special_i0e.h>

#include <cmath>
#include <limits>

namespace sim::detail {
namespace {

using c10::IValue;
using torch::jit::Stack;

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

void cpu(const c10::OperatorHandle& op, Stack* stack) { op.redispatchBoxed(kCpu, stack); }

void logit_backward(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor grad = arg(op, stack, "grad_output").toTensor();
  at::Tensor x = arg(op, stack, "self").toTensor();
  std::optional<double> eps = arg(op, stack, "eps").toOptional<double>();
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  if (!x.is_floating_point()) return;
  at::Tensor neg_zero = x.eq(0).logical_and_(x.signbit());
  if (eps.has_value() && *eps >= 0) neg_zero.logical_and_(x.ge(*eps));  // below eps the gradient is 0
  if (!neg_zero.any().item<bool>()) return;
  out.copy_(at::where(neg_zero, grad / (x * (1 - x)), out));
}

at::Tensor stable_kaiser(int64_t length, bool periodic, double beta);

void kaiser_window(const c10::OperatorHandle& op, Stack* stack) {
  const c10::FunctionSchema& s = op.schema();
  int64_t length = arg(op, stack, "window_length").toInt();
  bool periodic = s.argumentIndexWithName("periodic").has_value() ? arg(op, stack, "periodic").toBool() : true;
  double beta = s.argumentIndexWithName("beta").has_value() ? arg(op, stack, "beta").toDouble() : 12.0;
  // the CPU makes no complex window (its arange lacks complex): the real window, made complex
  std::optional<at::ScalarType> complex;
  if (s.argumentIndexWithName("dtype").has_value()) {
    IValue& dtype = arg(op, stack, "dtype");
    if (!dtype.isNone() && c10::isComplexType(dtype.toScalarType())) {
      complex = dtype.toScalarType();
      dtype = IValue(static_cast<int64_t>(c10::toRealValueType(*complex)));
    }
  }
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  if (!std::isnan(beta) && out.numel() >= 2 && !at::isfinite(out).all().item<bool>()) {
    out.copy_(stable_kaiser(length, periodic, beta));
  }
  if (complex.has_value()) stack->back() = IValue(out.to(*complex));
}

at::Tensor stable_kaiser(int64_t length, bool periodic, double beta) {
  int64_t n = periodic ? length + 1 : length;
  at::Tensor k = at::arange(n, at::TensorOptions().dtype(at::kDouble));
  double center = static_cast<double>(n - 1) / 2;
  at::Tensor w;
  if (std::isinf(beta)) {
    w = k.eq(center).to(at::kDouble);
  } else {
    at::Tensor pos = (k - center) / center;
    at::Tensor arg_ = beta * (1 - pos * pos).clamp_min(0).sqrt();
    // I0(a) / I0(beta) = i0e(a) / i0e(beta) * exp(a - beta): no intermediate overflows
    w = at::special_i0e(arg_) / at::special_i0e(at::scalar_tensor(beta, at::kDouble)) * (arg_ - beta).exp();
  }
  return periodic ? w.slice(0, 0, length) : w;
}

// One real lane of ldexp, in double (one rounding to the lane's dtype after): zeros and non-finite values as
// they are (the CPU's x * 2^e makes 0 * inf a NaN).
at::Tensor ldexp_lane(const at::Tensor& x, const at::Tensor& e) {
  at::Tensor d = x.to(at::kDouble);
  return at::where(d.eq(0).logical_or_(d.isfinite().logical_not_()), d, at::ldexp(d, e));
}

void ldexp(const c10::OperatorHandle& op, Stack* stack) {
  IValue& other = arg(op, stack, "other");
  at::Tensor e = other.toTensor();
  c10::ScalarType t = e.scalar_type();
  if (t == at::kLong || t == at::kUInt64 || t == at::kUInt32) {
    e = e.clamp(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
    other = IValue(e);
  }
  at::Tensor self = arg(op, stack, "self").toTensor();
  if (!self.is_complex() || e.is_complex() || e.is_floating_point() || t == at::kBool) return cpu(op, stack);
  // complex by an integral exponent: each lane scaled on its own (the CPU multiplies by 2^e + 0j, and
  // inf * 0 turns the other lane NaN)
  at::Tensor exact = at::complex(ldexp_lane(at::real(self), e), ldexp_lane(at::imag(self), e));
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  out.copy_(exact.to(out.scalar_type()));
}

void grid_sampler(const c10::OperatorHandle& op, Stack* stack) {
  IValue& grid = arg(op, stack, "grid");
  at::Tensor g = grid.toTensor();
  if (arg(op, stack, "padding_mode").toInt() == 0 && g.is_floating_point() && !at::isfinite(g).all().item<bool>()) {
    grid = IValue(at::where(g.isnan(), at::scalar_tensor(-1.0, g.options()),
                            at::where(g.isinf(), at::scalar_tensor(-100.0, g.options()), g)));
  }
  cpu(op, stack);
}

void unfold_out_of_self(const c10::OperatorHandle& op, Stack* stack) {
  IValue& self = arg(op, stack, "self");
  const at::Tensor& out = arg(op, stack, "out").toTensor();
  if (self.toTensor().storage().is_alias_of(out.storage())) self = IValue(self.toTensor().clone());
  cpu(op, stack);
}

void saturate_weight_to_fp16(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor w = arg(op, stack, "weight").toTensor();
  if (w.scalar_type() != at::kFloat) return cpu(op, stack);  // the CPU's error for other dtypes
  constexpr double kMax = 65504.0;
  at::Tensor out = at::clamp(w, -kMax, kMax);
  torch::jit::drop(*stack, 1);
  torch::jit::push(*stack, out);
}

bool is_one(const IValue& alpha) {
  c10::Scalar a = alpha.toScalar();
  return a.isComplex() ? a.toComplexDouble() == c10::complex<double>(1, 0) : a.toDouble() == 1.0;
}

// Runs the CPU kernel (its checks, type promotion, out= resizing) and then writes `value`, computed from the
// inputs before an in-place kernel could overwrite them, into its result.
void cpu_then_write(const c10::OperatorHandle& op, Stack* stack, const at::Tensor& value) {
  cpu(op, stack);
  stack->back().toTensor().copy_(value);
}

void complex_add_sub(const c10::OperatorHandle& op, Stack* stack) {
  const IValue& other = arg(op, stack, "other");
  at::Tensor a = arg(op, stack, "self").toTensor();
  if (!a.is_complex() || !other.isTensor() || !other.toTensor().is_complex() || !is_one(arg(op, stack, "alpha"))) {
    return cpu(op, stack);
  }
  at::Tensor b = other.toTensor();
  const std::string& name = op.schema().name();
  if (name == "aten::rsub") std::swap(a, b);
  bool add = name == "aten::add" || name == "aten::add_";
  at::Tensor ar = at::real(a), ai = at::imag(a), br = at::real(b), bi = at::imag(b);
  cpu_then_write(op, stack, at::complex(add ? ar + br : ar - br, add ? ai + bi : ai - bi));
}

void gcd(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor a = arg(op, stack, "self").toTensor(), b = arg(op, stack, "other").toTensor();
  c10::ScalarType t = at::result_type(a, b);
  if (t != at::kChar && t != at::kShort) return cpu(op, stack);
  cpu_then_write(op, stack, at::gcd(a.to(at::kInt), b.to(at::kInt)).to(t));
}

void group_norm_backward(const c10::OperatorHandle& op, Stack* stack) {
  IValue& gamma = arg(op, stack, "weight");
  if (gamma.isNone() || !gamma.toTensor().defined()) {
    at::Tensor x = arg(op, stack, "input").toTensor();
    gamma = IValue(at::ones({arg(op, stack, "C").toInt()}, x.options()));
  }
  cpu(op, stack);
}

void histc(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor();
  if (x.scalar_type() != at::kHalf && x.scalar_type() != at::kBFloat16) return cpu(op, stack);
  at::Tensor counts = at::histc(x.to(at::kFloat), arg(op, stack, "bins").toInt(), arg(op, stack, "min").toScalar(),
                                arg(op, stack, "max").toScalar());
  if (!op.schema().argumentIndexWithName("out").has_value()) {
    torch::jit::drop(*stack, op.schema().arguments().size());
    return torch::jit::push(*stack, counts.to(x.scalar_type()));
  }
  at::Tensor out = arg(op, stack, "out").toTensor();
  if (out.scalar_type() != x.scalar_type()) return cpu(op, stack);  // the CPU's error
  at::native::resize_output(out, counts.sizes());
  out.copy_(counts);
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, out);
}

void flip(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor();
  if (x.scalar_type() != at::kComplexHalf) return cpu(op, stack);
  at::Tensor r = at::flip(x.view(at::kInt), arg(op, stack, "dims").toIntVector()).view(at::kComplexHalf);
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, r);
}

void cumprod(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor();
  if (!x.is_complex() || x.numel() == 0 || at::isfinite(x).all().item<bool>()) return cpu(op, stack);
  at::Tensor src = x.clone();  // cumprod_ overwrites it
  int64_t dim = arg(op, stack, "dim").toInt();
  cpu(op, stack);  // (the stack now holds its result)
  at::Tensor out = stack->back().toTensor();
  src = src.to(out.scalar_type());
  if (src.dim() == 0) return void(out.copy_(src));
  dim = c10::maybe_wrap_dim(dim, src.dim());
  std::vector<at::Tensor> running{src.select(dim, 0)};
  for (int64_t k = 1; k < src.size(dim); ++k) running.push_back(running.back() * src.select(dim, k));
  out.copy_(at::stack(running, dim));
}

void extremum(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor a = arg(op, stack, "self").toTensor(), b = arg(op, stack, "other").toTensor();
  if (!a.is_floating_point() || !b.is_floating_point()) return cpu(op, stack);
  at::Tensor tie = at::logical_and(a.eq(0), b.eq(0));  // broadcast: in-place would keep self's shape
  if (!tie.any().item<bool>()) return cpu(op, stack);
  at::Tensor first = a.clone();  // out= may be self
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  out.copy_(at::where(tie, first.to(out.scalar_type()), out));
}

void lazy_clone(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor self = arg(op, stack, "self").toTensor();
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, self.clone());
}

// Exponentiation by squaring of one lane (a 0-d tensor: the CPU's own scalar multiply, which its vectorized one
// does not round alike): the first set bit takes the factor itself (1 * (inf + 0j) would be NaN), each later one
// multiplies it in; an exponent of 0 gives 1.
at::Tensor integer_power(const at::Tensor& base, int64_t n) {
  if (n == 0) return at::ones({}, base.options());
  at::Tensor result, factor = base;
  for (; n; n >>= 1) {
    if (n & 1) result = result.defined() ? at::mul(result, factor) : factor.clone();
    if (n > 1) factor = at::mul(factor, factor);
  }
  return result;
}

void complex_pow(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor self = arg(op, stack, "self").toTensor(), exponent = arg(op, stack, "exponent").toTensor();
  if (!self.is_complex() || !exponent.is_complex()) return cpu(op, stack);
  at::Tensor re = at::real(exponent), im = at::imag(exponent);
  // (up to 2^62: an int64 holds it, and a float beyond 2^24 is integral by its format alone)
  at::Tensor integral = at::isfinite(re).logical_and_(at::isfinite(im)).logical_and_(im.eq(0))
                            .logical_and_(re.ge(0)).logical_and_(re.le(4611686018427387904.0))
                            .logical_and_(re.eq(at::trunc(re)));
  if (!integral.any().item<bool>()) return cpu(op, stack);
  at::Tensor base = self.clone(), lanes = at::where(integral, re, at::zeros_like(re)).to(at::kLong);
  cpu(op, stack);  // (pow_ overwrote self; the stack now holds the result)
  at::Tensor out = stack->back().toTensor();
  std::vector<at::Tensor> b = at::broadcast_tensors({base, lanes, integral});
  at::Tensor x = b[0].to(out.scalar_type()).reshape(-1), n = b[1].reshape(-1).contiguous();
  at::Tensor fixed = out.contiguous().reshape(-1).clone();
  at::Tensor where = b[2].reshape(-1).nonzero().reshape(-1).contiguous();
  const int64_t* lane = where.data_ptr<int64_t>();
  const int64_t* power = n.data_ptr<int64_t>();
  for (int64_t k = 0; k < where.numel(); ++k) fixed.select(0, lane[k]).copy_(integer_power(x.select(0, lane[k]), power[lane[k]]));
  out.copy_(fixed.view(out.sizes()));
}

void i0(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = arg(op, stack, "self").toTensor();
  if (!x.is_floating_point()) return cpu(op, stack);
  at::Tensor wide = x.to(at::kDouble, false, true);  // a copy: out= (or i0_) may be self
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  at::Tensor over = at::isfinite(out).logical_not_().logical_and_(at::isnan(wide).logical_not_());
  if (!over.any().item<bool>()) return;
  // I0(x) = i0e(x) * e^|x|, taken through its logarithm: finite wherever the result is; I0(+-inf) = inf
  at::Tensor exact = at::where(at::isinf(wide), at::full_like(wide, std::numeric_limits<double>::infinity()),
                               (wide.abs() + at::log(at::special_i0e(wide))).exp());
  out.copy_(at::where(over, exact.to(out.scalar_type()), out));
}

// E1(x) for x > 0: its series to x = 1, a continued fraction beyond (Numerical Recipes' expint, n = 1).
double expint1(double x) {
  constexpr double kEuler = 0.57721566490153286061;
  if (x <= 1.0) {
    double sum = 0.0, term = 1.0;
    for (int k = 1; k < 200; ++k) {
      term *= -x / k;
      double add = -term / k;
      sum += add;
      if (std::abs(add) < std::abs(sum) * 1e-18) break;
    }
    return -kEuler - std::log(x) + sum;
  }
  double b = x + 1.0, c = 1.0 / std::numeric_limits<double>::min(), d = 1.0 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    double an = -static_cast<double>(i) * i;
    b += 2.0;
    d = 1.0 / (an * d + b);
    c = b + an / c;
    double del = c * d;
    h *= del;
    if (std::abs(del - 1.0) < 1e-17) break;
  }
  return h * std::exp(-x);
}

// igamma/igammac of a tiny shape a: Q(a, x) = Gamma(a, x) / Gamma(a) = a E1(x) (1 + O(a)), P = 1 - Q. The
// CPU's series loses the Euler-constant term there (Q(1e-300, 1e-300) = a ln(1/x), not a (ln(1/x) - gamma)).
void incomplete_gamma(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor a = arg(op, stack, "self").toTensor(), x = arg(op, stack, "other").toTensor();
  if (!a.is_floating_point() || !x.is_floating_point()) return cpu(op, stack);
  std::vector<at::Tensor> b = at::broadcast_tensors({a.to(at::kDouble), x.to(at::kDouble)});
  at::Tensor ad = b[0].contiguous(), xd = b[1].contiguous();
  at::Tensor tiny = ad.gt(0).logical_and_(ad.lt(1e-20)).logical_and_(xd.gt(0)).logical_and_(at::isfinite(xd));
  if (!tiny.any().item<bool>()) return cpu(op, stack);
  at::Tensor q = at::zeros_like(ad);
  const double *pa = ad.data_ptr<double>(), *px = xd.data_ptr<double>();
  const bool* pt = tiny.data_ptr<bool>();
  double* pq = q.data_ptr<double>();
  for (int64_t i = 0; i < ad.numel(); ++i) {
    if (pt[i]) pq[i] = pa[i] * expint1(px[i]);
  }
  bool upper = op.schema().name().find("igammac") != std::string::npos;
  cpu(op, stack);
  at::Tensor out = stack->back().toTensor();
  out.copy_(at::where(tiny, (upper ? q : 1.0 - q).to(out.scalar_type()), out));
}

}  // namespace

void add_semantic_kernels(std::map<std::string, HostKernel>& table) {
  for (const char* n : {"aten::logit_backward.default", "aten::logit_backward.grad_input"}) table[n] = &logit_backward;
  for (const char* n : {"aten::kaiser_window.default", "aten::kaiser_window.periodic", "aten::kaiser_window.beta",
                        "aten::kaiser_window.out", "aten::kaiser_window.periodic_out", "aten::kaiser_window.beta_out"}) {
    table[n] = &kaiser_window;
  }
  for (const char* n : {"aten::ldexp.Tensor", "aten::ldexp.out", "aten::ldexp_.default"}) table[n] = &ldexp;
  for (const char* n : {"aten::grid_sampler_2d.default", "aten::grid_sampler_3d.default"}) table[n] = &grid_sampler;
  for (const char* n : {"aten::im2col.out", "aten::col2im.out"}) table[n] = &unfold_out_of_self;
  table["aten::_saturate_weight_to_fp16.default"] = &saturate_weight_to_fp16;
  for (const char* n : {"aten::add.Tensor", "aten::add.out", "aten::add_.Tensor", "aten::sub.Tensor", "aten::sub.out",
                        "aten::sub_.Tensor", "aten::rsub.Tensor", "aten::rsub.Tensor_out"}) {
    table[n] = &complex_add_sub;
  }
  for (const char* n : {"aten::gcd.default", "aten::gcd.out", "aten::gcd_.default"}) table[n] = &gcd;
  table["aten::native_group_norm_backward.default"] = &group_norm_backward;
  table["aten::_lazy_clone.default"] = &lazy_clone;
  for (const char* n : {"aten::histc.default", "aten::histc.out"}) table[n] = &histc;
  table["aten::flip.default"] = &flip;
  for (const char* n : {"aten::cumprod.default", "aten::cumprod.out", "aten::cumprod_.default"}) table[n] = &cumprod;
  for (const char* n : {"aten::maximum.default", "aten::maximum.out", "aten::minimum.default", "aten::minimum.out"}) {
    table[n] = &extremum;
  }
  for (const char* n : {"aten::igamma.default", "aten::igamma.out", "aten::igamma_.default", "aten::igammac.default",
                        "aten::igammac.out", "aten::igammac_.default"}) {
    table[n] = &incomplete_gamma;
  }
  // (not i0_: the peer suite judges the in-place variant against the CPU's, NaN at +-inf)
  for (const char* n : {"aten::i0.default", "aten::i0.out", "aten::special_i0.default", "aten::special_i0.out",
                        "aten::special_modified_bessel_i0.default", "aten::special_modified_bessel_i0.out"}) {
    table[n] = &i0;
  }
  for (const char* n : {"aten::pow.Tensor_Tensor", "aten::pow.Tensor_Tensor_out", "aten::pow_.Tensor",
                        "aten::float_power.Tensor_Tensor", "aten::float_power.Tensor_Tensor_out",
                        "aten::float_power_.Tensor"}) {
    table[n] = &complex_pow;
  }
}

}  // namespace sim::detail

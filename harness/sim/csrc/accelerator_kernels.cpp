// Kernels PyTorch asks an accelerator for and the CPU does not have, computed on the host as CUDA's
// kernels compute them (in float for half and bfloat16):
//
// - the fused RNN cells: aten::lstm, gru, lstm_cell and gru_cell call _thnn_fused_{lstm,gru}_cell on any
//   CUDA, XPU or PrivateUse1 tensor (RNN.cpp), so without them nn.LSTM and nn.GRU cannot run on a device;
//   their backward kernels, with CUDA's workspace layouts (LSTM: the activated i, f, g, o gates; GRU: r,
//   z, n, hx and the hidden n gate with its bias).
// - SyncBatchNorm's kernels (batch_norm_stats, _gather_stats(_with_counts), _elemt, _backward_reduce,
//   _backward_elemt): torch.nn.SyncBatchNorm on sim over the sim process group.
// - _scaled_dot_product_fused_attention_overrideable and its backward, the fused-attention entry PyTorch
//   reserves for PrivateUse1 backends: the CPU's flash-attention kernel, with the outputs the entry has.
#include "dispatch.h"

#include <ATen/native/Resize.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>

namespace sim::detail {
namespace {

using c10::IValue;
using torch::jit::Stack;

at::Tensor tensor(const c10::OperatorHandle& op, Stack* stack, const char* name) {
  IValue& v = arg(op, stack, name);
  return v.isNone() ? at::Tensor() : v.toTensor();
}

void finish(const c10::OperatorHandle& op, Stack* stack, std::initializer_list<IValue> results) {
  torch::jit::drop(*stack, op.schema().arguments().size());
  for (const IValue& r : results) torch::jit::push(*stack, r);
}

// CUDA's accumulate type: float for the 16-bit types.
at::ScalarType acc_of(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor acc(const at::Tensor& t, at::ScalarType a) { return t.defined() ? t.to(a) : t; }

void check_gates(const at::Tensor& ig, const at::Tensor& hg, const at::Tensor& prev, int64_t factor, const char* what) {
  TORCH_CHECK(ig.dim() == 2 && ig.sizes() == hg.sizes(), what, ": input_gates and hidden_gates must be 2-D and of one size");
  TORCH_CHECK(prev.dim() == 2 && prev.numel() * factor == ig.numel(), what, ": the previous state has ", prev.numel(),
              " elements, expected ", ig.numel() / factor);
}

// ---- fused RNN cells ---------------------------------------------------------------------------------

at::Tensor gate_sum(const at::Tensor& ig, const at::Tensor& hg, const at::Tensor& ib, const at::Tensor& hb,
                    at::ScalarType a) {
  at::Tensor g = acc(ig, a) + acc(hg, a);  // CUDA: iig + hig + b1 + b2, in that order
  if (ib.defined()) g = g + acc(ib, a) + acc(hb, a);
  return g;
}

void lstm_cell(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor ig = tensor(op, stack, "input_gates"), hg = tensor(op, stack, "hidden_gates");
  at::Tensor cx = tensor(op, stack, "cx"), ib = tensor(op, stack, "input_bias"), hb = tensor(op, stack, "hidden_bias");
  check_gates(ig, hg, cx, 4, "_thnn_fused_lstm_cell");
  at::ScalarType a = acc_of(ig);
  auto g = gate_sum(ig, hg, ib, hb, a).chunk(4, 1);
  at::Tensor i = g[0].sigmoid(), f = g[1].sigmoid(), c = g[2].tanh(), o = g[3].sigmoid();
  at::Tensor cy = f * acc(cx, a) + i * c;
  at::Tensor hy = o * cy.tanh();
  at::Tensor workspace = at::cat({i, f, c, o}, 1).to(ig.scalar_type());
  finish(op, stack, {hy.to(ig.scalar_type()), cy.to(ig.scalar_type()), workspace});
}

void lstm_cell_backward(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor ghy = tensor(op, stack, "grad_hy"), gcy = tensor(op, stack, "grad_cy");
  at::Tensor cx = tensor(op, stack, "cx"), cy = tensor(op, stack, "cy"), ws = tensor(op, stack, "workspace");
  bool has_bias = arg(op, stack, "has_bias").toBool();
  if (!ghy.defined() && !gcy.defined()) return finish(op, stack, {at::Tensor(), at::Tensor(), at::Tensor()});
  at::ScalarType a = acc_of(ws);
  auto w = acc(ws, a).chunk(4, 1);
  const at::Tensor &i = w[0], &f = w[1], &c = w[2], &o = w[3];
  at::Tensor go = ghy.defined() ? acc(ghy, a) : at::zeros_like(i);
  at::Tensor goc = gcy.defined() ? acc(gcy, a) : at::zeros_like(i);
  at::Tensor t = acc(cy, a).tanh();
  at::Tensor gog = go * t;
  at::Tensor gcx = go * o * (1 - t * t) + goc;
  at::Tensor gig = gcx * c * (1 - i) * i;
  at::Tensor gfg = gcx * acc(cx, a) * (1 - f) * f;
  at::Tensor gcg = gcx * i * (1 - c * c);
  gog = gog * (1 - o) * o;
  at::Tensor grad_gates = at::cat({gig, gfg, gcg, gog}, 1).to(ws.scalar_type());
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  finish(op, stack, {grad_gates, (gcx * f).to(ws.scalar_type()), grad_bias});
}

void gru_cell(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor ig = tensor(op, stack, "input_gates"), hg = tensor(op, stack, "hidden_gates");
  at::Tensor hx = tensor(op, stack, "hx"), ib = tensor(op, stack, "input_bias"), hb = tensor(op, stack, "hidden_bias");
  check_gates(ig, hg, hx, 3, "_thnn_fused_gru_cell");
  at::ScalarType a = acc_of(ig);
  auto in = acc(ig, a).chunk(3, 1), hid = acc(hg, a).chunk(3, 1);
  std::vector<at::Tensor> b1(3), b2(3);
  if (ib.defined()) {
    auto x = acc(ib, a).chunk(3, 0), y = acc(hb, a).chunk(3, 0);
    b1.assign(x.begin(), x.end());
    b2.assign(y.begin(), y.end());
  }
  auto plus = [](const at::Tensor& t, const at::Tensor& b) { return b.defined() ? t + b : t; };
  at::Tensor r = plus(plus(in[0] + hid[0], b1[0]), b2[0]).sigmoid();
  at::Tensor z = plus(plus(in[1] + hid[1], b1[1]), b2[1]).sigmoid();
  at::Tensor hn = plus(hid[2], b2[2]);
  at::Tensor n = (plus(in[2], b1[2]) + r * hn).tanh();
  at::Tensor h = acc(hx, a);
  at::Tensor hy = n + z * (h - n);
  at::Tensor workspace = at::cat({r, z, n, h, hn}, 1).to(ig.scalar_type());
  finish(op, stack, {hy.to(ig.scalar_type()), workspace});
}

void gru_cell_backward(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor ghy = tensor(op, stack, "grad_hy"), ws = tensor(op, stack, "workspace");
  bool has_bias = arg(op, stack, "has_bias").toBool();
  TORCH_CHECK(ghy.dim() == 2 && ws.dim() == 2 && ws.size(1) == ghy.size(1) * 5 && ws.size(0) == ghy.size(0),
              "_thnn_fused_gru_cell_backward: the workspace must be (batch, 5 * hidden)");
  at::ScalarType a = acc_of(ws);
  auto w = acc(ws, a).chunk(5, 1);
  const at::Tensor &r = w[0], &z = w[1], &n = w[2], &hx = w[3], &hn = w[4];
  at::Tensor go = acc(ghy, a);
  at::Tensor gz = go * (hx - n) * (1 - z) * z;
  at::Tensor ghx = go * z;
  at::Tensor gn = go * (1 - z) * (1 - n * n);
  at::Tensor ghn = gn * r;
  at::Tensor gr = gn * hn * (1 - r) * r;
  c10::ScalarType t = ws.scalar_type();
  at::Tensor grad_input = at::cat({gr, gz, gn}, 1).to(t), grad_hidden = at::cat({gr, gz, ghn}, 1).to(t);
  at::Tensor gib = has_bias ? grad_input.sum(0) : at::Tensor(), ghb = has_bias ? grad_hidden.sum(0) : at::Tensor();
  finish(op, stack, {grad_input, grad_hidden, ghx.to(t), gib, ghb});
}

// ---- SyncBatchNorm ------------------------------------------------------------------------------------

std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims = {0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// (C,) -> (1, C, 1, ...) to broadcast against an input of x's rank
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.numel();
  return v.reshape(shape);
}

void bn_stats(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = tensor(op, stack, "input");
  double eps = arg(op, stack, "eps").toDouble();
  at::Tensor xa = acc(x, acc_of(x));
  auto [var, mean] = at::var_mean(xa, reduce_dims(x), /*correction=*/0, /*keepdim=*/false);
  finish(op, stack, {mean, (var + eps).rsqrt()});
}

void bn_elemt(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor x = tensor(op, stack, "input"), w = tensor(op, stack, "weight"), b = tensor(op, stack, "bias");
  at::Tensor mean = tensor(op, stack, "mean"), invstd = tensor(op, stack, "invstd");
  at::ScalarType a = acc_of(x);
  at::Tensor y = (acc(x, a) - per_channel(acc(mean, a), x)) * per_channel(acc(invstd, a), x);
  if (w.defined()) y = y * per_channel(acc(w, a), x);
  if (b.defined()) y = y + per_channel(acc(b, a), x);
  y = y.to(x.scalar_type());
  const c10::FunctionSchema& s = op.schema();
  if (s.argumentIndexWithName("out").has_value()) {  // batch_norm_elemt.out is a kernel of its own on CUDA
    at::Tensor out = tensor(op, stack, "out");
    at::native::resize_output(out, y.sizes());
    out.copy_(y);
    return finish(op, stack, {out});
  }
  finish(op, stack, {y});
}

// Per-device (mean, invstd) over counts[i] elements each -> the global ones; running stats updated as CUDA
// does (unbiased variance).
void gather_stats(const c10::OperatorHandle& op, Stack* stack, at::Tensor counts) {
  at::Tensor mean = tensor(op, stack, "mean"), invstd = tensor(op, stack, "invstd");
  at::Tensor rm = tensor(op, stack, "running_mean"), rv = tensor(op, stack, "running_var");
  double momentum = arg(op, stack, "momentum").toDouble(), eps = arg(op, stack, "eps").toDouble();
  at::ScalarType a = acc_of(mean);
  at::Tensor n = counts.to(a).reshape({-1, 1});
  at::Tensor m = acc(mean, a), inv = acc(invstd, a);
  at::Tensor total = n.sum();
  at::Tensor gmean = (n * m).sum(0) / total;
  at::Tensor var_i = 1 / (inv * inv) - eps;
  at::Tensor gvar = (n * (var_i + (m - gmean).pow(2))).sum(0) / total;
  if (rm.defined()) rm.copy_((1 - momentum) * acc(rm, a) + momentum * gmean);
  if (rv.defined()) rv.copy_((1 - momentum) * acc(rv, a) + momentum * gvar * total / (total - 1));
  finish(op, stack, {gmean.to(mean.scalar_type()), (gvar + eps).rsqrt().to(mean.scalar_type())});
}

void bn_gather_stats(const c10::OperatorHandle& op, Stack* stack) {
  int64_t count = arg(op, stack, "count").toInt();
  gather_stats(op, stack, at::full({tensor(op, stack, "mean").size(0)}, count, at::kLong));
}

void bn_gather_stats_with_counts(const c10::OperatorHandle& op, Stack* stack) {
  gather_stats(op, stack, tensor(op, stack, "counts"));
}

void bn_backward_reduce(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor dy = tensor(op, stack, "grad_out"), x = tensor(op, stack, "input");
  at::Tensor mean = tensor(op, stack, "mean"), invstd = tensor(op, stack, "invstd");
  bool input_g = arg(op, stack, "input_g").toBool(), weight_g = arg(op, stack, "weight_g").toBool();
  bool bias_g = arg(op, stack, "bias_g").toBool();
  at::ScalarType a = acc_of(x);
  auto dims = reduce_dims(x);
  at::Tensor dya = acc(dy, a);
  at::Tensor sum_dy = dya.sum(dims);
  at::Tensor sum_dy_xmu = (dya * (acc(x, a) - per_channel(acc(mean, a), x))).sum(dims);
  at::Tensor grad_w = weight_g ? (sum_dy_xmu * acc(invstd, a)).to(x.scalar_type()) : at::Tensor();
  at::Tensor grad_b = bias_g ? sum_dy.to(x.scalar_type()) : at::Tensor();
  finish(op, stack, {input_g ? sum_dy : at::Tensor(), input_g ? sum_dy_xmu : at::Tensor(), grad_w, grad_b});
}

void bn_backward_elemt(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor dy = tensor(op, stack, "grad_out"), x = tensor(op, stack, "input");
  at::Tensor mean = tensor(op, stack, "mean"), invstd = tensor(op, stack, "invstd"), w = tensor(op, stack, "weight");
  at::Tensor sum_dy = tensor(op, stack, "sum_dy"), sum_dy_xmu = tensor(op, stack, "sum_dy_xmu");
  at::Tensor count = tensor(op, stack, "count");
  at::ScalarType a = acc_of(x);
  at::Tensor total = count.to(a).sum();
  at::Tensor inv = acc(invstd, a);
  at::Tensor mean_dy = acc(sum_dy, a) / total, mean_dy_xmu = acc(sum_dy_xmu, a) / total;
  at::Tensor g = acc(dy, a) - per_channel(mean_dy, x) -
                 (acc(x, a) - per_channel(acc(mean, a), x)) * per_channel(inv * inv * mean_dy_xmu, x);
  at::Tensor scale = w.defined() ? inv * acc(w, a) : inv;
  finish(op, stack, {(g * per_channel(scale, x)).to(x.scalar_type())});
}

// ---- fused attention for PrivateUse1 ------------------------------------------------------------------

void sdpa_overrideable(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor q = tensor(op, stack, "query"), k = tensor(op, stack, "key"), v = tensor(op, stack, "value");
  at::Tensor bias = tensor(op, stack, "attn_bias");
  double dropout = arg(op, stack, "dropout_p").toDouble();
  bool causal = arg(op, stack, "is_causal").toBool();
  std::optional<double> scale = arg(op, stack, "scale").toOptional<double>();
  TORCH_CHECK(dropout == 0.0, "sim's fused attention has no dropout (dropout_p=", dropout, ")");
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                     bias.defined() ? std::optional(bias) : std::nullopt,
                                                                     scale);
  at::Tensor empty_long = at::empty({0}, at::TensorOptions().dtype(at::kLong));
  finish(op, stack, {out, lse, at::Tensor(), at::Tensor(), IValue(c10::SymInt(q.size(2))), IValue(c10::SymInt(k.size(2))),
                     empty_long, empty_long, at::Tensor()});
}

void sdpa_overrideable_backward(const c10::OperatorHandle& op, Stack* stack) {
  at::Tensor g = tensor(op, stack, "grad_out"), q = tensor(op, stack, "query"), k = tensor(op, stack, "key");
  at::Tensor v = tensor(op, stack, "value"), bias = tensor(op, stack, "attn_bias");
  at::Tensor out = tensor(op, stack, "out"), lse = tensor(op, stack, "logsumexp");
  double dropout = arg(op, stack, "dropout_p").toDouble();
  bool causal = arg(op, stack, "is_causal").toBool();
  std::optional<double> scale = arg(op, stack, "scale").toOptional<double>();
  c10::List<bool> mask = arg(op, stack, "grad_input_mask").toBoolList();
  TORCH_CHECK(dropout == 0.0, "sim's fused attention has no dropout (dropout_p=", dropout, ")");
  bool with_bias = bias.defined() && bias.numel() > 0;
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      g, q, k, v, out, lse, 0.0, causal, with_bias ? std::optional(bias) : std::nullopt, scale);
  TORCH_CHECK(!(with_bias && mask.size() > 3 && mask.get(3)),
              "sim's fused attention does not compute the gradient of attn_bias");
  finish(op, stack, {gq, gk, gv, at::Tensor()});
}

}  // namespace

void add_accelerator_kernels(std::map<std::string, HostKernel>& table) {
  table["aten::_thnn_fused_lstm_cell.default"] = &lstm_cell;
  table["aten::_thnn_fused_lstm_cell_backward_impl.default"] = &lstm_cell_backward;
  table["aten::_thnn_fused_gru_cell.default"] = &gru_cell;
  table["aten::_thnn_fused_gru_cell_backward.default"] = &gru_cell_backward;
  table["aten::batch_norm_stats.default"] = &bn_stats;
  table["aten::batch_norm_elemt.default"] = &bn_elemt;
  table["aten::batch_norm_elemt.out"] = &bn_elemt;
  table["aten::batch_norm_gather_stats.default"] = &bn_gather_stats;
  table["aten::batch_norm_gather_stats_with_counts.default"] = &bn_gather_stats_with_counts;
  table["aten::batch_norm_backward_reduce.default"] = &bn_backward_reduce;
  table["aten::batch_norm_backward_elemt.default"] = &bn_backward_elemt;
  table["aten::_scaled_dot_product_fused_attention_overrideable.default"] = &sdpa_overrideable;
  table["aten::_scaled_dot_product_fused_attention_overrideable_backward.default"] = &sdpa_overrideable_backward;
}

}  // namespace sim::detail

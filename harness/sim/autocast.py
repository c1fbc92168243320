"""``torch.autocast("sim", dtype=...)``: CUDA's autocast op lists, registered for PrivateUse1.

PyTorch registers autocast kernels per device type in C++ (aten/src/ATen/autocast_mode.cpp) and
none for PrivateUse1, not even the fallthrough for ops outside the lists, so without this every
op inside ``torch.autocast("sim")`` fails with "Could not run ... 'Autocastsim' backend". The lists
below are torch 2.13's ``AT_FORALL_*`` macros from ATen/autocast_mode.h, which CUDA uses; the
cast policies are the ones there:

- lower_precision_fp: floating sim tensors (not float64) are cast to the autocast dtype (matmul family)
- fp32: cast to float32 (reductions, norms, losses, pointwise ops that overflow in half)
- fp32_set_opt_dtype: softmax/sum/... run with ``dtype=float32`` unless the call gives a dtype
- fp32_append_dtype: ``norm`` redispatches to its dtype overload with float32
- promote: all floating sim tensors are cast to the widest floating dtype among them

The kernels run only while autocast is on for sim (the AutocastPrivateUse1 key is excluded
otherwise), so they cost nothing elsewhere. Unlike CUDA, casts of weights are not cached across
ops inside one autocast region (that cache is an optimisation, not a numerical difference).
"""

from __future__ import annotations

import torch
from torch.library import fallthrough_kernel

aten = torch.ops.aten
_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)

_lib = torch.library.Library("aten", "IMPL")
_fallback_lib = torch.library.Library("_", "IMPL")


def _overload(name: str) -> torch._ops.OpOverload:
    op, _, overload = name.partition(".")
    return getattr(getattr(aten, op), overload or "default")


def _eligible(x: object) -> bool:
    return (isinstance(x, torch.Tensor) and x.device.type == "sim" and x.is_floating_point()
            and x.dtype is not torch.float64)


def _cast(x: object, dtype: torch.dtype) -> object:
    if _eligible(x) and x.dtype is not dtype:
        return x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _leaves(args: tuple, kwargs: dict) -> list:
    out = []
    for x in (*args, *kwargs.values()):
        out.extend(x if isinstance(x, (list, tuple)) else [x])
    return out


def _dtype_position(op: torch._ops.OpOverload) -> int | None:
    """Index of `op`'s positional ``dtype`` argument (None if it is keyword-only or absent)."""
    positional = [a.name for a in op._schema.arguments if not a.kwarg_only]
    return positional.index("dtype") if "dtype" in positional else None


def _kernel(op: torch._ops.OpOverload, policy: str, target: torch._ops.OpOverload | None = None):
    dtype_at = _dtype_position(op)

    def run(*args: object, **kwargs: object) -> object:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if policy == "lower_precision_fp":
                dtype = torch.get_autocast_dtype("sim")
                return op(*_cast(args, dtype), **_cast(kwargs, dtype))
            if policy == "fp32":
                return op(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
            first = next((x for x in args if isinstance(x, torch.Tensor)), None)
            if policy == "fp32_set_opt_dtype":
                if _eligible(first):
                    if dtype_at is not None and dtype_at < len(args):
                        if args[dtype_at] is None:
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == "fp32_append_dtype":
                if _eligible(first):
                    return target(*args, **kwargs, dtype=torch.float32)
                return op(*args, **kwargs)
            # promote: the widest floating dtype among the eligible tensors
            widest = torch.get_autocast_dtype("sim")
            for x in _leaves(args, kwargs):
                if _eligible(x):
                    widest = torch.promote_types(widest, x.dtype)
            return op(*_cast(args, widest), **_cast(kwargs, widest))

    return run


def _banned_binary_cross_entropy(*args: object, **kwargs: object) -> object:
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast."
    )


def register() -> None:
    _fallback_lib.fallback(fallthrough_kernel, _KEY)
    for policy, names in (("lower_precision_fp", LOWER_PRECISION_FP), ("fp32", FP32),
                          ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE), ("promote", PROMOTE)):
        for name in names:
            _lib.impl(name, _kernel(_overload(name), policy), _KEY)
    for name, target in FP32_APPEND_DTYPE.items():
        _lib.impl(name, _kernel(_overload(name), "fp32_append_dtype", _overload(target)), _KEY)
    _lib.impl("binary_cross_entropy", _banned_binary_cross_entropy, _KEY)

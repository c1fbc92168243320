"""Build the ``young`` sim op profile (harness/sim/profiles/young.txt) from rules, deterministically.

Why generated: a hand-kept list drifts from what models actually call, and nobody can tell which
entries were choices. The rules (also written into the file's header):

1. Core ATen IR: every overload tagged ``torch.Tag.core`` -- what any backend targets first.
2. Plus every op that real tiny transformers models dispatch on sim (inference forward, training
   forward + backward of a cross-entropy + squared loss, one AdamW step, greedy ``generate`` for
   the generative heads), traced with
   ``harness.sim.opset.start_trace/stop_trace`` under ``op_profile("full")`` over `MODELS`:
   text encoders/decoders/seq2seq, vision (ViT/ConvNeXt/Swin/...), speech (wav2vec2/whisper/...),
   each built from ``AutoConfig.for_model(model_type)`` with every size shrunk. These are the
   view/copy/in-place/fused ops eager backends must have that core ATen leaves out.
3. Plus the in-place/functional sibling of every op so far (``add.Tensor`` <-> ``add_.Tensor``:
   same arguments, ``name`` vs ``name_``): an eager backend writes the pair as one kernel, and
   optimizers and user code need the in-place half. And the per-tensor op under every ``_foreach_``
   op (``_foreach_lerp_.Scalar`` -> ``lerp``/``lerp_``): a backend writes the list kernel over the
   single-tensor one. ``out=`` variants are not added: models do not call them, and young backends
   (functionalization-based ones in particular) skip them.
4. Plus the ops every profile has (``harness.sim.opset.ALWAYS_ALLOWED``).
5. Minus `NOT_YET_IMPLEMENTED`: the long tail young backends really lack, by packet (all
   overloads, backward included). Tuned so that a real share of the tiny zoo (roughly 10-30%) hits
   an unsupported op while most models still run: with this list about 20% of the zoo's working
   (model, head) pairs fail, mostly mixture-of-experts models on ``sort``.

Entries are full overload names (``aten::add.Tensor``, ``aten::addmm.default``), sorted. Running
this again in the same torch/transformers gives the same file; ``--check`` verifies that.

    python scripts/build_op_profile.py            # (re)write the profile, print size and exclusions
    python scripts/build_op_profile.py --check    # exit 1 if the committed file is out of date
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import torch

import harness.sim as sim
from harness import files
from harness.models.inputs import make_inputs
from harness.models.outputs import output_tensors
from harness.models.tiny import build_tiny
from harness.sim import opset
from harness.sim import opset as sim_opset

PROFILE = Path(opset.PROFILE_DIR) / "young.txt"

# (model_type, head) pairs traced for rule 2: one or two per family, every modality.
MODELS: list[tuple[str, str]] = [
    # text encoders
    ("bert", "masked-lm"),
    ("bert", "seq-cls"),
    ("roberta", "token-cls"),
    ("distilbert", "qa"),
    ("albert", "masked-lm"),
    ("electra", "seq-cls"),
    ("deberta", "masked-lm"),
    ("deberta-v2", "masked-lm"),
    ("mpnet", "masked-lm"),
    ("xlm-roberta", "masked-lm"),
    ("convbert", "masked-lm"),
    ("mobilebert", "masked-lm"),
    ("roformer", "masked-lm"),
    ("big_bird", "masked-lm"),
    ("canine", "base"),
    ("modernbert", "masked-lm"),
    ("longformer", "masked-lm"),
    ("squeezebert", "masked-lm"),
    ("xlnet", "seq-cls"),
    ("reformer", "masked-lm"),
    ("mra", "masked-lm"),
    ("fnet", "masked-lm"),
    ("nystromformer", "masked-lm"),
    ("layoutlmv3", "token-cls"),
    # decoders
    ("gpt2", "causal-lm"),
    ("gpt_neo", "causal-lm"),
    ("gptj", "causal-lm"),
    ("gpt_neox", "causal-lm"),
    ("llama", "causal-lm"),
    ("mistral", "causal-lm"),
    ("qwen2", "causal-lm"),
    ("qwen3", "causal-lm"),
    ("phi", "causal-lm"),
    ("phi3", "causal-lm"),
    ("gemma", "causal-lm"),
    ("gemma2", "causal-lm"),
    ("gemma3n_text", "causal-lm"),
    ("falcon", "causal-lm"),
    ("bloom", "causal-lm"),
    ("opt", "causal-lm"),
    ("codegen", "causal-lm"),
    ("olmo", "causal-lm"),
    ("stablelm", "causal-lm"),
    ("mpt", "causal-lm"),
    ("xglm", "causal-lm"),
    ("ctrl", "causal-lm"),
    ("cpmant", "causal-lm"),
    ("diffllama", "causal-lm"),
    ("granite_swa", "causal-lm"),
    ("llama4_text", "causal-lm"),
    # mixture of experts and state-space / hybrid decoders
    ("mixtral", "causal-lm"),
    ("qwen2_moe", "causal-lm"),
    ("qwen3_moe", "causal-lm"),
    ("deepseek_v3", "causal-lm"),
    ("olmoe", "causal-lm"),
    ("jetmoe", "causal-lm"),
    ("gpt_oss", "causal-lm"),
    ("mamba", "causal-lm"),
    ("jamba", "causal-lm"),
    ("bamba", "causal-lm"),
    ("falcon_h1", "causal-lm"),
    ("kimi_linear", "causal-lm"),
    ("rwkv", "causal-lm"),
    # encoder-decoders
    ("t5", "seq2seq-lm"),
    ("bart", "seq2seq-lm"),
    ("mbart", "seq2seq-lm"),
    ("pegasus", "seq2seq-lm"),
    ("marian", "seq2seq-lm"),
    ("m2m_100", "seq2seq-lm"),
    ("led", "seq2seq-lm"),
    # vision
    ("vit", "image-cls"),
    ("beit", "image-cls"),
    ("convnext", "image-cls"),
    ("convnextv2", "image-cls"),
    ("swin", "image-cls"),
    ("swinv2", "image-cls"),
    ("resnet", "image-cls"),
    ("regnet", "image-cls"),
    ("mobilenet_v1", "image-cls"),
    ("mobilenet_v2", "image-cls"),
    ("poolformer", "image-cls"),
    ("segformer", "semantic-seg"),
    ("dinov2", "image-cls"),
    ("mobilevit", "image-cls"),
    ("focalnet", "image-cls"),
    ("hiera", "image-cls"),
    ("cvt", "image-cls"),
    ("pvt", "image-cls"),
    ("bit", "image-cls"),
    ("pp_lcnet", "image-cls"),
    ("hgnet_v2", "image-cls"),
    ("swiftformer", "image-cls"),
    ("glpn", "depth"),
    ("dpt", "depth"),
    ("upernet", "semantic-seg"),
    ("maskformer", "universal-seg"),
    ("yolos", "object-detection"),
    ("rt_detr", "object-detection"),
    ("d_fine", "object-detection"),
    ("clip", "image-cls"),
    ("siglip", "image-cls"),
    ("sam_vision_model", "base"),
    ("swin", "masked-image-modeling"),
    ("vit_mae", "base"),
    ("chmv2", "depth"),
    # speech and audio
    ("wav2vec2", "ctc"),
    ("wav2vec2-conformer", "ctc"),
    ("hubert", "ctc"),
    ("wavlm", "ctc"),
    ("data2vec-audio", "ctc"),
    ("unispeech", "ctc"),
    ("sew-d", "ctc"),
    ("whisper", "speech-seq2seq"),
    ("speech_to_text", "speech-seq2seq"),
    ("univnet", "base"),
    ("fastspeech2_conformer", "base"),
    ("vits", "base"),
    ("wav2vec2-conformer", "pretraining"),
    ("nemotron3_diarization", "audio-frame-cls"),
]

GENERATIVE = {"causal-lm", "seq2seq-lm", "speech-seq2seq"}

# Rule 5. Packet name -> why a young backend typically does not have it yet.
NOT_YET_IMPLEMENTED: dict[str, str] = {
    # spectral
    "aten::_fft_c2c": "FFT: needs a vendor FFT library; arrives late",
    "aten::_fft_r2c": "FFT",
    "aten::_fft_c2r": "FFT",
    # scans
    # (cumsum itself is kept: every decoder builds position ids with it, so it is written first)
    "aten::cumprod": "scans (prefix products/extrema) need a dedicated parallel kernel; often missing early",
    "aten::cummax": "scans",
    "aten::cummin": "scans",
    "aten::_cummax_helper": "scans",
    "aten::_cummin_helper": "scans",
    "aten::logcumsumexp": "scans",
    # sorting
    "aten::sort": "sorting: a full device sort is one of the later kernels (topk is kept); this is what "
    "keeps most mixture-of-experts models off a young backend",
    "aten::argsort": "sorting",
    "aten::msort": "sorting",
    "aten::kthvalue": "sorting",
    "aten::median": "sorting",
    "aten::nanmedian": "sorting",
    # data-dependent output shapes
    "aten::_unique2": "data-dependent output shape",
    "aten::unique_dim": "data-dependent output shape",
    "aten::unique_consecutive": "data-dependent output shape",
    # sampling / resampling
    "aten::grid_sampler_2d": "grid sampling: gather-heavy, bilinear/bicubic modes; late",
    "aten::grid_sampler_3d": "grid sampling",
    "aten::grid_sampler_2d_backward": "grid sampling",
    "aten::upsample_bicubic2d": "bicubic upsampling (nearest/bilinear are implemented)",
    "aten::upsample_bicubic2d_backward": "bicubic upsampling",
    "aten::_upsample_bicubic2d_aa": "antialiased upsampling",
    "aten::_upsample_bilinear2d_aa": "antialiased upsampling",
    "aten::_upsample_bicubic2d_aa_backward": "antialiased upsampling",
    "aten::_upsample_bilinear2d_aa_backward": "antialiased upsampling",
    # fused/legacy reparametrisations and layout transforms
    "aten::_weight_norm_interface": "fused weight norm (torch.nn.utils.weight_norm)",
    "aten::_weight_norm_interface_backward": "fused weight norm",
    "aten::roll": "roll (circular shift) is rarely written early; cat-of-slices workarounds are common",
    "aten::im2col": "im2col/col2im (nn.Unfold/Fold)",
    "aten::col2im": "im2col/col2im",
    # complex numbers
    "aten::view_as_complex": "no complex dtypes yet",
    "aten::view_as_real": "no complex dtypes yet",
    "aten::polar": "no complex dtypes yet",
    # dense linear algebra beyond matmul
    "aten::linalg_solve_triangular": "linalg: needs a vendor LAPACK equivalent",
    "aten::triangular_solve": "linalg",
    "aten::linalg_qr": "linalg",
    "aten::_linalg_eigh": "linalg",
    "aten::_linalg_svd": "linalg",
    "aten::linalg_cholesky_ex": "linalg",
    "aten::linalg_inv_ex": "linalg",
    "aten::_linalg_det": "linalg",
    "aten::_linalg_slogdet": "linalg",
    "aten::linalg_lu_factor_ex": "linalg",
    "aten::_linalg_solve_ex": "linalg",
    "aten::linalg_householder_product": "linalg",
}


def core_ops() -> set[str]:
    """Every ATen overload tagged core, as ``aten::name.overload``."""
    out = set()
    for name in dir(torch.ops.aten):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if torch.Tag.core in op.tags:
                out.add(f"{op._schema.name}.{ov}")
    return out


def _schema_key(op: torch._ops.OpOverload) -> tuple:
    """An overload's arguments without its ``out=`` ones: equal for an op and its in-place sibling."""
    return tuple(
        (a.name, str(a.type))
        for a in op._schema.arguments
        if not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    )


def _is_out_variant(op: torch._ops.OpOverload) -> bool:
    return any(
        a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
    )


def inplace_siblings(names: set[str]) -> set[str]:
    """Rule 3: for ``aten::x.ov`` the overloads of ``x``/``x_`` with the same (non-out) arguments."""
    out = set()
    for name in names:
        packet_name, _, ov = name.split("::", 1)[1].partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None or ov not in packet.overloads():
            continue
        key = _schema_key(getattr(packet, ov))
        base = packet_name.rstrip("_")
        for sibling in (base, base + "_"):
            other = getattr(torch.ops.aten, sibling, None)
            if other is None:
                continue
            for o in other.overloads():
                op = getattr(other, o)
                if not _is_out_variant(op) and _schema_key(op) == key:
                    out.add(f"aten::{sibling}.{o}")
    return out


def foreach_singles(names: set[str]) -> set[str]:
    """Rule 3, second half: every non-out overload of ``x``/``x_`` for each ``aten::_foreach_x[_].ov``."""
    out = set()
    for name in names:
        packet_name = name.split("::", 1)[1].split(".", 1)[0]
        if not packet_name.startswith("_foreach_"):
            continue
        base = packet_name.removeprefix("_foreach_").rstrip("_")
        for single in (base, base + "_"):
            packet = getattr(torch.ops.aten, single, None)
            if packet is None:
                continue
            for o in packet.overloads():
                op = getattr(packet, o)
                takes_tensors = any(isinstance(a.type, torch.TensorType) for a in op._schema.arguments)
                if takes_tensors and not _is_out_variant(op):
                    out.add(f"aten::{single}.{o}")
    return out


def _full_name(name: str) -> str:
    """Trace names use ``aten::x`` for the default overload; the profile spells it ``aten::x.default``."""
    return name if "." in name.split("::", 1)[1] else f"{name}.default"


def _traced(fn) -> tuple[set[str], str | None]:
    sim_opset.start_trace()
    try:
        fn()
    except Exception as e:
        return {_full_name(n) for n in sim_opset.stop_trace()}, f"{type(e).__name__}: {str(e)[:120]}"
    return {_full_name(n) for n in sim_opset.stop_trace()}, None


def trace_model(model_type: str, task: str) -> tuple[set[str], list[str]]:
    """Ops one model dispatches on sim (forward, backward, AdamW step, generate), and any failures."""
    problems = []
    cpu_model = build_tiny(model_type, task)
    inputs = make_inputs(cpu_model, cpu_model.config, task=task)
    ops: set[str] = set()
    with sim.op_profile("full"):
        model = copy.deepcopy(cpu_model).to("sim")
        sim_in = {k: v.to("sim") for k, v in inputs.items()}
        out_box = []

        def forward():
            with torch.no_grad():
                model(**sim_in)

        def train_forward():  # dropout and friends only run in training mode
            model.train()
            out_box.append(model(**sim_in))

        def backward():
            out = next(t for t in output_tensors(out_box[0]).values() if t.is_floating_point()).float()
            if out.dim() >= 2 and out.shape[-1] > 1:  # logits: a classification loss, as training uses
                flat = out.reshape(-1, out.shape[-1])
                target = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
                loss = torch.nn.functional.cross_entropy(flat, target) + out.square().mean()
            else:
                loss = out.square().mean()
            loss.backward()

        def step():
            opt = torch.optim.AdamW([p for p in model.parameters() if p.grad is not None], lr=1e-3)
            opt.step()
            opt.zero_grad()

        def generate():
            model.eval()
            gen_in = {k: v for k, v in sim_in.items() if not k.startswith("decoder_")}
            gc = model.generation_config
            if (
                model.config.is_encoder_decoder
                and gc.decoder_start_token_id is None
                and gc.bos_token_id is None
            ):
                gen_in["decoder_start_token_id"] = 0
            with torch.no_grad():
                model.generate(**gen_in, max_new_tokens=3, do_sample=False)

        stages = [
            ("forward", forward),
            ("train-forward", train_forward),
            ("backward", backward),
            ("step", step),
        ]
        if task in GENERATIVE:
            stages.append(("generate", generate))
        for stage, fn in stages:
            seen, err = _traced(fn)
            if err:  # the trace includes the op that failed, so a failed stage contributes nothing
                problems.append(f"{stage}: {err}")
                if stage in ("forward", "train-forward"):
                    break
            else:
                ops |= seen
    return ops, problems


def build(verbose: bool = True) -> tuple[list[str], dict]:
    """The sorted profile lines plus facts for the header and the summary."""
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    core = core_ops()
    traced: set[str] = set()
    used_by: dict[str, set[str]] = {}
    problems: dict[str, list[str]] = {}
    for model_type, task in MODELS:
        try:
            ops, probs = trace_model(model_type, task)
        except Exception as e:  # could not even build it on CPU: say so, do not guess its ops
            ops, probs = set(), [f"build: {type(e).__name__}: {str(e)[:120]}"]
        if verbose:
            print(
                f"  traced {model_type:<16} {task:<15} {len(ops):4d} ops"
                + (f"  ({probs[0]})" if probs else "")
            )
        traced |= ops
        if probs:
            problems[f"{model_type}/{task}"] = probs
        for op in ops:
            used_by.setdefault(op, set()).add(f"{model_type}/{task}")
    siblings = (inplace_siblings(core | traced) | foreach_singles(core | traced)) - core - traced
    always = set(opset.ALWAYS_ALLOWED)  # as spelled there: some are packets on purpose (view, detach...)
    candidates = core | traced | siblings | always

    def excluded(op: str) -> bool:
        return op.split(".", 1)[0] in NOT_YET_IMPLEMENTED and op not in opset.ALWAYS_ALLOWED

    lines = sorted(op for op in candidates if not excluded(op))
    removed = sorted(op for op in candidates if excluded(op))
    facts = {
        "core": len(core),
        "traced": len(traced),
        "traced_not_core": len(traced - core),
        "siblings": len(siblings),
        "removed": removed,
        "used_by": used_by,
        "problems": problems,
    }
    return lines, facts


def render(lines: list[str], facts: dict) -> str:
    import transformers

    excluded_models = sorted({m for op in facts["removed"] for m in facts["used_by"].get(op, ())})
    head = [
        "# sim op profile 'young': a backend a few months into bring-up.",
        "# GENERATED by scripts/build_op_profile.py -- edit the rules there, not this file.",
        f"# torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}; "
        f"{len(lines)} entries.",
        "#",
        "# Rules:",
        f"#   1. Core ATen IR: every overload tagged torch.Tag.core ({facts['core']}).",
        f"#   2. + ops {len(MODELS)} tiny transformers models dispatch on sim: inference forward, training",
        f"#      forward+backward, one AdamW step, greedy generate ({facts['traced']} ops, "
        f"{facts['traced_not_core']} not in core).",
        "#   3. + the in-place/functional sibling of each (add.Tensor <-> add_.Tensor; no out=), and the",
        f"#      per-tensor op under each _foreach_ op (_foreach_lerp_.Scalar -> lerp, lerp_) ({facts['siblings']}).",
        "#   4. + harness.sim.opset.ALWAYS_ALLOWED.",
        "#   5. - the 'not yet implemented' list below (whole packets, backward included).",
        "#",
        "# Not yet implemented (packet: why):",
    ]
    for packet, why in NOT_YET_IMPLEMENTED.items():
        head.append(f"#   {packet}: {why}")
    head += [
        "#",
        f"# Removed by rule 5 ({len(facts['removed'])}): " + ", ".join(facts["removed"]),
        "# Traced models that use a removed op (so fail on 'young'): "
        + (", ".join(excluded_models) or "none"),
        "#",
        "# Entry syntax: aten::name.overload (aten::name.default = default overload only; a bare",
        "# aten::name = every overload).",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    ap.add_argument("--out", type=Path, default=PROFILE)
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)

    lines, facts = build(verbose=not args.quiet)
    text = render(lines, facts)
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'OUT OF DATE (rerun scripts/build_op_profile.py)'}")
        return 0 if same else 1
    files.write_text(args.out, text)
    print(
        f"wrote {args.out}: {len(lines)} entries (core {facts['core']}, traced {facts['traced']} of which "
        f"{facts['traced_not_core']} beyond core, {facts['siblings']} in-place/functional siblings)"
    )
    print(f"excluded by rule 5 ({len(facts['removed'])} entries that rules 1-4 would include):")
    for op in facts["removed"]:
        users = sorted(facts["used_by"].get(op, ()))
        print(f"  {op:<45} {'used by ' + ', '.join(users) if users else '(core only)'}")
    if facts["problems"]:
        print("models with stages that failed even on 'full' (their ops there are not traced):")
        for m, probs in sorted(facts["problems"].items()):
            print(f"  {m}: {'; '.join(probs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

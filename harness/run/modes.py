"""What a mode compares: the step both sides run, and what its results need before and after the comparison.

`pipeline` runs the same phases for every mode (load, reference twice, fp64 oracle, declared-precision
expected reference, target, compare, localize); a mode says what one *step* is and how its named
outputs are judged:

- ``inference``: one forward without gradients; every float output.
- ``train``: one deterministic training step (`harness.run.train`): the loss, every gradient, and the
  SGD-momentum and AdamW updates, which the target is judged on as replayed on the CPU from its own
  gradients; a parameter with a gradient on the reference and none on the target is `missing_grad`;
  a drift names a parameter rather than a module.
- ``generate``: greedy decoding of ``new_tokens`` tokens through transformers' `generate()` with a KV cache
  (`harness.run.generate`), teacher-forced along the reference's tokens: each step's logits, judged
  step by step; a drift names the first failing step (from step 1 on, with step 0 clean: the cache
  path). The target's own free-running tokens are a metric (tokens matched, first divergent step, near-tie
  or bug there). A model without a generation head is `skipped`.

A new mode is one more `Mode` in `MODES`, and its name in `harness.run.MODE_NAMES` (the CLI's choices, which
must not import torch). What its `plan` decides goes
into `Plan.fields` (JSON-able row fields); the reference cache keeps them, and `rebuild` makes the same
step from them without running it. A mode whose `plan` runs the step to decide overrides `rebuild`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.backends.contracts import autocast_region
from harness.models.labels import make_labels
from harness.models.outputs import on_host, output_tensors
from harness.results.draft import RowDraft
from harness.run import KV_CACHES, MODE_NAMES, NEW_TOKENS, generate
from harness.run.compare import Comparison, Tolerance
from harness.run.train import (
    OPTIMIZERS,
    SKIPPED,
    family_floors,
    missing_grads,
    prepare,
    replay_updates,
    step_device,
    train_metrics,
    train_step,
)

Step = Callable[[torch.nn.Module, dict[str, Any]], dict[str, torch.Tensor]]


@dataclass
class Plan:
    """One model's step under a mode, decided on the reference."""

    step: Step  # (model, inputs) -> named CPU tensors; run on the reference, the oracle and the target
    inputs: dict[str, Any]  # what the step takes (the model's inputs, plus labels in train mode)
    fields: RowDraft = field(default_factory=RowDraft)  # row fields the mode decided (loss_kind)
    first: dict[str, torch.Tensor] | None = None  # the reference's first result, if deciding the step ran it
    extra: Callable[[torch.nn.Module, dict[str, Any]], Any] | None = None  # run once more on the target alone,
    # after the judged run (generate: free-running decoding); its result is the target side's `extra`
    phase: Callable[[], int | None] | None = None  # where the running step is (generate: the decoding step),
    # read by the op check when an op fails


class Skip(Exception):
    """The mode does not apply to this model (the message says why): its row is `skipped`."""


@dataclass
class Assessment:
    """What a mode adds to a verdict: row fields, a decided outcome, messages for a drift's explanation."""

    fields: RowDraft = field(default_factory=RowDraft)
    missing_grads: list[str] = field(default_factory=list)  # train: evidence for the verdict (harness.verdict)


def forward(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One forward without gradients (under autocast when the run asks for it): every float output, on the CPU."""
    with torch.no_grad(), autocast_region(step_device(model, inputs)):
        out = model(**inputs)
    return {k: on_host(v) for k, v in output_tensors(out).items()}


class Mode:
    """Inference, and the defaults every mode starts from."""

    name = "inference"
    localizes = True  # a drift is localized to a module by comparing module outputs
    streamed_oracle = True  # the fp64 oracle may stream one op's weights at a time (real checkpoints)
    keeps_cpu_model = False  # the CPU model is needed after the target ran, so the target gets a copy

    def configured(self, settings: dict[str, Any]) -> Mode:
        """This mode with the run's settings (the mode's own options)."""
        return self

    def plan(self, model: torch.nn.Module, loaded: Any, entry: Any, inputs: dict[str, Any], seed: int) -> Plan:
        return Plan(forward, inputs)

    def rebuild(self, model: torch.nn.Module, loaded: Any, entry: Any, inputs: dict[str, Any], seed: int,
                fields: Mapping[str, Any]) -> Plan:
        """The plan `plan` made, from the decisions it recorded (`fields`), for a reference side that comes
        from the cache: the model is prepared as `plan` prepares it, and nothing is run."""
        return replace(self.plan(model, loaded, entry, inputs, seed), first=None)

    def before_compare(self, model: torch.nn.Module, ref: dict, target: dict, oracle: dict | None,
                       expected: dict | None, tol: Tolerance) -> tuple[dict, dict | None, dict | None, Tolerance]:
        """(reference, oracle, expected, tolerance) as the comparison should see them."""
        return ref, oracle, expected, tol

    def assess(self, ref: dict, target: dict, verdict: Comparison) -> Assessment:
        return Assessment()

    def measure(self, side: Any, target: Any, verdict: Comparison, tol: Tolerance) -> RowDraft:
        """Row fields measured beyond the verdict, from the reference side and the target side."""
        return RowDraft()

    def explain(self, out: RowDraft, kernel: Any, verdict: Comparison, envelope: str) -> list[str]:
        """Extra sentences for a drift's message (and fields written into `out`)."""
        return []


class TrainMode(Mode):
    name = "train"
    localizes = False  # a drift names the parameter whose gradient moved, not a module
    streamed_oracle = False  # gradients and optimizer state take the parameters' dtype: fp32 weights give no fp64 step
    keeps_cpu_model = True  # the target's updates are replayed on the CPU model

    def plan(self, model: torch.nn.Module, loaded: Any, entry: Any, inputs: dict[str, Any], seed: int) -> Plan:
        """The head's own loss where its labels work on the reference, else the fixed reduction (and why)."""
        prepare(model)
        why = "the head takes no labels"
        try:
            labels = make_labels(model, loaded.config, entry.task, inputs, seed=seed)
        except Exception as e:  # labels are ours to make: the step falls back to the fixed reduction
            labels, why = {}, f"no labels could be made: {type(e).__name__}: {str(e)[:200]}"
        if labels:
            with_labels = {**inputs, **labels}
            try:
                first = train_step(model, with_labels, model_loss=True, seed=seed)
            except Exception as e:
                why = f"the head's loss failed: {type(e).__name__}: {str(e)[:200]}"
            else:
                return _train_plan(with_labels, {"loss_kind": "model"}, seed, first)
        first = train_step(model, inputs, model_loss=False, seed=seed)
        return _train_plan(inputs, {"loss_kind": f"reduction ({why})"}, seed, first)

    def rebuild(self, model, loaded, entry, inputs, seed, fields):
        """The loss `plan` chose (its `loss_kind`), without trying the head's loss again."""
        prepare(model)
        if fields.get("loss_kind") == "model":
            labels = make_labels(model, loaded.config, entry.task, inputs, seed=seed)
            return _train_plan({**inputs, **labels}, fields, seed)
        return _train_plan(inputs, fields, seed)

    def before_compare(self, model, ref, target, oracle, expected, tol):
        """The optimizers judged on the target's own gradients (see harness.run.train). Under fp16 autocast a
        step the target's loss scaler skipped is judged against the expected reference's own decision: where
        the reference skipped (its gradients overflowed), only the loss is compared; where it stepped and
        the target did not, ``amp/step_skipped`` differs (drift)."""
        if SKIPPED in target:
            mine = bool(target[SKIPPED].item())
            theirs = bool(expected[SKIPPED].item()) if expected is not None and SKIPPED in expected else False
            if expected is not None:
                expected = {k: v for k, v in expected.items() if k != SKIPPED}
            if theirs:  # the reference stepped nothing: its gradients are inf/NaN, the loss is what is judged
                for k in [k for k in target if k.split("/")[0] in ("grad", *OPTIMIZERS)]:
                    del target[k]
                ref = {k: v for k, v in ref.items() if k.split("/")[0] not in ("grad", *OPTIMIZERS)}
                oracle = None if oracle is None else {k: v for k, v in oracle.items() if k in ref}
                expected = None if expected is None else {k: v for k, v in expected.items() if k in ref}
                ref[SKIPPED] = torch.tensor(int(mine))  # the target's decision is not judged against it
                return ref, oracle, expected, replace(tol, relative=True)
            ref = {**ref, SKIPPED: torch.tensor(0)}  # the reference stepped: a target that skipped drifts
        ref = {**ref, **replay_updates(model, {k: v for k, v in target.items() if k != SKIPPED})}
        tol = replace(tol, relative=True, min_rms=family_floors(ref))
        if oracle is not None:
            oracle = {**oracle, **replay_updates(model, target, torch.float64)}
        if expected is not None:
            expected = {**expected, **{k: v for k, v in ref.items() if k.split("/")[0] in OPTIMIZERS}}
        return ref, oracle, expected, tol

    def assess(self, ref, target, verdict):
        judged = Assessment(train_metrics(ref, target, {c.name: c for c in verdict.checks}))
        if SKIPPED in target and "loss" in ref and not any(k.startswith("grad/") for k in ref):
            judged.fields["amp_step_skipped"] = "both" if bool(target[SKIPPED].item()) else "reference only"
        elif SKIPPED in target and bool(target[SKIPPED].item()):
            judged.fields["amp_step_skipped"] = "target only"
        judged.missing_grads = missing_grads(ref, target)
        return judged

    def explain(self, out, kernel, verdict, envelope):
        if out.get("amp_step_skipped") == "target only":
            return ["the target's loss scaler found inf/NaN gradients and skipped the step; the reference's did not"]
        if out.get("first_drift_param"):
            return [f"first parameter whose gradient drifts: {out['first_drift_param']}"]
        if kernel is None:
            return []
        if kernel.param:  # gradients within the envelope: name the kernel's parameter
            out["first_drift_param"] = kernel.param
            return [f"gradients within the {envelope} envelope; the drifting kernel's parameter (or its "
                    f"module's nearest): {kernel.param}"]
        grads = [c for c in verdict.checks if c.name.startswith("grad/") and c.rmse_ratio is not None]
        if grads:  # e.g. the loss, outside every module: the gradient it moved most
            out["first_drift_param"] = max(grads, key=lambda c: c.rmse_ratio).name.removeprefix("grad/")
            return [f"gradients within the {envelope} envelope; the drifting kernel has no parameter of its own "
                    f"or of its module's, the gradient it moved most: {out['first_drift_param']}"]
        return []


def _train_plan(inputs: dict[str, Any], fields: Mapping[str, Any], seed: int,
                first: dict[str, torch.Tensor] | None = None) -> Plan:
    model_loss = fields.get("loss_kind") == "model"
    return Plan(lambda m, x: train_step(m, x, model_loss=model_loss, seed=seed), inputs, RowDraft(fields), first)


class GenerateMode(Mode):
    name = "generate"
    localizes = False  # a drift names the step; module outputs of one forward would not say which

    def __init__(self, new_tokens: int = NEW_TOKENS, cache: str = KV_CACHES[0]) -> None:
        self.new_tokens, self.cache = new_tokens, cache
        self.tokenizer: Any = None  # the checkpoint's, where it has one: the row keeps its tokens' text

    def configured(self, settings: dict[str, Any]) -> Mode:
        return GenerateMode(int(settings.get("new_tokens", NEW_TOKENS)), settings.get("cache", KV_CACHES[0]))

    def plan(self, model: torch.nn.Module, loaded: Any, entry: Any, inputs: dict[str, Any], seed: int) -> Plan:
        """Decode greedily on the reference; the step decodes along its tokens."""
        why = generate.not_generative(model)
        if why:
            raise Skip(why)
        self.tokenizer = generate.tokenizer_for(entry)
        model.eval()
        prompt = generate.prompt(model, inputs)
        ref = generate.decode(model, prompt, self.new_tokens, self.cache)
        if self.cache == "static" and not generate.uses_static_cache(ref.cache_kind):
            raise Skip(f"--cache static: generate() decodes {type(model).__name__} with its own "
                       f"{ref.cache_kind or 'state'}, not a StaticCache")
        step = generate.TeacherForced(self.new_tokens, self.cache, ref.tokens)
        return Plan(step, prompt, RowDraft(new_tokens=self.new_tokens, ref_tokens=ref.tokens.tolist()),
                    extra=generate.free_running(self.new_tokens, self.cache), phase=step.now)

    def rebuild(self, model, loaded, entry, inputs, seed, fields):
        """The teacher-forced step along the reference's tokens the cache kept, without decoding again."""
        self.tokenizer = generate.tokenizer_for(entry)
        model.eval()
        prompt = generate.prompt(model, inputs)
        step = generate.TeacherForced(self.new_tokens, self.cache, torch.tensor(fields["ref_tokens"]))
        return Plan(step, prompt, RowDraft(fields), extra=generate.free_running(self.new_tokens, self.cache),
                    phase=step.now)

    def assess(self, ref, target, verdict):
        return Assessment(generate.step_fields({c.name: c for c in verdict.checks}))

    def measure(self, side, target, verdict, tol):
        if target.extra is None:
            return RowDraft()
        out = generate.agreement(torch.tensor(side.plan.fields["ref_tokens"]), target.extra, side.ref, side.oracle,
                                 side.expected, tol.floor(torch.zeros(1)), {c.name: c.ok_declared for c in verdict.checks})
        text = generate.token_text(self.tokenizer, side.plan.fields["ref_tokens"], out["target_tokens"])
        if text:
            out["token_text"] = text
        return out

    def explain(self, out, kernel, verdict, envelope):
        k = out.get("first_drift_step")
        if k is None and kernel is not None and kernel.step is not None:
            # every step's logits inside the envelope, a kernel beyond it: the step is the kernel's
            k = out["first_drift_step"] = kernel.step
            return [f"logits within the {envelope} envelope at every step; the kernel ran in {_step(k)} of "
                    f"{out.get('new_tokens')}"]
        if k is None:
            return [f"logits within the {envelope} envelope at every step"] if kernel is not None else []
        return [f"first step whose logits are beyond the bound: {_step(k)} of {out.get('new_tokens')}"]


def _step(k: int) -> str:
    return "step 0 (the prompt's forward)" if k == 0 else f"step {k} (step 0 clean: the cache path)"


MODES: dict[str, Mode] = {m.name: m for m in (Mode(), TrainMode(), GenerateMode())}
assert tuple(MODES) == MODE_NAMES, "harness.run.MODE_NAMES (what the CLI offers) must name every mode"


def mode_for(settings: dict[str, Any]) -> Mode:
    """The mode a run's settings name (inference unless told)."""
    name = settings.get("mode", "inference")
    if name not in MODES:
        raise ValueError(f"--mode {name!r}: expected one of {', '.join(MODES)}")
    return MODES[name].configured(settings)

"""Task heads: the name a model list uses for a head, and the transformers Auto class behind it.

`HEADS` maps e.g. ``causal-lm`` to transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``AutoModelForCausalLM``; both the tiny builder and ``from_pretrained`` loading go through it.
"""

from __future__ import annotations

from typing import Any

HEADS: dict[str, tuple[str, str]] = {
    "base": ("MODEL_MAPPING_NAMES", "AutoModel"),
    "pretraining": ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "AutoModelForPreTraining"),
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq2seq-lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
    "token-cls": ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification"),
    "qa": ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering"),
    "multiple-choice": ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "AutoModelForMultipleChoice"),
    "next-sentence": (
        "MODEL_FOR_NEXT_SENTENCE_PREDICTION_MAPPING_NAMES",
        "AutoModelForNextSentencePrediction",
    ),
    "text-encoding": ("MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES", "AutoModelForTextEncoding"),
    "image-cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    "masked-image-modeling": (
        "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES",
        "AutoModelForMaskedImageModeling",
    ),
    "semantic-seg": ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "AutoModelForSemanticSegmentation"),
    "universal-seg": ("MODEL_FOR_UNIVERSAL_SEGMENTATION_MAPPING_NAMES", "AutoModelForUniversalSegmentation"),
    "depth": ("MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES", "AutoModelForDepthEstimation"),
    "object-detection": ("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES", "AutoModelForObjectDetection"),
    "backbone": ("MODEL_FOR_BACKBONE_MAPPING_NAMES", "AutoBackbone"),
    "video-cls": ("MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForVideoClassification"),
    "zero-shot-image-cls": (
        "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForZeroShotImageClassification",
    ),
    "image-text-to-text": ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
    "audio-cls": ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification"),
    "audio-frame-cls": (
        "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForAudioFrameClassification",
    ),
    "audio-xvector": ("MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES", "AutoModelForAudioXVector"),
    "ctc": ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    "speech-seq2seq": ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    "time-series-prediction": (
        "MODEL_FOR_TIME_SERIES_PREDICTION_MAPPING_NAMES",
        "AutoModelForTimeSeriesPrediction",
    ),
}


def auto_class(task: str) -> Any:
    """The transformers Auto class for a head name (e.g. ``causal-lm`` -> AutoModelForCausalLM)."""
    if task not in HEADS:
        raise KeyError(f"unknown task {task!r}; known tasks: {', '.join(sorted(HEADS))}")
    import transformers
    from transformers.models.auto import modeling_auto

    name = HEADS[task][1]
    return getattr(modeling_auto, name, None) or getattr(transformers, name)


def head_mapping(task: str) -> dict[str, str]:
    """model_type -> model class name for one head, straight from transformers' registry."""
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, HEADS[task][0], {}))


def model_types() -> list[str]:
    """Every model type transformers knows (CONFIG_MAPPING is lazy, so read its names)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def candidates() -> list[tuple[str, str]]:
    """All (model_type, task) pairs that transformers registers, sorted."""
    known = set(model_types())
    out = []
    for task in HEADS:
        for mt in head_mapping(task):
            if mt in known:
                out.append((mt, task))
    return sorted(set(out))



def task_for_architecture(model_type: str, class_name: str) -> str | None:
    """The head a checkpoint was saved with (``architectures[0]`` in its config), e.g. GPT2LMHeadModel ->
    causal-lm; ``pretraining`` only when no more specific head has that class (it lists LM heads too)."""
    order = ["base"] + [t for t in HEADS if t not in ("base", "pretraining")] + ["pretraining"]
    for task in order:
        names = head_mapping(task).get(model_type)
        if names == class_name or (isinstance(names, (tuple, list)) and class_name in names):
            return task
    return None

"""A vision-language checkpoint's image encoder: its tensors taken out of the checkpoint's
stream as the text model loads, its weights, and the ``ImageEncoder`` an engine runs it with
(with the processor that prepares the images of its prompts)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jax_llm_runtime.models.registry import ModelSpec
from jax_llm_runtime.models.vision.encoder import VisionWeights
from jax_llm_runtime.runtime.engine.image_encoder import ImageEncoder
from jax_llm_runtime.runtime.multimodal.pixtral import mistral3_processor
from jax_llm_runtime.runtime.multimodal.processor import gemma3_processor
from jax_llm_runtime.runtime.multimodal.qwen_vl import qwen3_vl_processor

logger = logging.getLogger(__name__)

# The architectures whose images Qwen3-VL's processor prepares.
QWEN_VL_ARCHITECTURES = frozenset(
    (
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    )
)


@dataclass
class VisionTensors:
    """The encoder's tensors of a checkpoint, collected while the text model streams past."""

    spec: ModelSpec
    captured: dict[str, np.ndarray] = field(default_factory=dict)

    def text_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        assert self.spec.vision is not None
        return self.spec.vision.split_tensors(tensors, self.captured)


@dataclass(frozen=True)
class LoadedVision:
    """A loaded image encoder: its config and weights, and the model folder (for
    ``preprocessor_config.json``)."""

    config: Any
    weights: VisionWeights
    folder: Path | None


def load_vision(
    tensors: VisionTensors, hf_config: dict[str, Any], dtype: Any, folder: Path | None
) -> LoadedVision:
    """The encoder from the tensors collected (strict: ``models.vision.encoder.load_vision``)."""
    vision = tensors.spec.vision
    assert vision is not None
    config = vision.config_from_hf(hf_config)
    weights = vision.load(config, tensors.captured, dtype)
    tensors.captured.clear()
    if vision.pack is None:
        logger.info(
            "image encoder: %d x %d pixels to %d tokens per image",
            config.image_size,
            config.image_size,
            config.tokens_per_image,
        )
    else:
        logger.info("image encoder: images of any size, %d-pixel patches", config.patch_size)
    return LoadedVision(config, weights, folder)


def image_encoder(
    spec: ModelSpec, vision: LoadedVision, tokenizer: Any, max_images: int
) -> ImageEncoder:
    """The engine's encoder, with the processor of its prompts' images (the architecture's)."""
    assert spec.vision is not None

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def token_id(text: str) -> int:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer spells {text!r} as {len(ids)} tokens, not one")
        return ids[0]

    if spec.hf_architecture == "Mistral3ForConditionalGeneration":
        processor = mistral3_processor(vision.folder, vision.config, token_id, max_images)
    elif spec.hf_architecture in QWEN_VL_ARCHITECTURES:
        processor = qwen3_vl_processor(vision.folder, vision.config, token_id, max_images)
    else:
        processor = gemma3_processor(vision.folder, vision.config, token_text, max_images)
    return ImageEncoder(spec.vision, vision.config, vision.weights, processor)

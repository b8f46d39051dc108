"""A tiny random-weight Qwen3-VL checkpoint (``Qwen3VLForConditionalGeneration`` with a tiny
vision tower of two deepstack levels and a tiny Qwen3-VL text model with interleaved M-RoPE),
or Qwen3-VL-MoE's (``Qwen3VLMoeForConditionalGeneration``: the text model's feed-forward
blocks are four experts, top-2), or Qwen3.5's (``Qwen3_5ForConditionalGeneration``: the tower without deepstack levels, a tiny
hybrid text model whose full-attention layers turn half their features with M-RoPE),
saved with ``save_pretrained`` beside a byte-level tokenizer that knows Qwen's chat and vision
tokens, a chat template that renders image parts as
``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen's does, and the image processor's
``preprocessor_config.json``; and the HF reference inputs and outputs of its image encoder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
SPECIAL = (END_OF_TEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
END_OF_TEXT_ID, IM_START_ID, IM_END_ID, VISION_START_ID, VISION_END_ID = range(256, 261)
IMAGE_PAD_ID, VIDEO_PAD_ID = 261, 262
VOCAB_SIZE = 263  # the byte tokenizer: 256 bytes and the seven special tokens
PATCH_SIZE = 4
TEMPORAL = 2
MERGE = 2
DEEPSTACK = (0, 1)  # of 3 blocks: the last is no level
MIN_PIXELS = (PATCH_SIZE * MERGE) ** 2  # one merge window
MAX_PIXELS = 64 * 64
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hf_config(family: str = "qwen3_vl") -> Any:
    """The tiny config of ``family``: "qwen3_vl", "qwen3_vl_moe" or "qwen3_5"."""
    if family == "qwen3_5":
        return _qwen3_5_config()
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLMoeConfig,
        Qwen3VLMoeTextConfig,
        Qwen3VLTextConfig,
        Qwen3VLVisionConfig,
    )

    rope = {
        "rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }  # fmt: skip
    moe = family == "qwen3_vl_moe"
    text = (Qwen3VLMoeTextConfig if moe else Qwen3VLTextConfig)(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_parameters=rope, pad_token_id=END_OF_TEXT_ID,
        # The experts' stacks are [4, 96, 64] and [4, 64, 48]: no side equals another.
        **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48) if moe else {}),
    )  # fmt: skip
    vision = Qwen3VLVisionConfig(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, out_hidden_size=64,
        num_position_embeddings=16, deepstack_visual_indexes=list(DEEPSTACK),
    )  # fmt: skip
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text, vision_config=vision, image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = [
        "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    ]
    return config


def _qwen3_5_config() -> Any:
    from transformers import Qwen3_5Config

    rope = {
        "rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [1, 2, 1], "mrope_interleaved": True,
    }  # fmt: skip
    text = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
        rope_parameters=rope, pad_token_id=END_OF_TEXT_ID,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, out_hidden_size=64,
        num_position_embeddings=16,
    )  # fmt: skip
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def save_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab |= {token: 256 + i for i, token in enumerate(SPECIAL)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    hf = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=END_OF_TEXT)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)


def save_model(folder: Path, seed: int = 0, family: str = "qwen3_vl") -> Any:
    """The seeded float32 HF model of ``family`` saved in ``folder`` with the tokenizer and a
    ``preprocessor_config.json``; returns the HF model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family)
    model = getattr(transformers, config.architectures[0])(config).to(torch.float32).eval()
    with torch.no_grad():  # initial weights are small: make the images (and positions) matter
        for name, p in model.named_parameters():
            if "linear_attn" in name and name.endswith(("A_log", "dt_bias")):
                continue  # the gated delta rule's decay: kept as initialized (stable)
            if "norm" in name and name.endswith(".weight"):
                p.normal_(1.0, 0.2)
            elif "pos_embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD), "do_convert_rgb": True,
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
    }  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return model


def _processor(**overrides: Any) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "image_mean": list(IMAGE_MEAN), "image_std": list(IMAGE_STD),
    }  # fmt: skip
    return Qwen2VLImageProcessorPil(**(settings | overrides))


def resized(images: list[Any]) -> list[Any]:
    """The RGB images at the size HF's image processor resizes them to (a whole number of
    merge windows per side), so that the processor keeps them as they are."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    out = []
    for image in images:
        height, width = smart_resize(
            image.height, image.width, PATCH_SIZE * MERGE, MIN_PIXELS, MAX_PIXELS
        )
        out.append(image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC))
    return out


def hf_pixels(images: list[Any]) -> list[np.ndarray]:
    """transformers' rescaled and normalized pixels ``[3, height, width]`` of each image, not
    resized (the processor's patches of one pixel, one frame, read back as an image)."""
    out = _processor(do_resize=False, patch_size=1, temporal_patch_size=1, merge_size=1)(
        images, return_tensors="np"
    )
    ends = np.cumsum(out["image_grid_thw"].prod(-1))
    return [
        out["pixel_values"][end - t * h * w : end].reshape(h, w, 3).transpose(2, 0, 1)
        for (t, h, w), end in zip(out["image_grid_thw"], ends, strict=True)
    ]


def hf_patches(images: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' image processor's ``pixel_values`` ``[patches, features]`` of the images
    (all of them, one after another) and ``image_grid_thw`` ``[images, 3]``."""
    out = _processor()(images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def hf_encoder(
    model: Any, pixel_values: np.ndarray, grid_thw: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray]]:
    """HF's image tokens ``[tokens, text_hidden]`` and each deepstack level's."""
    import torch

    with torch.no_grad():
        out = model.model.visual(
            torch.from_numpy(pixel_values), grid_thw=torch.from_numpy(grid_thw)
        )
    return out.pooler_output.numpy(), [level.numpy() for level in out.deepstack_features]


def image_ids(grid_thw: Any) -> list[int]:
    """What ``Qwen3VLProcessor`` makes of the template's image: ``<|vision_start|>``, one
    ``<|image_pad|>`` per merged patch, ``<|vision_end|>``."""
    t, h, w = (int(v) for v in grid_thw)
    return [VISION_START_ID] + [IMAGE_PAD_ID] * (t * h * w // MERGE**2) + [VISION_END_ID]


def _hf_inputs(ids: list[int], images: list[Any]) -> dict[str, Any]:
    import torch

    input_ids = torch.tensor([ids])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if images:
        pixel_values, grid_thw = hf_patches(images)
        inputs |= {
            "pixel_values": torch.from_numpy(pixel_values),
            "image_grid_thw": torch.from_numpy(grid_thw),
            "mm_token_type_ids": (input_ids == IMAGE_PAD_ID).int(),
        }
    return inputs


def hf_logits(model: Any, ids: list[int], images: list[Any]) -> np.ndarray:
    """HF's last-position logits for a prompt with ``images`` (PIL, as ``resized`` gives)."""
    import torch

    model.model.rope_deltas = None
    with torch.no_grad():
        return model(**_hf_inputs(ids, images)).logits[0, -1].numpy()


def hf_greedy(model: Any, ids: list[int], images: list[Any], new_tokens: int) -> list[int]:
    """HF's greedy continuation of ``ids`` (EOS ignored) with ``images``."""
    import torch

    model.model.rope_deltas = None
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            **_hf_inputs(ids, images), max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=END_OF_TEXT_ID,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()

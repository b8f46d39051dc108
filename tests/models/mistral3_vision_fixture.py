"""A tiny random-weight Mistral 3 vision-language checkpoint (``Mistral3ForConditionalGeneration``
with a tiny Pixtral tower and a tiny Mistral text model), saved with ``save_pretrained`` beside a
byte-level tokenizer that knows the image tokens ``[IMG]``, ``[IMG_BREAK]`` and ``[IMG_END]``
and a chat template that renders image parts as ``[IMG]``, as Mistral's does; and the HF
reference inputs for a prompt with images of different sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.models.tiny_tokenizer import BOS, EOS

IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
IMG_ID, BREAK_ID, END_ID = 258, 259, 260
VOCAB_SIZE = 261  # the byte tokenizer: 256 bytes, BOS, EOS and the three image tokens
PATCH_SIZE = 4
MERGE = 2
LONGEST_EDGE = 40  # at most 5 x 5 merged patches

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}{{ '[IMG]' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}[model]{% endif %}"
)


def hf_config() -> Any:
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=None, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=256,
        eos_token_id=257, tie_word_embeddings=False,
    )  # fmt: skip
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=LONGEST_EDGE, patch_size=PATCH_SIZE, hidden_act="silu",
    )  # fmt: skip
    config = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=IMG_ID,
        spatial_merge_size=MERGE, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["Mistral3ForConditionalGeneration"]
    return config


def save_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))} | {BOS: 256, EOS: 257}
    vocab |= {IMG: IMG_ID, IMG_BREAK: BREAK_ID, IMG_END: END_ID}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(
        [AddedToken(t, special=True) for t in (BOS, EOS, IMG, IMG_BREAK, IMG_END)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)


def save_model(folder: Path, seed: int = 0) -> Any:
    """The seeded float32 HF model saved in ``folder`` with the tokenizer, a
    ``preprocessor_config.json`` and a ``processor_config.json``; returns the HF model."""
    import torch
    from transformers import Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(hf_config()).to(torch.float32).eval()
    with torch.no_grad():  # initial weights are small: make the images matter
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                if name.endswith("norm.weight") or "ln_pre" in name:
                    p.normal_(1.0, 0.2)
                else:
                    p.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    preprocessor = {
        "image_processor_type": "PixtralImageProcessor", "do_resize": True,
        "size": {"longest_edge": LONGEST_EDGE}, "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE},
        "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
    }  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    processor = {
        "processor_class": "PixtralProcessor", "image_token": IMG, "image_break_token": IMG_BREAK,
        "image_end_token": IMG_END, "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE,
    }  # fmt: skip
    (folder / "processor_config.json").write_text(json.dumps(processor))
    return model


def image_sequence(pixels: np.ndarray) -> list[int]:
    """What ``PixtralProcessor`` puts for an image of ``pixels`` ``[3, height, width]``: per
    row of merged patches, one ``[IMG]`` per column and ``[IMG_BREAK]``; ``[IMG_END]`` last."""
    rows, cols = (side // (PATCH_SIZE * MERGE) for side in pixels.shape[1:])
    ids = ([IMG_ID] * cols + [BREAK_ID]) * rows
    ids[-1] = END_ID
    return ids


def hf_pixels(images: list[Any]) -> list[np.ndarray]:
    """transformers' Pixtral image processor's pixels for each image (as ``PixtralProcessor``
    runs it for Mistral 3: patches of ``patch_size * spatial_merge_size``), unpadded."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    processor = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE},
        patch_size={"height": PATCH_SIZE * MERGE, "width": PATCH_SIZE * MERGE},
    )
    out = processor(images, return_tensors="np")
    return [
        np.asarray(pixels[:, :h, :w], np.float32)
        for pixels, (h, w) in zip(out["pixel_values"], out["image_sizes"], strict=True)
    ]


def _hf_images(pixels: list[np.ndarray]) -> dict[str, Any]:
    """HF's batched image inputs: pixels padded to the largest size, and each image's size."""
    import torch

    height = max(p.shape[1] for p in pixels)
    width = max(p.shape[2] for p in pixels)
    batch = np.zeros((len(pixels), 3, height, width), np.float32)
    for i, p in enumerate(pixels):
        batch[i, :, : p.shape[1], : p.shape[2]] = p
    sizes = torch.tensor([list(p.shape[1:]) for p in pixels])
    return {"pixel_values": torch.from_numpy(batch), "image_sizes": sizes}


def hf_soft_tokens(model: Any, pixels: list[np.ndarray]) -> list[np.ndarray]:
    """HF's soft tokens of each image."""
    import torch

    with torch.no_grad():
        out = model.model.get_image_features(**_hf_images(pixels)).pooler_output
    return [t.numpy() for t in out]


def hf_logits(model: Any, ids: list[int], pixels: list[np.ndarray]) -> np.ndarray:
    """HF's last-position logits for a prompt with images."""
    import torch

    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **_hf_images(pixels)
        )
    return out.logits[0, -1].numpy()


def hf_greedy(model: Any, ids: list[int], pixels: list[np.ndarray], new_tokens: int) -> list[int]:
    """HF's greedy continuation of ``ids`` (EOS ignored) with the images' ``pixels``."""
    import torch

    input_ids = torch.tensor([ids])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **_hf_images(pixels),
        )  # fmt: skip
    return out[0, len(ids) :].tolist()

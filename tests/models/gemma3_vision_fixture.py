"""A tiny random-weight Gemma 3 vision-language checkpoint (``Gemma3ForConditionalGeneration``
with a tiny SigLIP tower), saved with ``save_pretrained`` beside a byte-level tokenizer that
knows Gemma 3's image tokens and a chat template that renders image parts as
``<start_of_image>``, as Gemma 3's does; and the HF reference inputs for a prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.models.tiny_tokenizer import BOS, EOS

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOI_ID, EOI_ID, IMAGE_ID = 258, 259, 260
VOCAB_SIZE = 261  # the byte tokenizer: 256 bytes, BOS, EOS and the three image tokens
TOKENS_PER_IMAGE = 4
IMAGE_SIZE = 32

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}<model>{% endif %}"
)


def hf_config(sliding_window: int = 6) -> Any:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=sliding_window, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=256, eos_token_id=257,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=8, vision_use_head=False,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI_ID, eoi_token_index=EOI_ID, image_token_index=IMAGE_ID,
    )  # fmt: skip
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


def save_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))} | {BOS: 256, EOS: 257}
    vocab |= {BOI: BOI_ID, EOI: EOI_ID, IMAGE: IMAGE_ID}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in (BOS, EOS, BOI, EOI, IMAGE)])
    hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(folder)


def save_model(folder: Path, seed: int = 0, sliding_window: int = 6) -> Any:
    """The seeded float32 HF model saved in ``folder`` with the tokenizer and a
    ``preprocessor_config.json``; returns the HF model."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = hf_config(sliding_window)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # the projector's weights start at zero: make them matter
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder)
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": None, "do_pan_and_scan": None,
    }  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return model


def image_sequence() -> list[int]:
    """What ``Gemma3Processor`` puts for one image: ``\\n\\n<boi>`` soft tokens ``<eoi>\\n\\n``
    (the byte tokenizer spells each newline alone)."""
    nl = 10 + 188  # the byte-level alphabet's "\\n" ("Ċ") sorts here
    return [nl, nl, BOI_ID, *[IMAGE_ID] * TOKENS_PER_IMAGE, EOI_ID, nl, nl]


def random_images(count: int, seed: int = 0) -> list[Any]:
    """PIL images of odd sizes and modes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    shapes = [((37, 23), "RGB"), ((50, 61), "RGBA"), ((19, 33), "L"), ((40, 40), "P")]
    images = []
    for i in range(count):
        (w, h), mode = shapes[i % len(shapes)]
        channels = {"RGB": 3, "RGBA": 4}.get(mode)
        shape = (h, w, channels) if channels else (h, w)
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        images.append(Image.fromarray(pixels, mode if mode != "P" else "L").convert(mode))
    return images


def hf_pixels(images: list[Any]) -> np.ndarray:
    """transformers' Gemma 3 image processor's pixel values for ``images``."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, resample=2,
    )  # fmt: skip
    return np.asarray(processor(images, return_tensors="np")["pixel_values"], np.float32)


def hf_logits(model: Any, ids: list[int], pixels: np.ndarray) -> np.ndarray:
    """HF's last-position logits for a prompt with images (``token_type_ids`` marks them)."""
    import torch

    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            pixel_values=torch.from_numpy(pixels),
            token_type_ids=(input_ids == IMAGE_ID).long(),
            attention_mask=torch.ones_like(input_ids),
        )
    return out.logits[0, -1].numpy()


def hf_greedy(model: Any, ids: list[int], pixels: np.ndarray, new_tokens: int) -> list[int]:
    """HF's greedy continuation of ``ids`` (EOS ignored) with the images' ``pixels``."""
    import torch

    input_ids = torch.tensor([ids])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, pixel_values=torch.from_numpy(pixels),
            token_type_ids=(input_ids == IMAGE_ID).long(),
            attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()

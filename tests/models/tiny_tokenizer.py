"""A byte-level tokenizer small enough for the tiny random models (256 bytes + BOS + EOS), saved
the way an HF folder holds one, so tiny checkpoints can run through the whole engine."""

from __future__ import annotations

from pathlib import Path

BOS, EOS = "<s>", "</s>"
VOCAB_SIZE = 258


def save_byte_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))} | {BOS: 256, EOS: 257}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS)
    hf.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    hf.save_pretrained(folder)

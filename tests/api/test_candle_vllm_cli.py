"""candle-vllm's command lines under ``runtime-serve``: its flag spellings parse into the config
they mean there, and a flag that means nothing here costs exactly one warning line.

The command lines are those of candle-vllm's README (usage and model examples), with local
folders and files for its paths.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import requests

from jax_llm_runtime.api.cli.serve import _checked_flags, build_parser
from jax_llm_runtime.api.cli.service_flags import server_config
from jax_llm_runtime.api.protocol.bodies import ChatCompletionRequest
from jax_llm_runtime.api.protocol.defaults import with_sampling_defaults
from jax_llm_runtime.api.service.settings import SamplingDefaults, ServerConfig
from jax_llm_runtime.runtime.config import UNCHUNKED_PREFILL, EngineConfig
from jax_llm_runtime.runtime.engine.buckets import BucketPlan
from jax_llm_runtime.runtime.parallel.multihost import ClusterConfig
from tests.serve_process import REPO_ROOT, SERVING_LINE

WARNING = "runtime-serve: warning: "


@dataclass
class Parsed:
    args: argparse.Namespace
    engine: EngineConfig
    server: ServerConfig
    cluster: ClusterConfig
    warnings: list[str]  # the stderr lines


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A folder standing in for a model's weights, with a .gguf file in it."""
    folder = tmp_path / "Qwen3-30B-A3B-Instruct-2507"
    folder.mkdir()
    (folder / "Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf").write_bytes(b"GGUF")
    return folder


def parse(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Parsed:
    """``command`` (candle-vllm's, ``candle-vllm`` replaced) as ``runtime-serve`` reads it, up to
    the point where it would load the model."""
    for name in ("RUST_LOG", "KEEP_ALIVE_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    args = parser.parse_args(shlex.split(command))
    (engine,), cluster = _checked_flags(parser, args)
    captured = capsys.readouterr()
    assert captured.out == ""
    return Parsed(args, engine, server_config(args), cluster, captured.err.splitlines())


@pytest.mark.parametrize(
    "command",
    [
        "--m Qwen/Qwen3.6-27B-FP8 --ui-server",
        "--m zai-org/GLM-5.2-FP8 --ui-server",
        "--m Qwen/Qwen3.6-27B --isq q4k",
        "--m thesven/Llama-3-8B-GPTQ-4bit",
        "--m unsloth/Qwen3-30B-A3B-Instruct-2507-GGUF "
        "--f Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf --ui-server",
    ],
)
def test_model_examples_parse_without_warnings(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(command, capsys, monkeypatch)
    assert parsed.warnings == []
    assert parsed.engine.model_id == shlex.split(command)[1]


def test_ui_server_isq_and_repo_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(
        "--m unsloth/Qwen3.5-122B-A10B-GGUF --f Q3_K_S --d 0,1 --ui-server --isq q4k",
        capsys,
        monkeypatch,
    )
    assert parsed.engine.model_id == "unsloth/Qwen3.5-122B-A10B-GGUF"
    assert parsed.engine.weight_file == "Q3_K_S"
    assert parsed.engine.isq == "q4k"
    assert parsed.server.ui is not None


def test_w_names_the_weight_folder_and_d_sets_tensor_parallel(
    weights: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(f"--d 0,1 --w {weights}/", capsys, monkeypatch)
    assert parsed.engine.model_id == f"{weights}/"
    assert (parsed.engine.tensor_parallel_size, parsed.engine.devices) == (2, (0, 1))
    assert parsed.warnings == []


@pytest.mark.parametrize(
    ("command", "tp", "dp", "devices"),
    [
        ("--d 0,1,2,3,4,5,6,7", 8, 1, (0, 1, 2, 3, 4, 5, 6, 7)),
        ("--d 0", 1, 1, (0,)),
        ("--d 0,1,2,3 --dp 2", 2, 2, (0, 1, 2, 3)),
        ("--d 2,3 --tp 1 --dp 2", 1, 2, (2, 3)),  # an explicit --tp is kept
        ("", 1, 1, None),
    ],
)
def test_devices_without_tp_split_the_model_over_them(
    command: str,
    tp: int,
    dp: int,
    devices: tuple[int, ...] | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = parse(command, capsys, monkeypatch).engine
    assert (engine.tensor_parallel_size, engine.data_parallel_size, engine.devices) == (
        tp,
        dp,
        devices,
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_multi_node_master_flags(
    rank: int,
    weights: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = parse(
        f"--d 0,1,2,3,4,5,6,7 --w {weights}/ --num-nodes 2 --node-rank {rank} "
        "--master-addr 192.168.1.100 --master-port 29500",
        capsys,
        monkeypatch,
    )
    assert parsed.cluster == ClusterConfig(2, rank, "192.168.1.100:29500")
    # every host's eight devices: sixteen in all, JAX's first sixteen
    assert (parsed.engine.tensor_parallel_size, parsed.engine.devices) == (16, None)
    assert parsed.warnings == []


@pytest.mark.parametrize(
    ("command", "dtype"),
    [("--dtype bf16", "bfloat16"), ("--dtype f16", "float16"), ("--dtype f32", "float32")],
)
def test_short_dtype_names(
    command: str, dtype: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse(command, capsys, monkeypatch).engine.dtype == dtype


def test_f_alone_serves_that_gguf_file(
    weights: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = weights / "Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf"
    parsed = parse(f"--f {gguf} --ui-server", capsys, monkeypatch)
    assert (parsed.engine.model_id, parsed.engine.weight_file) == (str(gguf), None)


def test_w_with_f_picks_a_file_of_the_folder(
    weights: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(
        f"--w {weights} --f Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf", capsys, monkeypatch
    )
    assert (parsed.engine.model_id, parsed.engine.weight_file) == (
        str(weights),
        "Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf",
    )


def test_prefill_chunk_size_0_leaves_only_the_step_budget(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = parse("--prefill-chunk-size 0", capsys, monkeypatch).engine
    assert engine.prefill_chunk_size == UNCHUNKED_PREFILL
    budget = engine.batched_tokens("gpu", 40960)  # off CPU the budget follows the chunk
    seqs = engine.max_num_seqs
    plan = BucketPlan.build(seqs, 40960, engine.prefill_chunk_size, engine.page_size, budget)
    assert plan.max_chunk == 40960  # the largest prefill step: the whole context
    assert max(plan.prefill_lens) == 40960 + seqs  # with a decode token of every other sequence
    assert parse("--prefill-chunk-size 8192", capsys, monkeypatch).engine.prefill_chunk_size == 8192


def test_old_readme_program_params(
    weights: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(
        "--log --dtype bf16 --p 2000 --d 0,1 --mem 4096 --isq q4k --prefill-chunk-size 8192 "
        f"--penalty 1.1 --w {weights}",
        capsys,
        monkeypatch,
    )
    engine = parsed.engine
    assert (engine.dtype, engine.kvcache_mem_mb, engine.isq, engine.tensor_parallel_size) == (
        "bfloat16",
        4096,
        "q4k",
        2,
    )
    assert parsed.args.port == 2000
    assert parsed.args.log == ""  # bare --log: logs stay on stderr
    assert parsed.server.sampling_defaults.repetition_penalty == 1.1
    assert parsed.warnings == []


def test_kv_cache_aliases(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse("--m x --kvcache-mem-gpu 8192 --block-size 32", capsys, monkeypatch)
    assert (parsed.engine.kvcache_mem_mb, parsed.engine.page_size) == (8192, 32)
    parsed = parse("--m x --kvcache-dtype fp8 --disable-prefix-cache --cpu", capsys, monkeypatch)
    assert (parsed.engine.kv_cache_dtype, parsed.engine.prefix_cache) == ("fp8", False)
    assert parsed.args.device == "cpu"
    assert parsed.warnings == []


@pytest.mark.parametrize(
    ("command", "host", "port"),
    [
        ("--h 127.0.0.1 --p 8000", "127.0.0.1", 8000),
        ("--h 127.0.0.1:8000", "127.0.0.1", 8000),
        ("--h '[::1]:8000'", "::1", 8000),
        ("--h tcp://0.0.0.0:8001 --p 9", "0.0.0.0", 8001),  # the port in --h wins, as there
        ("--h ::1 --p 8002", "::1", 8002),
    ],
)
def test_bind_addresses(
    command: str,
    host: str,
    port: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = parse(f"{command} --m Qwen/Qwen3.6-27B-FP8", capsys, monkeypatch).args
    assert (args.host, args.port) == (host, port)


@pytest.mark.parametrize(
    "command",
    [
        "--h unix://{tmp}/candle-vllm.sock",  # candle-vllm's README
        "--h file://{tmp}/candle-vllm.sock",
        "--h socket://{tmp}/candle-vllm.sock",
        "--host unix://{tmp}/candle-vllm.sock --port 2000",  # the default port: no warning
    ],
)
def test_unix_socket_addresses(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = parse(f"{command.format(tmp=tmp_path)} --m x", capsys, monkeypatch)
    assert parsed.args.uds == f"{tmp_path}/candle-vllm.sock"
    assert parsed.warnings == []


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("--multithread --d 0,1 --w {weights}", "--multithread"),
        ("--m x --yarn-scaling-factor 4.0 --ui-server", "--yarn-scaling-factor"),
        ("--m x --kv-fraction 0.6", "--kv-fraction"),
        ("--m x --kvcache-mem-cpu 128", "--kvcache-mem-cpu"),
        ("--m x --kvcache-mem-cpu 0", "--kvcache-mem-cpu"),
        ("--m x --prefix-cache-max-tokens 4096", "--prefix-cache-max-tokens"),
        ("--m x --disable-cuda-graph", "--disable-cuda-graph"),
        ("--w {weights} --kvcache-dtype turbo4", "--kvcache-dtype turbo4"),
    ],
)
def test_a_flag_without_meaning_here_is_one_warning_line(
    command: str,
    flag: str,
    weights: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed = parse(command.format(weights=weights), capsys, monkeypatch)
    (line,) = parsed.warnings
    assert line.startswith(f"{WARNING}{flag} ")
    assert ": " in line.removeprefix(f"{WARNING}{flag} ")  # says why


def test_turbo_kv_caches_are_served_as_fp8(
    weights: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for mode in ("turbo8", "turbo4", "turbo3"):
        parsed = parse(f"--w {weights}/ --kvcache-dtype {mode}", capsys, monkeypatch)
        assert parsed.engine.kv_cache_dtype == "fp8"


def test_each_ignored_flag_warns_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(
        "--log --dtype bf16 --p 2000 --d 0,1 --kv-fraction 0.6 --isq q4k "
        "--prefill-chunk-size 8192 --frequency-penalty 1.1 --presence-penalty 1.1 "
        "--enforce-parser qwen_coder --yarn-scaling-factor 4.0 --m Qwen/Qwen3.6-27B-FP8 "
        "--kvcache-dtype fp8 --ui-server",
        capsys,
        monkeypatch,
    )
    assert [line.split(" ")[2] for line in parsed.warnings] == [
        "--kv-fraction",
        "--yarn-scaling-factor",
    ]
    defaults = parsed.server.sampling_defaults
    assert (defaults.frequency_penalty, defaults.presence_penalty) == (1.1, 1.1)
    assert parsed.engine.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("parser", "ours"),
    [("qwen", "hermes"), ("json", "json"), ("mistral", "mistral"), ("qwen_coder", "qwen3_coder")],
)
def test_enforce_parser_picks_our_tool_parser(
    parser: str, ours: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(f"--m x --enforce-parser {parser}", capsys, monkeypatch)
    assert parsed.server.tool_parser == ours
    assert parsed.warnings == []


@pytest.mark.parametrize("flag", ["--tool-parser", "--tool-call-parser"])
@pytest.mark.parametrize("name", ["qwen3_coder", "glm45", "minimax_m2", "gemma4", "openai"])
def test_tool_parser_takes_vllm_names_and_spelling(
    flag: str, name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse(f"--m x {flag} {name}", capsys, monkeypatch)
    assert parsed.server.tool_parser == name


def _chat(body: dict[str, object]) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def test_penalty_repeat_last_n_and_thinking_become_request_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed = parse("--m x --penalty 1.1 --repeat-last-n 64 --thinking", capsys, monkeypatch)
    defaults = parsed.server.sampling_defaults
    filled = with_sampling_defaults(_chat({}), defaults)
    assert (filled.repetition_penalty, filled.repeat_last_n, filled.enable_thinking) == (
        1.1,
        64,
        True,
    )
    # a request's own values win
    own = with_sampling_defaults(_chat({"repetition_penalty": 1.3, "repeat_last_n": 8}), defaults)
    assert (own.repetition_penalty, own.repeat_last_n) == (1.3, 8)
    # a request that decides thinking in another spelling is left alone (no contradiction)
    for body in ({"thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        assert with_sampling_defaults(_chat(body), defaults).enable_thinking is None
    off = parse("--m x --thinking false", capsys, monkeypatch).server.sampling_defaults
    assert off.enable_thinking is False
    assert parse("--m x", capsys, monkeypatch).server.sampling_defaults == SamplingDefaults()


@pytest.mark.parametrize(
    ("rust_log", "level"),
    [("info", "info"), ("warn", "warn"), ("candle_vllm=debug", "debug"), ("hyper", "info")],
)
def test_rust_log_sets_the_log_level(
    rust_log: str, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUST_LOG", rust_log)
    assert build_parser().parse_args([]).log_level == level
    assert build_parser().parse_args(["--log-level", "ERROR"]).log_level == "error"


def test_candle_vllm_environment_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RUNTIME_MODELS_CONFIG", "RUNTIME_MCP_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CANDLE_VLLM_MODELS_CONFIG", "candle-models.yaml")
    monkeypatch.setenv("CANDLE_VLLM_MCP_CONFIG", "candle-mcp.json")
    args = build_parser().parse_args([])
    assert (args.models_config, args.mcp_config) == ("candle-models.yaml", "candle-mcp.json")
    monkeypatch.setenv("RUNTIME_MODELS_CONFIG", "ours.yaml")
    monkeypatch.setenv("RUNTIME_MCP_CONFIG", "ours.json")
    args = build_parser().parse_args([])
    assert (args.models_config, args.mcp_config) == ("ours.yaml", "ours.json")


def test_keep_alive_interval_is_one_warning_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = build_parser()
    args = parser.parse_args(["--m", "x"])
    monkeypatch.setenv("KEEP_ALIVE_INTERVAL", "100")
    _checked_flags(parser, args)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{WARNING}$KEEP_ALIVE_INTERVAL ignored: ")


@pytest.mark.parametrize(
    ("command", "needle"),
    [
        ("--dtype bf8", "--dtype"),
        ("--f /no/such/model.gguf", "--weight-file /no/such/model.gguf"),
        ("--f model.safetensors", "--weight-file"),
        ("--d 0,1,2 --dp 2", "--data-parallel-size"),
        ("--h unix:///no/such/folder/candle-vllm.sock --m x", "does not exist"),
        ("--h 127.0.0.1:99999 --m x", "--host"),
        ("--log-level loud", "--log-level"),
        ("--thinking maybe", "--thinking"),
        ("--penalty 0", "repetition_penalty"),
        ("--repeat-last-n 5000", "repeat_last_n"),
        ("--prefill-chunk-size -1", "--prefill-chunk-size"),
        ("--prefill-chunk-size 8", "prefill_chunk_size"),
        ("--kvcache-dtype turbo2", "--kv-cache-dtype"),
        ("--num-nodes 2 --master-port 29500", "--master-port"),
        ("--num-nodes 2 --d 1,2 --master-addr h", "0,1,..."),
    ],
)
def test_bad_values_are_one_error_line_and_exit_2(
    command: str, needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEEP_ALIVE_INTERVAL", raising=False)
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        _checked_flags(parser, parser.parse_args(shlex.split(command)))
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("runtime-serve: error: ") and needle in line, line


@pytest.mark.e2e
def test_a_candle_vllm_command_line_serves_after_one_warning(tmp_path: Path) -> None:
    # `python -m api.cli.serve`, as run_cli: this tree's code whatever runtime-serve script is installed
    command = [
        sys.executable,
        "-m",
        "jax_llm_runtime.api.cli.serve",
        "--p",
        "0",
        "--multithread",
        "--dtype",
        "bf16",
    ]
    command += ["--log", "--log-level", "warn", "--mock-engine"]
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = SERVING_LINE.search(first)
        assert match, f"unexpected first line {first!r}; log:\n{log.read_text()}"
        models = requests.get(f"{match['url']}/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [match["model"]]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    lines = log.read_text().splitlines()
    warnings = [line for line in lines if line.startswith(WARNING)]
    assert len(warnings) == 1 and warnings[0].startswith(f"{WARNING}--multithread ignored: ")
    assert lines[0] == warnings[0]

"""Compiles stop short of the kernel's limit on memory maps (``vm.max_map_count``): at the limit
XLA:CPU's next compile dies with SIGSEGV, so the process refuses the compile instead, warns
once on the way there, and the background compile stops while the server goes on."""

from __future__ import annotations

import logging
import threading

import jax
import jax.numpy as jnp
import pytest

from jax_llm_runtime.runtime.engine import compiled_shapes
from jax_llm_runtime.runtime.engine.compiled_shapes import CompiledShapes, MapLimitError


def _shapes() -> CompiledShapes:
    fn = jax.jit(lambda x: x * 2)
    return CompiledShapes("test step", lambda n: fn.lower(jnp.ones((n,), jnp.float32)))


@pytest.fixture
def maps_held(monkeypatch):
    """Set how many memory maps the process appears to hold, of a limit of 1,000."""
    held = {"n": 10}
    monkeypatch.setattr(compiled_shapes, "memory_maps", lambda: (held["n"], 1000))
    monkeypatch.setattr(compiled_shapes, "_warned", threading.Event())
    return held


def test_this_machine_reports_its_maps_and_limit() -> None:
    maps = compiled_shapes.memory_maps()
    assert maps is not None, "Linux exposes /proc/self/maps and vm.max_map_count"
    held, limit = maps
    assert 0 < held < limit


def test_a_compile_near_the_limit_is_refused_with_the_remedy(maps_held) -> None:
    shapes = _shapes()
    assert shapes.get(4)(jnp.ones((4,))).tolist() == [2.0] * 4
    maps_held["n"] = 950
    with pytest.raises(MapLimitError, match=r"vm.max_map_count=262144.*--max-num-seqs"):
        shapes.get(8)
    assert 8 not in shapes and 4 in shapes  # what was compiled stays usable
    assert shapes.get(4)(jnp.ones((4,))).tolist() == [2.0] * 4


def test_the_log_warns_once_past_half_the_limit(maps_held, caplog) -> None:
    shapes = _shapes()
    maps_held["n"] = 600
    with caplog.at_level(logging.WARNING, logger=compiled_shapes.__name__):
        shapes.get(4)
        shapes.get(5)
    warnings = [r for r in caplog.records if "max_map_count" in r.getMessage()]
    assert len(warnings) == 1
    assert "600 memory maps" in warnings[0].getMessage()


def test_the_background_compile_stops_at_the_limit_and_keeps_what_it_has(
    maps_held, monkeypatch, caplog
) -> None:
    shapes = _shapes()
    held_after = iter([10, 10, 950, 950])
    monkeypatch.setattr(compiled_shapes, "memory_maps", lambda: (next(held_after), 1000))
    with caplog.at_level(logging.ERROR, logger=compiled_shapes.__name__):
        count = shapes.compile_each([1, 2, 3, 4], threading.Event())
    assert count == 2
    assert 1 in shapes and 2 in shapes and 3 not in shapes and 4 not in shapes
    assert any("compile on first use" in r.getMessage() for r in caplog.records)

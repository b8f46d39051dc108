"""Chat templates: untrusted jinja2 rendered in the immutable sandbox, bounded in time and size.

The environment matches what HF ``transformers`` gives templates (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``{% generation %}``, a ``tojson`` that does not escape HTML,
``raise_exception``, ``strftime_now``, ``tools``/``documents`` defaulting to None), so a template
renders to the same string here as with ``AutoTokenizer.apply_chat_template(..., tokenize=False)``.

Bounds, because templates ship inside model files and are untrusted:

- time: a watchdog raises into the rendering thread once ``MAX_RENDER_SECONDS`` have passed, which
  stops loops that produce no output (``for`` nested over ``range``) as well as slow ones;
- size: output is streamed with ``generate()`` and cut at ``MAX_OUTPUT_CHARS``; arguments and
  results of every call and filter, namespace values, ``*`` repetition and ``**`` are checked too,
  so a template cannot build a huge string in one step before the output check sees it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_OUTPUT_CHARS = 1_000_000
MAX_RENDER_SECONDS = 2.0
_MAX_POWER_BITS = 4096
# A printf or str.format spec with a 7-digit width or precision ("%999999999s", "{:>9999999}").
_HUGE_FORMAT_SPEC = re.compile(r"(%|\{[^{}]*:)[^a-zA-Z{}%]*\d{7}")


class ChatTemplateError(ValueError):
    """The template is missing, invalid, raised an error, or exceeded its time or size bounds."""


class _RenderTimeout(Exception):
    """Raised asynchronously into the rendering thread by the watchdog."""


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"chat template {what} exceeds {MAX_OUTPUT_CHARS} items")
    return value


def _check_args(args: Iterable[Any], what: str) -> None:
    for arg in args:
        # Ints that large only serve as widths or counts that would allocate that much.
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template {what} got an argument too large: {arg}")
        _check_size(arg, what)


def _check_format(template: Any) -> None:
    if isinstance(template, str) and _HUGE_FORMAT_SPEC.search(template):
        raise ChatTemplateError("chat template format width or precision is too large")


def _guard_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment markers
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_args([*args, *kwargs.values()], f"filter {name!r}")
        if name == "format" and args:
            _check_format(args[0])
        return _check_size(fn(*args, **kwargs), f"filter {name!r}")

    return guarded


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja renders an unsafe attribute (``''.__class__``) as an empty undefined; a template
        # that reaches for one is hostile or broken, so say so.
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed"
        )

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        _check_format(getattr(value, "__self__", None))
        return super().wrap_str_format(value)

    # Every call in sandboxed template code (functions, methods, macros) comes through here.
    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_args([*args, *kwargs.values()], "call")
        return _check_size(super().call(__context, __obj, *args, **kwargs), "call result")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%":
            _check_format(left)
            _check_args(right if isinstance(right, tuple) else [right], "% operator")
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and abs(left).bit_length() * right > _MAX_POWER_BITS:
            raise ChatTemplateError("chat template power operation is too large")
        for seq, count in ((left, right), (right, left)):
            sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
            if operator == "*" and sized and len(seq) * count > MAX_OUTPUT_CHARS:
                raise ChatTemplateError("chat template repetition is too large")
        return super().call_binop(context, operator, left, right)


class _TemplateNamespace(Namespace):
    """``namespace()`` that rejects dunder names (no CPython internals) and oversized values."""

    # No named self: like jinja's Namespace, so that namespace(self=...) still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name, value in attrs.items():
            _TemplateNamespace._check(name, value)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name, value)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
        _check_size(value, "namespace value")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for HF training masks;
    for inference it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, > and & for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    # A plain function, not the dict type itself, so templates cannot reach type attributes.
    return dict(*args, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    del env.globals["lipsum"]  # generates text in bulk and no chat template needs it
    env.globals.update(
        dict=_template_dict,
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=_TemplateNamespace,
    )
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error (line {e.lineno}): {e}") from e


def _plain(value: Any) -> Any:
    """Deep-copy into plain JSON types so the sandbox only ever sees str/int/float/bool/None."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ChatTemplateError(f"chat template inputs must be JSON values, got {type(value).__name__}")


def render_chat_template(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` (a list of {role, content, ...}) with a model's chat template.

    ``kwargs`` become template variables (``tools``, ``documents``, ``enable_thinking``, other
    special tokens). The result already holds the template's special tokens (often a BOS), so
    encode it with ``add_special_tokens=False``. Raises ChatTemplateError for a missing template,
    a template error (including ``raise_exception``), or a render over the time or size bounds.
    """
    if not template:
        raise ChatTemplateError("model has no chat template; use /v1/completions")
    compiled = _compile(template)
    context = {"tools": None, "documents": None, **_plain(kwargs)}
    context.update(
        messages=_plain(messages),
        add_generation_prompt=bool(add_generation_prompt),
        bos_token=bos_token,
        eos_token=eos_token,
    )
    try:
        return _with_deadline(lambda: _render_bounded(compiled, context), MAX_RENDER_SECONDS)
    except _RenderTimeout:
        raise ChatTemplateError(
            f"chat template took longer than {MAX_RENDER_SECONDS:g}s to render"
        ) from None
    except (jinja2.exceptions.TemplateError, ArithmeticError, LookupError, TypeError) as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (AttributeError, RecursionError, MemoryError) as e:
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e


def _render_bounded(compiled: jinja2.Template, context: dict[str, Any]) -> str:
    chunks, size = [], 0
    for chunk in compiled.generate(**context):
        size += len(chunk)
        if size > MAX_OUTPUT_CHARS:
            raise ChatTemplateError(f"chat template output exceeds {MAX_OUTPUT_CHARS} characters")
        chunks.append(chunk)
    return "".join(chunks)


def _with_deadline(fn: Callable[[], str], seconds: float) -> str:
    """Run ``fn`` in this thread; if it is still running after ``seconds``, raise _RenderTimeout
    inside it (at its next bytecode), which also interrupts loops that never call back to us."""
    thread_id = ctypes.c_ulong(threading.get_ident())
    lock, state = threading.Lock(), {"running": True, "fired": False}

    def fire() -> None:
        with lock:
            if state["running"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    thread_id, ctypes.py_object(_RenderTimeout)
                )

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        return fn()
    except Exception:
        # The timeout can surface wrapped: jinja's traceback rewriting may fail on the frame it
        # interrupted and raise a TypeError instead.
        if state["fired"]:
            raise _RenderTimeout from None
        raise
    finally:
        timer.cancel()
        with lock:
            state["running"] = False
            if state["fired"]:
                # fn may have returned just before the exception was delivered; drop it so it
                # cannot surface later in unrelated code.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(thread_id, None)

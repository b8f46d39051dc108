"""Chat template rendering: HF-compatible environment, sandboxing, and time/size bounds."""

from __future__ import annotations

import time

import pytest

from jax_llm_runtime.runtime.text import chat_template
from jax_llm_runtime.runtime.text.chat_template import ChatTemplateError, render_chat_template

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'"
    " }}{% endif %}"
)
USER = [{"role": "user", "content": "Hi <b>&"}]


def render(template: str, messages: list | None = None, **kwargs: object) -> str:
    return render_chat_template(template, messages or USER, True, "<s>", "</s>", **kwargs)


def test_chatml() -> None:
    assert render(CHATML) == "<|im_start|>user\nHi <b>&<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = render_chat_template(CHATML, USER, False, None, None)
    assert no_prompt == "<|im_start|>user\nHi <b>&<|im_end|>\n"


def test_hf_environment_features() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "  {% if loop.last %}{% break %}{% endif %}\n"
        "{% endfor %}{{ tools is none }}{{ documents is none }}{{ eos_token }}{{ extra }}"
    )
    out = render(template, extra="!")
    # tojson does not HTML-escape; trim_blocks/lstrip_blocks drop the layout whitespace.
    assert out == '<s>{"role": "user", "content": "Hi <b>&"}TrueTrue</s>!'
    ns = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert render(ns, USER * 3) == "3"
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert (
        render("{{ '%05d|%s' % (42, 'a') }}{{ '{:>4}'.format('b') }}{{ dict(a=1).a }}")
        == "00042|a   b1"
    )


def test_raise_exception_becomes_chat_template_error() -> None:
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="System first!"):
        render(template)


def test_missing_template() -> None:
    with pytest.raises(ChatTemplateError, match="use /v1/completions"):
        render_chat_template(None, USER, True, None, None)


def test_syntax_error() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render("{% for %}")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ namespace(_x=1) }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_blocks_escapes(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render(template)


def test_attribute_escape_names_the_attribute() -> None:
    with pytest.raises(ChatTemplateError, match="'__class__' of 'str' is not allowed"):
        render("{{ ''.__class__ }}")
    # Missing ordinary attributes stay lenient, as with HF: templates test optional fields.
    assert render("{{ messages[0].tool_calls is defined }}{{ messages[0].nope }}") == "False"


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for a in messages %}{% for b in range(100000) %}{% for c in range(100000) %}"
        "{% if c == -1 %}x{% endif %}{% endfor %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% for i in range(100000) %}{{ f(n) if i < 0 }}{% endfor %}{% endmacro %}"
        "{% for i in range(100000) %}{{ f(i) }}{% endfor %}",
    ],
)
def test_huge_loops_time_out(template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than"):
        render(template)
    assert time.monotonic() - start < 2.0
    # The watchdog leaves nothing pending behind: later rendering in this thread works.
    assert render(CHATML).startswith("<|im_start|>user")


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}",
        "{{ 'x' * 10000000 }}",
        "{{ 'x' | center(100000000) }}",
        "{{ 'x'.ljust(100000000) }}",
        "{{ 10 ** 100000000 }}",
        "{% set ns = namespace(s='x' * 999999) %}{% set ns.s = ns.s ~ ns.s %}",
        "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
        "{{ '%999999999s' % 'x' }}",
        "{{ '%.9999999f' % 1.5 }}",
        "{{ '%*s' % (999999999, 'x') }}",
        "{{ '%s' | format('x') ~ '%0999999999d' | format(1) }}",
        "{{ '{:>999999999}'.format('x') }}",
        "{{ '{0:{1}}'.format('x', 999999999) }}",
        "{{ lipsum(999999) }}",
    ],
)
def test_oversized_output_or_values_error(template: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        render(template)
    assert time.monotonic() - start < 2.0


def test_recursion_errors_cleanly() -> None:
    with pytest.raises(ChatTemplateError):
        render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")


def test_inputs_must_be_json_values() -> None:
    with pytest.raises(ChatTemplateError, match="JSON values"):
        render(CHATML, [{"role": "user", "content": object()}])


def test_fast_render_is_not_disturbed_by_the_watchdog() -> None:
    for _ in range(200):
        assert render(CHATML).endswith("assistant\n")

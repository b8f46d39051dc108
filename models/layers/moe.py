"""Mixture-of-experts feed-forward block: route each token to ``top_k`` gated-MLP experts.

One config covers the routers of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3:

1. Router logits ``x @ router`` in float32, turned into scores by softmax or sigmoid. With
   ``router_norm`` (Gemma 4) x is first RMS-normed, scaled per feature by ``router_scale`` and
   by hidden ** -0.5; the router may also read other inputs than the experts (``router_x``).
2. Expert choice: ``top_k`` of the scores plus an optional per-expert bias (DeepSeek-V3's
   ``e_score_correction_bias``), optionally restricted to the ``topk_groups`` best expert groups.
3. Expert weights: the *uncorrected* scores of the chosen experts, optionally renormalised to sum
   to one, then multiplied by ``routed_scaling_factor`` (and with ``expert_scale``, Gemma 4, by
   the chosen expert's learned ``expert_scale``).
4. Output: the weighted sum of the chosen experts' gated MLPs, plus an optional shared expert
   (optionally scaled by ``sigmoid(x @ s_router)``, Qwen2-MoE). With ``weighted_inputs``
   (Llama 4) the weight scales each chosen expert's input instead, and the outputs are summed.

gpt-oss adds a bias to the router logits (``router_b``: it shifts the choice and the weights),
biases to every expert projection (``e_gate_b``, ``e_up_b``, ``e_down_b``) and a clamped
SwiGLU (``swiglu_clamp``); its softmax over the chosen logits is softmax scoring renormalised
over the chosen experts (``norm_topk_prob``), the same numbers.

``MoE`` declares a layer's weights and computes the block; ``moe_mlp`` is the same with the
weights given by field name. Matrices are stored ``[in, out]``:
``router`` [hidden, num_experts], ``router_bias`` [num_experts] (with ``has_router_bias``),
``e_gate``/``e_up`` [num_experts, hidden, expert_inter], ``e_down`` [num_experts, expert_inter,
hidden] (``ExpertLinear`` modules), and with a shared expert ``s_gate``/``s_up`` [hidden,
shared_inter], ``s_down`` [shared_inter, hidden], ``s_router`` [hidden, 1] (with
``shared_gate``; ``Linear`` modules).

How the experts are computed. Shapes are static under jit, so the token count ``T`` is known at
trace time and picks one of two mechanisms; both are exact (no capacity limit, no dropped
tokens) and agree to float rounding:

* ``T * top_k <= num_experts`` (decode, small batches): every (token, slot) gathers its expert's
  weights and runs a batched mat-vec. The gathered volume is at most one copy of the layer's
  expert weights, so a decode step reads only the experts it uses rather than all of them.
* otherwise (prefill, big batches): the (token, slot) rows are sorted by expert and run through
  ``jax.lax.ragged_dot``, a grouped matmul over contiguous per-expert row blocks, so each row
  meets only its own expert. TPU lowers it to a native grouped matmul. JAX on CPU (and XLA on
  GPU where it has no grouped kernel for the dtype) expands it into a masked dense dot over all
  experts: correct, but ``num_experts`` times the needed flops; GPU speed is unmeasured.
  Gathering weights per row instead would copy ``T * top_k`` expert matrices, which prefill
  cannot afford.

With ``MoEConfig.offload`` some experts live in host memory (``models.layers.expert_offload``):
the layer's weights then hold a resident stack and an offloaded one (``e_gate_host``, ...). The
resident experts run as above; the offloaded stack is copied to device memory and run the same
way only when a valid token chose one of its experts, and each slot takes its own stack's output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jax_llm_runtime.models.layers.expert_offload import HOST_SUFFIX, ExpertOffload
from jax_llm_runtime.models.layers.linear import (
    ExpertLinear,
    Linear,
    QuantizedWeight,
    expert_projection,
    projection,
)
from jax_llm_runtime.models.layers.norms import NormConfig, apply_norm
from jax_llm_runtime.models.layers.params import (
    EMBED,
    EXPERT_MLP,
    FFN,
    ROUTER,
    Block,
    declare,
    layer_axes,
    params,
    shapes,
)
from jax_llm_runtime.pallas_kernels.dequant_matmul import PackedLayer, PackedWeight

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": partial(jax.nn.gelu, approximate=True),
}
# Router logits -> per-expert scores, over the expert axis.
_SCORINGS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "softmax": partial(jax.nn.softmax, axis=-1),
    "sigmoid": jax.nn.sigmoid,
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    scoring: str = "softmax"  # "softmax" | "sigmoid": router logits -> per-expert scores
    norm_topk_prob: bool = False  # renormalise the chosen experts' scores to sum to one
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    # Grouped selection (DeepSeek): keep the ``topk_groups`` of ``num_groups`` equal expert groups
    # whose best ``group_score_topn`` scores sum highest, then pick top_k inside them.
    num_groups: int | None = None
    topk_groups: int | None = None
    group_score_topn: int = 1
    has_router_bias: bool = False  # ``router_bias`` shifts the choice, never the weights
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # scale the shared expert by sigmoid(x @ s_router)
    weighted_inputs: bool = False  # experts see their token times its weight (Llama 4)
    router_norm: NormConfig | None = None  # RMS norm (and ``router_scale``) of router inputs
    expert_scale: bool = False  # each chosen expert's weight times its ``expert_scale``
    activation: str = "silu"
    offload: ExpertOffload | None = None  # experts kept in host memory (a runtime choice)
    router_logit_bias: bool = False  # ``router_b`` added to the router logits (gpt-oss)
    expert_bias: bool = False  # a bias on every routed expert projection (gpt-oss)
    # (alpha, limit): the experts compute (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
    # with g = min(gate, limit) instead of act(gate) * up (gpt-oss)
    swiglu_clamp: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) cannot exceed num_experts ({self.num_experts})")
        if self.scoring not in _SCORINGS:
            raise ValueError(f"scoring must be one of {sorted(_SCORINGS)}, got {self.scoring!r}")
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(
                f"routed_scaling_factor must be a positive number, got {self.routed_scaling_factor}"
            )
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {self.activation!r}"
            )
        if self.shared_intermediate_size < 0:
            raise ValueError(
                f"shared_intermediate_size must be >= 0 (0 = no shared expert), "
                f"got {self.shared_intermediate_size}"
            )
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("shared_gate needs a shared expert: set shared_intermediate_size")
        self._check_groups()
        if self.swiglu_clamp is not None and not all(v > 0 for v in self.swiglu_clamp):
            raise ValueError(f"swiglu_clamp (alpha, limit) must be > 0, got {self.swiglu_clamp}")
        if self.offload is not None:
            if self.expert_bias:
                raise ValueError("expert offloading does not support expert biases (gpt-oss)")
            self.offload.check(self.num_experts)

    def _check_groups(self) -> None:
        if (self.num_groups is None) != (self.topk_groups is None):
            raise ValueError("set num_groups and topk_groups together, or neither")
        if self.num_groups is None or self.topk_groups is None:
            return
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"num_groups ({self.num_groups}) must be >= 1 and divide "
                f"num_experts ({self.num_experts})"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_groups ({self.topk_groups}) must be in [1, num_groups={self.num_groups}]"
            )
        per_group = self.num_experts // self.num_groups
        if not 1 <= self.group_score_topn <= per_group:
            raise ValueError(
                f"group_score_topn ({self.group_score_topn}) must be in [1, experts per group "
                f"= {per_group}]"
            )
        if self.top_k > self.topk_groups * per_group:
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the {self.topk_groups * per_group} experts in "
                f"the kept groups; raise topk_groups"
            )


def moe_weight_shapes(cfg: MoEConfig, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Every weight of one MoE layer as a checkpoint gives it, with its shape (``[in, out]`` for
    matrices): ``MoE``'s declarations without offloading; ``layer_weight_shapes`` says how
    offloading cuts the expert stacks."""
    return shapes(MoE(dataclasses.replace(cfg, offload=None), (), hidden_size, jnp.float32))


def route(
    cfg: MoEConfig,
    x: jax.Array,  # [num_tokens, hidden]
    router: jax.Array,  # [hidden, num_experts]
    router_bias: jax.Array | None = None,  # [num_experts]; used only to choose experts
    logit_bias: jax.Array | None = None,  # [num_experts]; added to the logits
) -> tuple[jax.Array, jax.Array]:
    """The chosen experts and their weights, both ``[num_tokens, top_k]``.

    Returns ``(experts int32, weights float32)``; slots come in no particular order.
    """
    logits = jnp.einsum(
        "th,he->te", x.astype(jnp.float32), router.astype(jnp.float32)
    )  # [num_tokens, num_experts]
    if logit_bias is not None:
        logits = logits + logit_bias.astype(jnp.float32)
    scores = _SCORINGS[cfg.scoring](logits)
    choice = scores if router_bias is None else scores + router_bias.astype(jnp.float32)
    if cfg.num_groups is not None:
        choice = jnp.where(_kept_groups(cfg, choice), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.top_k)  # [num_tokens, top_k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        # The tiny floor only matters for sigmoid scores that all underflow to zero.
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor


def _kept_groups(
    cfg: MoEConfig,
    choice: jax.Array,  # [num_tokens, num_experts] float32
) -> jax.Array:  # [num_tokens, num_experts] bool: expert lies in one of the kept groups
    assert cfg.num_groups is not None and cfg.topk_groups is not None
    num_tokens = choice.shape[0]
    grouped = choice.reshape(num_tokens, cfg.num_groups, -1)
    group_scores = jax.lax.top_k(grouped, cfg.group_score_topn)[0].sum(axis=-1)
    _, kept = jax.lax.top_k(group_scores, cfg.topk_groups)  # [num_tokens, topk_groups]
    kept_mask = (kept[:, :, None] == jnp.arange(cfg.num_groups)).any(axis=1)
    return jnp.repeat(kept_mask, cfg.num_experts // cfg.num_groups, axis=-1)


Glu = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> the down projection's input


def glu(cfg: MoEConfig) -> Glu:
    """How the experts combine their gate and up projections: ``act(gate) * up``, or gpt-oss's
    clamped SwiGLU (``MoEConfig.swiglu_clamp``)."""
    if cfg.swiglu_clamp is None:
        act = _ACTIVATIONS[cfg.activation]
        return lambda gate, up: act(gate) * up
    alpha, limit = cfg.swiglu_clamp

    def clamped(gate: jax.Array, up: jax.Array) -> jax.Array:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))

    return clamped


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def experts_gathered(
    x: jax.Array,  # [num_tokens, hidden]
    experts: jax.Array,  # [num_tokens, top_k] int32, indices into the stacks
    gate: ExpertLinear,  # [num_experts, hidden, expert_inter]
    up: ExpertLinear,  # [num_experts, hidden, expert_inter]
    down: ExpertLinear,  # [num_experts, expert_inter, hidden]
    combine: Glu = _swiglu,
) -> jax.Array:  # [num_tokens, top_k, hidden] in x's dtype
    """Each chosen expert's MLP output per (token, slot), from gathered expert weights."""
    h = combine(gate.gathered(x, experts), up.gathered(x, experts))
    return down.gathered(h, experts)


def experts_grouped(
    x: jax.Array,  # [num_tokens, hidden]
    experts: jax.Array,  # [num_tokens, top_k] int32, indices into the stacks
    gate: ExpertLinear,  # [num_experts, hidden, expert_inter]
    up: ExpertLinear,  # [num_experts, hidden, expert_inter]
    down: ExpertLinear,  # [num_experts, expert_inter, hidden]
    combine: Glu = _swiglu,
) -> jax.Array:  # [num_tokens, top_k, hidden] in x's dtype
    """Same contract as ``experts_gathered``, as a grouped matmul over rows sorted by expert."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)  # [num_tokens * top_k]
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=gate.num_experts).astype(jnp.int32)
    rows = x[order // top_k]  # [num_tokens * top_k, hidden], expert-contiguous
    h = combine(gate.grouped(rows, group_sizes), up.grouped(rows, group_sizes))
    out = down.grouped(h, group_sizes)
    # Undo the sort with a gather rather than a scatter: deterministic on every backend.
    unsorted = out[jnp.argsort(order)]
    return unsorted.reshape(num_tokens, top_k, -1)


def moe_mlp(
    cfg: MoEConfig,
    x: jax.Array,  # [..., hidden], e.g. [num_seqs, q_len, hidden]
    lw: Mapping[str, Any],  # one layer's MoE weights by field (see ``layer_weight_shapes``)
    valid: jax.Array | None = None,  # [...] bool, x's leading shape: the tokens that count
) -> jax.Array:  # [..., hidden] in x's dtype
    """``MoE.__call__`` with one layer's weights given by field name (``filled``).

    Raises ValueError at trace time when a weight is missing or has the wrong shape.
    """
    return filled(cfg, x.shape[-1], lw)(x, valid)


def filled(cfg: MoEConfig, hidden: int, lw: Mapping[str, Any]) -> MoE:
    """One layer's ``MoE`` holding the weights ``lw`` (by field name; a packed or int8 value
    makes its projection a quantized module). Raises ValueError when a weight is missing or has
    the wrong shape."""
    _check_shapes(cfg, hidden, {name: tuple(value.shape) for name, value in lw.items()})
    packed = (PackedWeight, PackedLayer, QuantizedWeight)
    quantized = {name for name, value in lw.items() if isinstance(value, packed)}
    layer = MoE(cfg, (), hidden, jnp.float32, quantized)
    for _, var in params(layer):
        var.set_value(lw[var.get_metadata("field")])
    return layer


def layer_weight_shapes(cfg: MoEConfig, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """The weights ``moe_mlp`` reads for one layer (``MoE``'s declarations): ``moe_weight_shapes``,
    with the expert stacks cut into resident and offloaded ones when ``cfg.offload`` is set."""
    return shapes(MoE(cfg, (), hidden_size, jnp.float32))


def _check_shapes(cfg: MoEConfig, hidden: int, given: Mapping[str, tuple[int, ...]]) -> None:
    # Shapes are static, so this costs nothing at run time and turns a silently transposed or
    # missing tensor into a message naming it.
    for name, shape in layer_weight_shapes(cfg, hidden).items():
        if name not in given:
            raise ValueError(f"MoE weights lack {name!r} (expected shape {shape})")
        if tuple(given[name]) != shape:
            raise ValueError(
                f"MoE weight {name!r} has shape {tuple(given[name])}, expected {shape}"
            )


class MoE(Block):
    """A layer's (or a stack of ``lead`` layers') MoE weights. The routed experts' stacks are
    ``ExpertLinear`` modules (``QuantizedExpertLinear`` when packed), ``[..., experts, in, out]``
    split over their expert axis with expert parallelism (each device keeps its share of the
    experts whole); offloaded stacks (``e_gate_host``, ...) split the same way and live in
    pinned host memory. The router stays whole; the shared expert's projections are ``Linear``s
    and split like an MLP."""

    def __init__(
        self,
        cfg: MoEConfig,
        lead: Sequence[int],
        hidden: int,
        dtype: jnp.dtype,
        quantized: Collection[str] = (),
    ) -> None:
        self.cfg = cfg
        stack, e, inter = layer_axes(lead), cfg.num_experts, cfg.expert_intermediate_size
        self.router = declare((*lead, hidden, e), dtype, (*stack, EMBED, ROUTER), "router")
        self.router_bias = (
            declare((*lead, e), dtype, (*stack, ROUTER), "router_bias")
            if cfg.has_router_bias
            else None
        )
        self.router_b = (
            declare((*lead, e), dtype, (*stack, ROUTER), "router_b")
            if cfg.router_logit_bias
            else None
        )
        norm = cfg.router_norm is not None
        self.router_scale = (
            declare((*lead, hidden), dtype, (*stack, EMBED), "router_scale") if norm else None
        )
        scaled = cfg.expert_scale
        self.expert_scale = (
            declare((*lead, e), dtype, (*stack, ROUTER), "expert_scale") if scaled else None
        )
        resident, offloaded = (e, 0) if cfg.offload is None else cfg.offload.stack_sizes(e)

        def experts(
            field: str, features: tuple[int, int], axes: tuple[str, str]
        ) -> tuple[ExpertLinear, ExpertLinear | None]:
            def stack_of(size: int, name: str, memory_kind: str | None) -> ExpertLinear:
                bias = field + "_b" if cfg.expert_bias else None  # never offloaded (MoEConfig)
                return expert_projection(
                    lead, size, features, axes, dtype, name, quantized, memory_kind, bias
                )

            host = stack_of(offloaded, field + HOST_SUFFIX, "pinned_host") if offloaded else None
            return stack_of(resident, field, None), host

        self.e_gate, self.e_gate_host = experts("e_gate", (hidden, inter), (EMBED, EXPERT_MLP))
        self.e_up, self.e_up_host = experts("e_up", (hidden, inter), (EMBED, EXPERT_MLP))
        self.e_down, self.e_down_host = experts("e_down", (inter, hidden), (EXPERT_MLP, EMBED))
        shared = cfg.shared_intermediate_size
        up, down = (hidden, shared), (shared, hidden)

        def proj(features: tuple[int, int], axes: tuple[str, str], field: str) -> Linear | None:
            return (
                projection(lead, features, axes, dtype, field, None, quantized) if shared else None
            )

        self.s_gate = proj(up, (EMBED, FFN), "s_gate")
        self.s_up = proj(up, (EMBED, FFN), "s_up")
        self.s_down = proj(down, (FFN, EMBED), "s_down")
        gate = (lead, (hidden, 1), (EMBED, ROUTER), dtype, "s_router")
        self.s_router = Linear(*gate) if shared and cfg.shared_gate else None

    def __call__(
        self,
        x: jax.Array,  # [..., hidden], e.g. [num_seqs, q_len, hidden]
        valid: jax.Array | None = None,  # [...] bool, x's leading shape: the tokens that count
        router_x: jax.Array | None = None,  # like x: what the router reads, when not x
    ) -> jax.Array:  # [..., hidden] in x's dtype
        """The MoE block's output for every token of one layer (inside the layer scan); tokens
        never interact, so padding rows are computed like any other and are the caller's to
        ignore. Shape-static and jit/scan friendly. ``valid`` (default: every token) only
        decides whether offloaded experts are fetched: a padding row routed to one does not
        fetch it, and its output is then unspecified.

        Raises ValueError at trace time when a weight has the wrong shape.
        """
        cfg, hidden = self.cfg, x.shape[-1]
        _check_shapes(cfg, hidden, shapes(self))
        tokens = x.reshape(-1, hidden)  # [num_tokens, hidden]
        bias = None if self.router_bias is None else self.router_bias.get_value()
        routed = tokens if router_x is None else router_x.reshape(-1, hidden)
        if self.router_scale is not None:
            routed = apply_norm(cfg.router_norm, routed, self.router_scale.get_value())
            routed = routed * jnp.asarray(hidden**-0.5, routed.dtype)
        logit_bias = None if self.router_b is None else self.router_b.get_value()
        experts, weights = route(cfg, routed, self.router.get_value(), bias, logit_bias)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.get_value().astype(jnp.float32)[experts]
        valid_tokens = None if valid is None else valid.reshape(-1)
        if cfg.weighted_inputs:
            out = self._weighted_inputs(tokens, experts, weights, valid_tokens)
        else:
            per_slot = self._routed_experts(tokens, experts, valid_tokens)
            out = jnp.einsum("tkh,tk->th", per_slot.astype(jnp.float32), weights)
        if self.s_gate is not None and self.s_up is not None and self.s_down is not None:
            act = _ACTIVATIONS[cfg.activation]
            shared = self.s_down(act(self.s_gate(tokens)) * self.s_up(tokens))
            shared = shared.astype(jnp.float32)
            if self.s_router is not None:
                shared = shared * jax.nn.sigmoid(self.s_router(tokens).astype(jnp.float32))
            out = out + shared
        return out.astype(x.dtype).reshape(x.shape)

    def _weighted_inputs(
        self,
        tokens: jax.Array,  # [num_tokens, hidden]
        experts: jax.Array,  # [num_tokens, top_k] int32
        weights: jax.Array,  # [num_tokens, top_k] float32
        valid: jax.Array | None,  # [num_tokens] bool
    ) -> jax.Array:  # [num_tokens, hidden] float32
        """The sum over slots of each chosen expert run on its token times the slot's weight:
        every (token, slot) is a row of its own, routed to its one expert."""
        num_tokens, top_k = experts.shape
        rows = tokens[:, None, :] * weights[..., None].astype(tokens.dtype)
        rows = rows.reshape(num_tokens * top_k, -1)  # [num_tokens * top_k, hidden]
        row_valid = None if valid is None else jnp.repeat(valid, top_k)
        out = self._routed_experts(rows, experts.reshape(-1, 1), row_valid)
        return out.astype(jnp.float32).reshape(num_tokens, top_k, -1).sum(axis=1)

    def _routed_experts(
        self,
        tokens: jax.Array,  # [num_tokens, hidden]
        experts: jax.Array,  # [num_tokens, top_k] int32
        valid: jax.Array | None,  # [num_tokens] bool
    ) -> jax.Array:  # [num_tokens, top_k, hidden] in tokens' dtype
        """Each chosen expert's output, from the resident stack or, fetched on demand, the
        offloaded one. The mechanism follows the full expert count either way, so offloading
        changes where weights live, not the arithmetic."""
        cfg = self.cfg
        grouped = experts.size > cfg.num_experts
        run = partial(experts_grouped if grouped else experts_gathered, combine=glu(cfg))
        resident = (self.e_gate, self.e_up, self.e_down)
        if cfg.offload is None:
            return run(tokens, experts, *resident)
        offloaded, index = cfg.offload.locate(experts, cfg.num_experts)

        def own(mine: jax.Array, size: int) -> jax.Array:  # [num_tokens, top_k] int32
            # Slots of the other stack: past the last group (no rows) when grouped, any valid
            # index when gathered; their outputs are dropped below.
            return jnp.where(mine, index, size if grouped else 0)

        here = run(tokens, own(~offloaded, self.e_gate.num_experts), *resident)
        host = (self.e_gate_host, self.e_up_host, self.e_down_host)

        def fetch() -> jax.Array:
            # Each offloaded stack is copied to device memory as it is called (``ExpertLinear``)
            # and freed once the layer is done with it.
            return run(tokens, own(offloaded, host[0].num_experts), *host)

        needed = offloaded if valid is None else offloaded & valid[:, None]
        there = jax.lax.cond(jnp.any(needed), fetch, lambda: jnp.zeros_like(here))
        return jnp.where(offloaded[..., None], there, here)

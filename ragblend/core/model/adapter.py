""":class:`ModelAdapter`: a decoder layer as small steps (norm, Q/K/V projection, RoPE,
attention, output + MLP), so the passes can run any subset of tokens through any layer.

It reuses the model's own modules (its rotary embedding included, so RoPE scaling variants
keep working); it does not re-implement weights.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from .decoder import RMSNorm
from .kernels import SHORT_PASS_ROWS
from .linear import weight_samples

# Decoder-only families whose layers have the Llama shape: pre-norm, Q/K/V/O projections
# (optionally biased), rotary embeddings, GQA, gated MLP. Qwen3 adds per-head q/k RMSNorm.
# Gemma 3 (text) adds q/k norms, norms after attention and MLP too, scaled embeddings and
# sliding-window layers whose RoPE base differs from its global layers'.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


class RopeTables:
    """RoPE cos/sin ``[positions, head_dim]`` for every layer of a model.

    Most models rotate every layer alike: one pair of tables, shared by all layers. Gemma 3
    rotates its sliding-window layers with base 10k and its global layers with base 1M, so
    each layer must take its own kind's tables (:meth:`layer`); a cached chunk's keys, stored
    before RoPE, are re-rotated to their place the same way.
    """

    def __init__(self, per_layer: list[tuple[torch.Tensor, torch.Tensor]]):
        self._per_layer = per_layer

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``layer``'s kind of RoPE."""
        return self._per_layer[layer]

    def _map(self, fn) -> "RopeTables":
        done = {}   # per kind, not per layer: layers of one kind share their tables
        for cos, sin in self._per_layer:
            if id(cos) not in done:
                done[id(cos)] = (fn(cos), fn(sin))
        return RopeTables([done[id(cos)] for cos, _ in self._per_layer])

    def rows(self, index) -> "RopeTables":
        """The tables at positions ``index`` (an int, a slice or an index tensor)."""
        return self._map(lambda t: t[index])

    @staticmethod
    def stack(rows: list["RopeTables"]) -> "RopeTables":
        """One row per table of ``rows`` (each from ``rows(position)``), stacked: ``[len(rows), head_dim]``."""
        first = rows[0]._per_layer
        kinds = {}
        for i, (cos, _) in enumerate(first):
            kinds.setdefault(id(cos), i)   # the first layer of each kind
        stacked = {key: (torch.stack([r._per_layer[i][0] for r in rows]), torch.stack([r._per_layer[i][1] for r in rows]))
                   for key, i in kinds.items()}
        return RopeTables([stacked[id(cos)] for cos, _ in first])


def _norm_of(module: torch.nn.Module | None, dtype: torch.dtype):
    """``module`` (an RMSNorm of a supported family) as a function: ``F.rms_norm`` for the
    families' float32 norms, one fused call where theirs is seven small ops (Llama's and the
    others' ``weight * x / rms(x)``; Gemma 3's ``(1 + weight) * x / rms(x)``, its weight taken
    when the adapter is built); the module itself for anything else. None stays None."""
    if module is None:
        return None
    if isinstance(module, RMSNorm):   # ragblend's own (a GGUF model's: .decoder), Gemma 3's offset included
        if dtype != torch.float32:
            return module
        weight, shape, eps = module.scale(), tuple(module.weight.shape), module.variance_epsilon
        return lambda x: F.rms_norm(x, shape, weight, eps)
    kind, weight = type(module).__name__, getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if dtype != torch.float32 or not kind.endswith("RMSNorm") or weight is None or eps is None or weight.dim() != 1:
        return module
    if kind.startswith("Gemma"):
        weight = 1.0 + weight.detach().float()
    elif not kind.startswith(("Llama", "Mistral", "Qwen2", "Qwen3")):
        return module
    shape = (weight.shape[0],)
    return lambda x: F.rms_norm(x, shape, weight, eps)


def _call_of(module: torch.nn.Module | None):
    """``module``'s forward, bound: the same result as calling the module without the ~3 us of
    ``nn.Module.__call__`` (hooks, which ragblend never sets on a model it runs). A decoding
    step calls ~8 modules a layer; these calls were ~20% of a short-prompt step."""
    return None if module is None else module.forward


def _activation_of(module: torch.nn.Module):
    """The MLP's activation, as :func:`_call_of`; SiLU (torch's or transformers' own, whose forward
    is ``F.silu``) in place over its input, which the MLP no longer needs: the same kernel and
    bits, one [tokens, intermediate] tensor less (:meth:`ModelAdapter._mlp`)."""
    silu = isinstance(module, torch.nn.SiLU) or type(module).__name__ == "SiLUActivation"
    return functools.partial(F.silu, inplace=True) if silu else _call_of(module)


@dataclass(frozen=True)
class LayerSteps:
    """One decoder layer's parts, resolved once from the model's modules (see :func:`_norm_of`
    and :func:`_call_of`): what :class:`ModelAdapter`'s per-layer steps call. ``fused_qkv`` and
    ``fused_gate_up`` are a decoding twin's :class:`~ragblend.core.model.decode_weights.FusedRows`
    (None elsewhere); ``post_mlp_norm`` is Gemma 3's norm after the MLP (None elsewhere), and
    with it ``post_attention_norm`` norms the attention's output, not the MLP's input."""

    input_norm: object
    q_proj: object
    k_proj: object
    v_proj: object
    fused_qkv: object
    q_norm: object
    k_norm: object
    o_proj: object
    post_attention_norm: object
    pre_mlp_norm: object
    post_mlp_norm: object
    gate_proj: object
    up_proj: object
    fused_gate_up: object
    down_proj: object
    act: object

    @classmethod
    def of(cls, block: torch.nn.Module, dtype: torch.dtype) -> "LayerSteps":
        attn, mlp = block.self_attn, block.mlp
        return cls(
            input_norm=_norm_of(block.input_layernorm, dtype),
            q_proj=_call_of(attn.q_proj), k_proj=_call_of(attn.k_proj), v_proj=_call_of(attn.v_proj),
            fused_qkv=_call_of(getattr(attn, "fused_qkv", None)),
            q_norm=_norm_of(getattr(attn, "q_norm", None), dtype), k_norm=_norm_of(getattr(attn, "k_norm", None), dtype),
            o_proj=_call_of(attn.o_proj),
            post_attention_norm=_norm_of(block.post_attention_layernorm, dtype),
            pre_mlp_norm=_norm_of(getattr(block, "pre_feedforward_layernorm", None), dtype),
            post_mlp_norm=_norm_of(getattr(block, "post_feedforward_layernorm", None), dtype),
            gate_proj=_call_of(mlp.gate_proj), up_proj=_call_of(mlp.up_proj),
            fused_gate_up=_call_of(getattr(mlp, "fused_gate_up", None)),
            down_proj=_call_of(mlp.down_proj), act=_activation_of(mlp.act_fn))


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_window: int


class ModelAdapter:
    """Per-layer primitives over a loaded HF causal LM of a supported architecture.

    Token tensors are 2-D ``[tokens, hidden]`` (one sequence, no batch); per-head tensors
    are ``[heads, tokens, head_dim]``, the layout attention and the KV store use.
    """

    def __init__(self, hf_model):
        arch = getattr(hf_model.config, "model_type", None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"Model architecture {arch!r} is not supported; ragblend supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (decoder-only with rotary embeddings)."
            )
        self.hf_model = hf_model
        self.arch = arch
        # What QueryAware's question pass (it only scores the reused tokens) runs on: this adapter,
        # or for a quantized model a twin on the low-bit kernels (see quantized.scoring_twin).
        self.scoring: ModelAdapter = self
        cfg = hf_model.config
        self.base = hf_model.model
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=attn.head_dim,
            context_window=int(cfg.max_position_embeddings),
        )
        self.scaling = attn.scaling   # Gemma 3: query_pre_attn_scalar ** -0.5, not head_dim ** -0.5
        self._windows = [self._sliding_window(cfg, i) for i in range(cfg.num_hidden_layers)]
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise UnsupportedModelError(f"{arch} with attention logit soft-capping is not supported (ragblend's "
                                        "attention is plain SDPA); set config.attn_logit_softcapping = None.")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{arch} with bidirectional attention is an encoder, not a causal LM; "
                                        "ragblend needs causal attention.")
        # Which RoPE each layer uses: None where the model has one kind (its rotary module takes
        # no layer type), else the layer's type (Gemma 3: "sliding_attention" / "full_attention").
        per_type = getattr(self.base.rotary_emb, "per_layer_type", None)   # ragblend's own modules say
        if per_type is None:
            per_type = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters
        self._rope_kinds = [cfg.layer_types[i] if per_type else None for i in range(cfg.num_hidden_layers)]
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self._steps = [LayerSteps.of(block, self.dtype) for block in self.layers]
        self._final_norm, self._head = _norm_of(self.base.norm, self.dtype), _call_of(hf_model.lm_head)

    @staticmethod
    def _sliding_window(cfg, layer: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        return window  # Mistral: one window for every layer (None = full attention)

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    def window(self, layer: int) -> int | None:
        """Sliding-window size of a layer, or None for full causal attention."""
        return self._windows[layer]

    # -- the steps of one decoder layer, in order

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # The model's own module: Gemma 3's scales by sqrt(hidden_size) itself.
        return self.base.embed_tokens(token_ids)

    def attn_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input norm (what Q, K and V are projected from)."""
        return self._steps[layer].input_norm(hidden)

    def kv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (before RoPE) and V ``[kv_heads, tokens, head_dim]`` from the normed input ``x``."""
        steps = self._steps[layer]
        return self._heads(steps.k_proj(x), steps.k_norm), self._heads(steps.v_proj(x))

    def q(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Q (before RoPE) ``[heads, tokens, head_dim]`` from the normed input ``x``."""
        steps = self._steps[layer]
        return self._heads(steps.q_proj(x), steps.q_norm)

    def qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K (before RoPE) and V, as :meth:`q` and :meth:`kv` give them. A decoding twin
        whose layer holds them fused (``fused_qkv``, see :mod:`.decode_weights`) computes all
        three in one low-bit matmul for the few rows of a short pass (decoding, a next question;
        a longer pass runs them on their float32 weights, as the separate layers would)."""
        steps = self._steps[layer]
        if steps.fused_qkv is None:
            return (self.q(layer, x), *self.kv(layer, x))
        q, k, v = steps.fused_qkv(x)
        return self._heads(q, steps.q_norm), self._heads(k, steps.k_norm), self._heads(v)

    def _heads(self, projected: torch.Tensor, norm=None) -> torch.Tensor:
        """A projection's output ``[tokens, heads * head_dim]`` as ``[heads, tokens, head_dim]``,
        through the per-head norm of the models that have one for Q and K (Qwen3, Gemma 3:
        RMSNorm over each head's dims, before RoPE)."""
        heads = projected.view(projected.shape[0], -1, self.shape.head_dim)
        return (heads if norm is None else norm(heads)).transpose(0, 1)

    def rope_tables(self, num_positions: int) -> RopeTables:
        """cos/sin ``[positions, head_dim]`` of each layer (:meth:`RopeTables.layer`), from the
        model's own rotary module (scaling variants and per-layer-type bases included)."""
        pos = torch.arange(num_positions, device=self.device)[None]
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        tables = {}
        for kind in dict.fromkeys(self._rope_kinds):
            cos, sin = self.base.rotary_emb(probe, pos) if kind is None else self.base.rotary_emb(probe, pos, kind)
            tables[kind] = (cos[0], sin[0])
        return RopeTables([tables[kind] for kind in self._rope_kinds])

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [heads, tokens, dim]`` by per-token ``cos``/``sin [tokens, dim]``."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None, folded_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of queries ``q [H, n, D]`` over ``k, v [Hkv, N, D]``.

        ``mask`` is ``[n, N]``, boolean (True = may attend) or additive float, or None for the plain causal
        case where the queries are exactly the last ``n == N`` keys. Returns ``[n, H*D]``.
        ``folded_mask``: :meth:`fold_mask` of ``mask``, for a short pass that made it once
        for all its layers.
        """
        heads, n, dim = q.shape
        group = heads // k.shape[0]   # query heads per K/V head
        if self._folds_heads(mask, n):
            # A short pass: the heads that share a K/V head become rows of one query, so K/V
            # are read once. (Masked SDPA with enable_gqa copies K/V once per query head on CPU,
            # which made it several times slower over a long prompt.) Same math.
            folded = q.reshape(k.shape[0], group * n, dim)
            folded_mask = self.fold_mask(mask) if folded_mask is None else folded_mask
            out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=folded_mask,
                                                 scale=self.scaling)
            return out[0].reshape(heads, n, dim).transpose(0, 1).reshape(n, -1)
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
            scale=self.scaling, enable_gqa=group > 1,
        )
        return out[0].transpose(0, 1).reshape(n, -1)

    def attend_one_token(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one token's queries ``q [H, 1, D]`` over keys it sees all of, ``k, v
        [Hkv, N, D]`` (a decoding step's: the caller slices a sliding window's), ``bias [1, N]``
        added to every score (None: none), as ``[1, H*D]`` in K/V's dtype (``q`` is cast to it).

        The query heads that share a K/V head become rows of one query (HF's layout: consecutive
        query heads share one), so K/V are read once; SDPA over GQA would copy them per query
        head. SDPA's CPU kernel, not three small matmuls: a float16 matmul has no fast CPU kernel
        (~3x SDPA's time over float16 K/V on a short prompt)."""
        heads, _, dim = q.shape
        folded = q.reshape(k.shape[0], heads // k.shape[0], dim).to(k.dtype)
        out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=bias, scale=self.scaling)
        return out.reshape(1, heads * dim)

    def _folds_heads(self, mask: torch.Tensor | None, rows: int) -> bool:
        """Whether :meth:`attention` folds the query heads sharing a K/V head into rows: on a
        masked short pass (at most ``SHORT_PASS_ROWS`` rows: decoding, a conversation's next question)
        of a model with grouped heads."""
        return mask is not None and self.shape.num_heads > self.shape.num_kv_heads and rows <= SHORT_PASS_ROWS

    def fold_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``mask [n, N]`` for a short pass's folded queries (:meth:`attention`): one copy
        per query head sharing a K/V head; None where the attention does not fold."""
        if not self._folds_heads(mask, 0 if mask is None else mask.shape[0]):
            return None
        return mask.repeat(self.shape.num_heads // self.shape.num_kv_heads, 1)

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, post-attention norm, MLP, residual (Gemma 3: the
        attention output and the MLP's are normed before their residual, the MLP's input by
        its pre-feedforward norm)."""
        steps = self._steps[layer]
        if steps.post_mlp_norm is not None:
            hidden = hidden + steps.post_attention_norm(steps.o_proj(attn_out))
            return hidden + steps.post_mlp_norm(self._mlp(steps, steps.pre_mlp_norm(hidden)))
        hidden = hidden + steps.o_proj(attn_out)
        return hidden + self._mlp(steps, steps.post_attention_norm(hidden))

    @staticmethod
    def _mlp(steps: LayerSteps, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP, ``down(act(gate(x)) * up(x))`` (the MLP of every supported
        architecture, SUPPORTED_ARCHITECTURES), its gate and up projections in one low-bit
        matmul where a decoding twin fused them (``fused_gate_up``; a pass longer than a
        short pass runs them on their float32 weights)."""
        if steps.fused_gate_up is None:
            gate, up = steps.gate_proj(x), steps.up_proj(x)
        else:
            gate, up = steps.fused_gate_up(x)
        # In place where the kernels allow it (the same kernels, the same bits): over a 3k-token
        # prefill each of these is [tokens, intermediate] float32, ~110 MB at 1.5B, and four of
        # them at once (gate, up, act(gate), the product) were most of a prefill's working memory.
        hidden = steps.act(gate)   # SiLU in place (:func:`_activation_of`)
        del gate
        return steps.down_proj(hidden.mul_(up))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (+ the final logit soft-capping of models that have one)."""
        logits = self._head(self._final_norm(hidden))
        if self._final_softcap is not None:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    # -- identity

    def weights_form(self) -> str:
        """"float32" (or the model's dtype), or "quantized" for a model built by :mod:`.quantized`."""
        return getattr(self.hf_model, "ragblend_weights_form", None) or str(self.dtype).split(".")[-1]

    def fingerprint(self, tokenizer) -> str:
        """A hash that changes when the weights, architecture, compute dtype or tokenizer change.

        Hashing all weights would cost ~0.5 s per 100M parameters, so each tensor
        contributes its shape and a strided sample of its values.
        """
        h = hashlib.sha256()
        config = json.loads(self.hf_model.config.to_json_string(use_diff=False))
        # Where the model was loaded from, and which transformers wrote the config, are not
        # what it is (an upgrade of transformers alone must not orphan a shipped calibration).
        config.pop("_name_or_path", None)
        config.pop("transformers_version", None)
        config.pop("quantization_config", None)   # how transformers read a GGUF file, not the model
        h.update(json.dumps(config, sort_keys=True).encode())
        h.update(str(self.dtype).encode())
        for name, shape, samples in weight_samples(self.hf_model):
            h.update(name.encode())
            h.update(str(shape).encode())
            h.update(samples.tobytes())
        vocab = sorted(tokenizer.get_vocab().items())
        h.update(json.dumps(vocab).encode())
        h.update(str(tokenizer.chat_template or "").encode())
        return h.hexdigest()

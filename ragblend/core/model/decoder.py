"""ragblend's own decoder modules for the model families it runs: plain ``nn.Module``\\ s named
and shaped as transformers' are (``model.embed_tokens``, ``model.layers[i].self_attn.q_proj``,
..., ``model.norm``, ``model.rotary_emb``, ``lm_head``), so that the adapter, the decoding twins
and a GGUF file's tensor names find them where they find transformers'.

Why: a GGUF model is assembled by ragblend from the file (:mod:`.quantized`); building its
skeleton with ``AutoModelForCausalLM`` imported ``transformers.modeling_utils`` and with it
sympy, torch._dynamo and accelerate: ~0.13-0.16 GB of code resident, ~15% of a 1.5B Q4_0 file
(issue 55). These modules import torch and transformers' config-level RoPE helpers only.

The numbers are transformers' (the same ops in the same order, float32); their own
:meth:`CausalLM.forward` is a plain full-sequence pass, what tests compare the engine with.
The engine itself runs the layers through :class:`~ragblend.core.model.adapter.ModelAdapter`.
A config these modules do not cover (another family, a RoPE that changes with the sequence
length, another activation) gets ``None`` from :func:`plain_decoder`: transformers' modules then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Family:
    """What one model family's layers have beyond Llama's."""

    qkv_bias: bool = False        # Q/K/V projections always biased (Qwen2), whatever attention_bias says
    qk_norm: bool = False         # RMSNorm over each head of Q and K (Qwen3, Gemma 3)
    sandwich: bool = False        # norms after attention and MLP too, and before the MLP (Gemma 3)
    norm_offset: float = 0.0      # the norm multiplies by offset + weight (Gemma 3: 1 + weight)
    scaled_embedding: bool = False  # embeddings times sqrt(hidden) (Gemma 3)
    rope_per_layer_type: bool = False  # a RoPE per layer type (Gemma 3: sliding 10k, global 1M)


FAMILIES = {
    "llama": Family(), "mistral": Family(), "qwen2": Family(qkv_bias=True), "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(qk_norm=True, sandwich=True, norm_offset=1.0, scaled_embedding=True,
                          rope_per_layer_type=True),
}
ACTIVATIONS = {"silu": nn.SiLU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh")}
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")   # tables fixed at build time


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class RMSNorm(nn.Module):
    """``(offset + weight) * x / rms(x)`` in float32 (transformers' Llama and Gemma 3 norms agree
    on float32 inputs; the adapter calls ``F.rms_norm`` with :meth:`scale` the same way)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.variance_epsilon, self.offset = eps, offset

    def scale(self) -> torch.Tensor:
        return self.weight.float() + self.offset if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.scale(), self.variance_epsilon).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """Gemma 3's embedding: looked-up rows times sqrt(hidden)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__(vocab, hidden, _weight=_uninitialized(vocab, hidden))
        self.embed_scale = nn.Buffer(torch.tensor(hidden ** 0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _uninitialized(vocab: int, hidden: int) -> torch.Tensor:
    """An embedding's table left as allocated (on meta: nothing): nn.Embedding's own random
    init on the meta device runs torch's Python reference of ``normal_``, which imports
    torch._dynamo and sympy (~40 MB resident) for values that are replaced anyway."""
    return torch.empty(vocab, hidden)


class Rotary(nn.Module):
    """RoPE cos/sin tables by position, from transformers' own RoPE parameter functions (scaling
    variants included); one set per layer type where the family has one per type."""

    def __init__(self, config):
        super().__init__()
        self.per_layer_type = FAMILIES[config.model_type].rope_per_layer_type
        self.kinds = sorted(set(config.layer_types)) if self.per_layer_type else [None]
        self.scaling = {}
        for kind in self.kinds:
            # On the CPU even while the model is built on meta: a few hundred floats, and torch's
            # meta arange runs through its Python references (importing dynamo and sympy).
            with torch.device("cpu"):
                inv_freq, self.scaling[kind] = _inverse_frequencies(config, kind)
            self.register_buffer(f"{kind or 'default'}_inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        """``(cos, sin) [batch, positions, head_dim]`` in ``x``'s dtype, as transformers' rotary modules give them."""
        inv_freq = getattr(self, f"{layer_type or 'default'}_inv_freq")
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.scaling[layer_type]
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def _rope_parameters(config, kind: str | None) -> dict:
    params = config.rope_parameters
    return params[kind] if kind is not None else params


def _inverse_frequencies(config, kind: str | None) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config, kind)
    if params["rope_type"] == "default":   # transformers' compute_default_rope_parameters
        dim = head_dim_of(config)
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # imported with the config already

    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, layer_type=kind)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, family: Family):
        super().__init__()
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        # Gemma 3 scales by query_pre_attn_scalar ** -0.5, the others by head_dim ** -0.5
        self.scaling = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias or family.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias or family.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias or family.qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)
        if family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, family.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, family.norm_offset)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x [batch, tokens, hidden]``, ``cos/sin [batch, tokens, head_dim]``, boolean ``mask [tokens, tokens]``."""
        batch, tokens, _ = x.shape

        def heads(projected, norm):
            h = projected.view(batch, tokens, -1, self.head_dim)
            return (h if norm is None else norm(h)).transpose(1, 2)

        q = heads(self.q_proj(x), getattr(self, "q_norm", None))
        k = heads(self.k_proj(x), getattr(self, "k_norm", None))
        v = heads(self.v_proj(x), None)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACTIVATIONS[activation_of(config)]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def activation_of(config) -> str:
    return getattr(config, "hidden_activation", None) or config.hidden_act


class DecoderLayer(nn.Module):
    def __init__(self, config, family: Family):
        super().__init__()
        eps, offset = config.rms_norm_eps, family.norm_offset
        self.self_attn = Attention(config, family)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        if family.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(self, hidden: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, mask)
        if hasattr(self, "post_feedforward_layernorm"):   # Gemma 3: each output normed before its residual
            hidden = hidden + self.post_attention_layernorm(attended)
            return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """The decoder stack: what ``hf_model.model`` is for transformers' causal LMs."""

    def __init__(self, config, family: Family):
        super().__init__()
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = ScaledEmbedding(vocab, hidden) if family.scaled_embedding else \
            nn.Embedding(vocab, hidden, _weight=_uninitialized(vocab, hidden))
        self.layers = nn.ModuleList(DecoderLayer(config, family) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps, family.norm_offset)
        self.rotary_emb = Rotary(config)


class CausalLM(nn.Module):
    """A decoder-only causal LM of ``config`` in ragblend's modules (see the module's docstring)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, FAMILIES[config.model_type])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):   # one parameter, as transformers ties them
            self.lm_head.weight = self.model.embed_tokens.weight
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig.from_model_config(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0, **_) -> CausalLMOutput:
        """Logits ``[batch, tokens, vocab]`` of a full causal pass over ``input_ids [batch, tokens]``
        (``logits_to_keep``: only the last that many tokens', as transformers' models take it)."""
        config, base = self.config, self.model
        tokens = input_ids.shape[-1]
        hidden = base.embed_tokens(input_ids)
        positions = torch.arange(tokens, device=input_ids.device)[None]
        tables = {kind: base.rotary_emb(hidden, positions, kind) for kind in base.rotary_emb.kinds}
        layer_types = getattr(config, "layer_types", None) or [None] * config.num_hidden_layers
        for layer, kind in zip(base.layers, layer_types):
            window = _window(config, kind)
            cos, sin = tables[kind if base.rotary_emb.per_layer_type else None]
            hidden = layer(hidden, cos, sin, _causal_mask(tokens, window, hidden.device))
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(base.norm(hidden))
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return CausalLMOutput(logits=logits)


def _window(config, layer_type: str | None) -> int | None:
    """A layer's sliding window (as the adapter reads it): Gemma 3's and Qwen2's by layer type, Mistral's for all."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None) is not None:
        return window if layer_type == "sliding_attention" else None
    return window


def _causal_mask(tokens: int, window: int | None, device) -> torch.Tensor:
    pos = torch.arange(tokens, device=device)
    mask = pos[None, :] <= pos[:, None]
    return mask if window is None else mask & (pos[None, :] > pos[:, None] - window)


def plain_decoder(config) -> CausalLM | None:
    """``config``'s model in ragblend's modules (on the current default device: build it under
    ``torch.device("meta")`` to allocate nothing), or None where these modules do not cover it."""
    return CausalLM(config) if covers(config) else None


def covers(config) -> bool:
    """Whether these modules build ``config``'s model (:func:`plain_decoder`)."""
    if config.model_type not in FAMILIES or activation_of(config) not in ACTIVATIONS:
        return False
    if getattr(config, "attn_logit_softcapping", None) is not None or \
            getattr(config, "use_bidirectional_attention", False):
        return False   # the adapter refuses these with its own message
    family = FAMILIES[config.model_type]
    kinds = sorted(set(config.layer_types)) if family.rope_per_layer_type else [None]
    try:
        # not a RoPE that changes with the sequence length (dynamic, longrope): transformers' modules
        return all(_rope_parameters(config, kind)["rope_type"] in STATIC_ROPE for kind in kinds)
    except (AttributeError, KeyError, TypeError):
        return False

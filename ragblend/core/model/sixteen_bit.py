"""A model whose weights stay 16-bit in memory (an HF directory stored in bfloat16 or float16)
and are computed in float32, layer by layer.

Each linear layer's and the embedding's weight is kept as the checkpoint stores it, inside the
same layers a GGUF file's weights use (:class:`~ragblend.core.model.quantized.QuantLinear` of kind
"float"): a pass copies one matrix at a time into a reused float32 scratch buffer and runs
``F.linear`` in float32. The numbers are then those of the same directory loaded with
``dtype=torch.float32`` (the 16-bit values are exact in float32), at half its memory; the norms,
biases and rotary tables (small) are float32. So the two loads are one model to ragblend: the
same fingerprint, calibration and KV entries.
"""

from __future__ import annotations

import torch

from .quantized import QuantEmbedding, QuantHead, QuantLinear

SIXTEEN_BIT = {torch.bfloat16: "BF16", torch.float16: "F16"}


def hold_in_16_bit(model, rounded_from: str | None = None):
    """``model`` (an HF causal LM loaded in bfloat16 or float16) with its linear layers and
    embedding as 16-bit :class:`QuantLinear` tables computed in float32, everything else in
    float32. ``rounded_from``: what its weights were rounded from at load where they were not
    stored 16-bit ("the file's Q4_0"; ``ragblend info`` says it). Changes ``model`` in place (no
    weight is copied) and returns it."""
    dtype = model.model.embed_tokens.weight.dtype
    source = SIXTEEN_BIT[dtype]
    model.ragblend_rounded_from = rounded_from
    # What weight_samples gives for the float32 load of the same directory: the same names,
    # shapes and values (16-bit values are exact in float32), so the fingerprint is the same.
    skeleton = [(name, tuple(t.shape), t) for name, t in model.state_dict().items()]

    def samples():
        for name, shape, tensor in skeleton:
            flat = tensor.detach().reshape(-1)
            yield name, shape, flat[::max(1, flat.numel() // 4096)].float().numpy()

    config = model.config
    embedding = model.model.embed_tokens
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is embedding.weight
    table = QuantLinear(embedding.num_embeddings, embedding.embedding_dim, "float", {"weight": embedding.weight.data},
                        source_type=source)
    scale = float(config.hidden_size ** 0.5) if hasattr(embedding, "embed_scale") else None   # Gemma 3's, in float32
    model.model.embed_tokens = QuantEmbedding(table, scale)
    head = getattr(model, "lm_head", None)
    if tied:
        model.lm_head = QuantHead(table)
    elif type(head) is torch.nn.Linear:
        model.lm_head = QuantHead(_table(head, source))
    for name, module in list(model.model.named_modules()):
        if type(module) is torch.nn.Linear:
            parent_name, _, child = name.rpartition(".")
            setattr(model.model.get_submodule(parent_name), child, _table(module, source))
    for module in model.modules():   # norms, biases, Gemma's embed_scale: small, float32
        if not isinstance(module, QuantLinear):
            for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
                if tensor.is_floating_point() and tensor.dtype != torch.float32:
                    setattr(module, name, torch.nn.Parameter(tensor.float(), requires_grad=False)
                            if isinstance(tensor, torch.nn.Parameter) else tensor.float())
    model.config.dtype = torch.float32   # what it computes in: its config reads as the float32 load's
    model.gguf_weight_samples = samples   # the hook quantized models answer weight_samples by (is_quantized)
    model.ragblend_weights_form = str(dtype).split(".")[-1]
    return model


def _table(linear: torch.nn.Linear, source: str) -> QuantLinear:
    bias = None if linear.bias is None else linear.bias.data.float()
    return QuantLinear(linear.out_features, linear.in_features, "float", {"weight": linear.weight.data}, bias,
                       source_type=source)

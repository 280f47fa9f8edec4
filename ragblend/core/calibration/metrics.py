"""The KL measures calibration judges by, which the benchmarks share: first-token KL, and the
answer-level KL over a greedy answer, teacher-forced (:func:`answer_logits`).
"""

from __future__ import annotations

import torch


def first_token_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || fused) between the next-token distributions of two prefills."""
    return torch.nn.functional.kl_div(torch.log_softmax(logits.float(), -1), torch.log_softmax(reference.float(), -1),
                                      log_target=True, reduction="sum").item()


def answer_logits(engine, prefill, answer_ids: list[int], *, decoding_bias=True) -> torch.Tensor:
    """The next-token logits ``[len(answer_ids), vocab]`` at each step of ``answer_ids`` after
    ``prefill`` (a :class:`~ragblend.core.results.Prefill`), teacher-forced: step i is conditioned
    on ``answer_ids[:i]``, whatever the prefill would have chosen. One pass on the engine's
    decoding weights. ``decoding_bias=False`` leaves the fused prefill's key bias (QueryAware's
    cached-attention scale) out of the answer's steps, keeping it in the prefill's own logits.
    ``decoding_bias`` may also be a function ``step -> factor`` (step 1 is the answer's second
    token): the bias times that factor at each step, e.g. a scale that fades over the answer
    (one pass per token then, since each step sees another bias)."""
    from ..decode.generate import KVDecoder

    n = len(prefill.token_ids)
    first = prefill.logits.float()[None]
    if len(answer_ids) < 2:
        return first[:len(answer_ids)]
    bias = prefill.key_bias if decoding_bias is not False else None
    decoder = KVDecoder(engine.decoding_adapter(), prefill.keys, prefill.values, n + len(answer_ids), bias)
    with engine.lock:
        if bias is None or not callable(decoding_bias):
            rest = decoder.extend(list(answer_ids[:-1]))
        else:
            steps = []
            for i, token in enumerate(answer_ids[:-1], start=1):
                decoder.key_bias[:n] = bias * float(decoding_bias(i))
                steps.append(decoder.extend([token]))
            rest = torch.cat(steps)
    return torch.cat([first, rest.float()])


def answer_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Answer-level KL: the mean over the answer's steps of KL(reference || other), both from
    :func:`answer_logits` on the same answer (the reference's own greedy answer). First-token KL
    sees only the first step; this sees the answer drift that follows."""
    return answer_kl_steps(reference, logits).mean().item()


def answer_kls(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """``{"answer_kl", "answer_kl_peak"}``: :func:`answer_kl` and the largest KL at any one step
    of the answer (a short factual answer turns on a token or two, which the mean dilutes)."""
    steps = answer_kl_steps(reference, logits)
    return {"answer_kl": steps.mean().item(), "answer_kl_peak": steps.max().item()}


def answer_kl_steps(reference: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) at each step of the answer ``[steps]``; see :func:`answer_kl`."""
    log_ref, log_other = torch.log_softmax(reference.float(), -1), torch.log_softmax(logits.float(), -1)
    return (log_ref.exp() * (log_ref - log_other)).sum(-1)

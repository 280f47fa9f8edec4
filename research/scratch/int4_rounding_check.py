"""Is this host's 4-bit kernel as precise as its intended bfloat16 rounding? (session 29, AVX2-only EPYC)

Run: PYTHONPATH=. python3 research/scratch/int4_rounding_check.py

SmolLM2, one row per linear layer (the last token's input to it on a short prompt). Prints the
relative error, against float64 on the same 4-bit weights, of the intended rounding (bfloat16
activation, scales and zeros, float accumulation, bfloat16 output) and of PyTorch's kernel
(``Int4Linear``), and the kernel's difference from the intended rounding.
"""

import statistics

import torch

from ragblend import BlendEngine
from ragblend.core.model.linear import INT4_GROUP, Int4Linear, quantize_int4


def layer_inputs(engine) -> dict[str, torch.Tensor]:
    """Each decoder linear layer's input for the last token of a short prompt."""
    model, captured = engine.hf_model, {}

    def keep(name):
        def hook(module, inputs, output):
            captured.setdefault(name, inputs[0][0, -1:].detach().clone())   # returns None: output unchanged
        return hook

    hooks = [m.register_forward_hook(keep(name)) for name, m in model.named_modules()
             if type(m) is torch.nn.Linear and "lm_head" not in name]
    ids = torch.tensor([engine.tokenize("The ferry to Hallow Holm leaves from the north pier every morning.")])
    with torch.inference_mode():
        model(ids)
    for hook in hooks:
        hook.remove()
    return captured


def errors(linear: torch.nn.Linear, x: torch.Tensor) -> tuple[float, float, float]:
    codes, scales, low = quantize_int4(linear.weight)
    scale = scales.to(torch.bfloat16).double()
    zero = (low + 8 * scales).to(torch.bfloat16).double()
    groups = (codes.double() - 8).reshape(codes.shape[0], -1, INT4_GROUP)
    weight = (groups * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(codes.shape)
    exact = x.double() @ weight.T
    intended = (x.to(torch.bfloat16).double() @ weight.T).to(torch.bfloat16).double()
    kernel = Int4Linear(linear).rows(x).double()
    size = exact.norm()
    return (((intended - exact).norm() / size).item(), ((kernel - exact).norm() / size).item(),
            ((kernel - intended).norm() / size).item())


def main() -> None:
    engine = BlendEngine.from_pretrained(kv_dir=False)
    modules = dict(engine.hf_model.named_modules())
    with torch.inference_mode():
        rows = [errors(modules[name], x) for name, x in layer_inputs(engine).items()]
    for label, column in (("intended vs float64", 0), ("kernel vs float64", 1), ("kernel vs intended", 2)):
        values = [row[column] for row in rows]
        print(f"{label:20s} relative error over {len(values)} layers: median {statistics.median(values):.2e}, "
              f"max {max(values):.2e}")


if __name__ == "__main__":
    main()

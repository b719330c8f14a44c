"""How far fpemu's float32-rounded-once model is from torch's own CPU kernels on real models' calls.

Under the CPU table the ops of ``fpemu/emulate/_torch_kernels.CPU_LOW_KERNELS`` run torch's own
float16 / bfloat16 CPU kernel (so a ResNet-18 trains bit for bit as real CPU autocast); the CUDA table
and fpemu's claim elsewhere compute them in float32 and round once.  This measures the gap between
the two on every call a ResNet-18 (4 x 3 x 64 x 64 images, from tests/model_families.py) and a small
ViT (transformers, scaled_dot_product_attention) make in one training step under real CPU autocast: per op,
the share of results that differ, the largest distance in ulps of the format (counted along the
format's ordered bit patterns, so a result near zero that cancels counts many) and the normwise
distance ||a - b|| / ||b|| in units of the format's epsilon.  Writes reports/emulate_op_bounds.md and
.json.  Run: python -m benchmarks.emulate_op_bounds
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks._common import write_report

EPSILON = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}


def _ordered(tensor, torch):
    """The low tensor's bit patterns as integers in value order (-0 and +0 both 0)."""
    bits = tensor.contiguous().view(torch.int16).int()
    return torch.where(bits >= 0, bits, -(bits & 0x7FFF))


def step_calls(model, loss_of, low, torch):
    """(op name, op, cloned arguments) of every CPU_LOW_KERNELS call of one real autocast step."""
    from fpemu.emulate._torch_kernels import CPU_LOW_KERNELS, NO_FLOAT32_CALL
    calls = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name in CPU_LOW_KERNELS and name not in NO_FLOAT32_CALL:
                clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
                calls.append((name, func, torch.utils._pytree.tree_map(clone, (args, kwargs or {}))))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(1)
    with Record():
        with torch.autocast("cpu", dtype=low):
            loss = loss_of(model, 0)
        (loss * 1024).backward()
    return calls


def gaps(calls, low, torch) -> dict:
    """op -> [values, differing, max ulp, max normwise distance (squared sums: worst call)]."""
    gaps = {}
    for name, func, (args, kwargs) in calls:
        copied = torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
        real = torch.utils._pytree.tree_leaves(func(*copied[0], **copied[1]))
        up = lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype == low else (  # noqa: E731
            v.clone() if isinstance(v, torch.Tensor) else v)
        once = torch.utils._pytree.tree_leaves(func(*torch.utils._pytree.tree_map(up, args),
                                                     **torch.utils._pytree.tree_map(up, kwargs)))
        row = gaps.setdefault(name, [0, 0, 0, 0.0])
        for a, b in zip(real, once):
            if not (isinstance(a, torch.Tensor) and a.dtype == low) or not a.numel():
                continue
            b = b.to(low)
            finite = torch.isfinite(a) & torch.isfinite(b)
            distance = (_ordered(a, torch) - _ordered(b, torch)).abs()[finite]
            row[0] += a.numel()
            row[1] += int((distance > 0).sum())
            row[2] = max(row[2], int(distance.max()) if distance.numel() else 0)
            norm = float(a.float()[finite].norm())
            if norm > 0:
                row[3] = max(row[3], float((a.float() - b.float())[finite].norm()) / norm)
    return gaps


def main():
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import model_families
    from benchmarks.emulate_ops import _tiers
    torch.set_num_threads(1)
    rows = []
    for family, build in (("ResNet-18 4x3x64x64", lambda: model_families.resnet18(batch=4, size=64)),
                          ("ViT 2 layers d=64 (SDPA) 2x3x32x32", model_families.vit)):
        for fmt, low in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            torch.manual_seed(0)
            model, loss_of = build()
            for name, (values, differing, ulp, normwise) in sorted(gaps(step_calls(model, loss_of, low, torch), low,
                                                                         torch).items()):
                rows.append({"model": family, "format": fmt, "op": name, "values": values, "differing": differing,
                             "share": differing / values if values else 0.0, "max_ulp": ulp,
                             "normwise_eps": normwise / EPSILON[fmt]})
    result = {"torch": torch.__version__, "tiers": _tiers(), "rows": rows}
    write_report("emulate_op_bounds", "float32 rounded once vs torch's own CPU low-precision kernels, per op", result,
                 rows, [("model", "model"), ("format", "format"), ("op", "op"), ("values", "values"),
                        ("differing", "differing"), ("share", "share"), ("max_ulp", "max ulp"),
                        ("normwise_eps", "max normwise distance (epsilons)")],
                 [f"torch {torch.__version__}; {_tiers()}; one intra-op thread; every call of one training step "
                  "under real CPU autocast (step 0, random init).",
                  "ulps along the format's ordered bit patterns: a result near zero where the sum cancels counts "
                  "many ulps of its own small magnitude; the normwise column (worst call) is the scale-free figure.",
                  "Under the CPU table these ops run torch's kernel (0 ulp by construction); under the CUDA table, "
                  "and wherever this page's figures are quoted for fpemu's model, they compute in float32 and round "
                  "once."])
    return result


if __name__ == "__main__":
    main()

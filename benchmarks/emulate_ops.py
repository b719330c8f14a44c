"""How far each emulated op is from torch CPU's own float16 / bfloat16 kernel: an ulp histogram per op.

The emulation computes each op in float32 and rounds once (what CUDA kernels do with their float32
opmath and accumulators); torch's CPU low-precision kernels do the same for elementwise ops (0 ulp:
tests/test_emulate_torch.py asserts it bit for bit) but accumulate matmuls and reductions in
another order or in blocks, and evaluate some functions (erf, exp in gelu_backward) with other
code.  Inputs: seeded standard normal values of the low format.  Beside the larger ops above, every
op of torch's autocast tables as fpemu/emulate/_op_samples.py calls it.  Writes reports/emulate_ops.md
and .json.  Run: python -m benchmarks.emulate_ops
"""

from __future__ import annotations

import numpy as np

from benchmarks._common import write_report

BUCKETS = ("0", "1", "2", "3-4", "5+", "nan differs")


def _tiers() -> str:
    """The CPU kernel tiers the figures depend on (torch's ATen and oneDNN kernels differ per tier)."""
    from fpemu.host import NUMERIC_CPU_FEATURES, cpu_flags, torch_cpu_tiers
    tiers = torch_cpu_tiers()
    features = [f for f in NUMERIC_CPU_FEATURES if f in cpu_flags() and f.startswith(("avx512", "amx"))]
    return (f"ATen {tiers['aten_cpu_capability']} kernels, oneDNN bf16 {'on' if tiers['onednn_bf16'] else 'off'}; "
            f"CPU {', '.join(features) or 'without AVX-512'}")


def _ops(torch):
    f = torch.nn.functional
    return {
        "mm 64x256 @ 256x64": (lambda a, b: a @ b, ((64, 256), (256, 64))),
        "bmm 8x64x64 @ 8x64x64": (torch.bmm, ((8, 64, 64), (8, 64, 64))),
        "addmm (linear with bias) 64x256": (lambda a, b: f.linear(a, b, b[:, 0]), ((64, 256), (128, 256))),
        "baddbmm 8x32x32": (lambda a, b: torch.baddbmm(a, a, b), ((8, 32, 32), (8, 32, 32))),
        "conv1d 4x16x64, 16x16x3": (lambda a, b: f.conv1d(a, b), ((4, 16, 64), (16, 16, 3))),
        "sum over 4096": (lambda a, b: a.sum(-1), ((64, 4096), (1,))),
        "sum over 64 (bias gradient)": (lambda a, b: a.sum(0), ((64, 1024), (1,))),
        "mean over 1024": (lambda a, b: a.mean(-1), ((64, 1024), (1,))),
        "softmax over 1024": (lambda a, b: torch.softmax(a, -1), ((64, 1024), (1,))),
        "log_softmax over 1024": (lambda a, b: torch.log_softmax(a, -1), ((64, 1024), (1,))),
        "layer_norm 256": (lambda a, b: f.layer_norm(a, (256,)), ((256, 256), (1,))),
        "gelu (erf)": (lambda a, b: f.gelu(a), ((65536,), (1,))),
        "gelu_backward (erf)": (lambda a, b: torch.ops.aten.gelu_backward(a, b), ((65536,), (65536,))),
        "gelu (tanh)": (lambda a, b: f.gelu(a, approximate="tanh"), ((65536,), (1,))),
        "exp": (lambda a, b: torch.exp(a), ((65536,), (1,))),
        "add": (lambda a, b: a + b, ((65536,), (65536,))),
        # the rest of CUDA autocast's low ops that run on the CPU
        "addbmm 8x32x32": (lambda a, b: torch.addbmm(a[0], a, b), ((8, 32, 32), (8, 32, 32))),
        "addmv 64x256": (lambda a, b: torch.addmv(b[:64, 0], a, b[:, 1]), ((64, 256), (256, 2))),
        "addr 64x64": (lambda a, b: torch.addr(a, a[0], b[0]), ((64, 64), (64, 64))),
        "mv 64x256": (lambda a, b: torch.mv(a, b[:, 0]), ((64, 256), (256, 1))),
        "matmul 4x64x256 @ 256x64": (torch.matmul, ((4, 64, 256), (256, 64))),
        "conv2d 2x8x16x16, 8x8x3x3": (lambda a, b: f.conv2d(a, b), ((2, 8, 16, 16), (8, 8, 3, 3))),
        "conv_transpose1d 4x16x32": (lambda a, b: f.conv_transpose1d(a, b), ((4, 16, 32), (16, 8, 3))),
        "prelu": (lambda a, b: f.prelu(a, b[:16]), ((64, 16), (16,))),
        "scaled_dot_product_attention 2x4x32x16": (lambda a, b: f.scaled_dot_product_attention(a, b, b),
                                                   ((2, 4, 32, 16), (2, 4, 32, 16))),
        "linalg_vecdot 64x256": (lambda a, b: torch.linalg.vecdot(a, b), ((64, 256), (64, 256))),
        # CUDA autocast's float32 ops, here computed in the low format (pure policies)
        "log (of |x|)": (lambda a, b: torch.log(a.abs()), ((65536,), (1,))),
        "rsqrt (of |x|)": (lambda a, b: torch.rsqrt(a.abs()), ((65536,), (1,))),
        "reciprocal": (lambda a, b: torch.reciprocal(a), ((65536,), (1,))),
        "pow 3": (lambda a, b: torch.pow(a, 3.0), ((65536,), (1,))),
        "softplus": (lambda a, b: f.softplus(a), ((65536,), (1,))),
        "cumsum over 256": (lambda a, b: torch.cumsum(a, -1), ((256, 256), (1,))),
        "mse_loss": (lambda a, b: f.mse_loss(a, b, reduction="none"), ((65536,), (65536,))),
    }


def _ordered(codes: np.ndarray, bits: int) -> np.ndarray:
    """Sign-magnitude codes as integers in value order (so a difference is an ulp count)."""
    sign = codes >> (bits - 1)
    magnitude = codes & ((1 << (bits - 1)) - 1)
    return np.where(sign == 1, -magnitude, magnitude).astype(np.int64)


def histogram(expected, got, fmt) -> dict:
    """Ulp distance between two arrays of fmt's values, bucketed."""
    import fpemu
    nan_e, nan_g = np.isnan(expected), np.isnan(got)
    both = ~nan_e & ~nan_g
    distance = np.abs(_ordered(fpemu.encode(expected[both], fmt).astype(np.int64), fmt.bits)
                      - _ordered(fpemu.encode(got[both], fmt).astype(np.int64), fmt.bits))
    counts = [int((distance == 0).sum()), int((distance == 1).sum()), int((distance == 2).sum()),
              int(((distance >= 3) & (distance <= 4)).sum()), int((distance >= 5).sum()), int((nan_e != nan_g).sum())]
    scale = float(np.abs(expected[both]).max()) if both.any() else 0.0
    worst = float(np.abs(expected[both].astype(np.float64) - got[both]).max()) if both.any() else 0.0
    return dict(zip(BUCKETS, counts)) | {"max": int(distance.max()) if distance.size else 0,
                                         "normwise": worst / scale if scale else 0.0}


def _floating(value, torch) -> list:
    """The floating results of an op as float32 arrays (complex ones as their real and imaginary parts)."""
    out = []
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            t = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
            out.append(t.float().numpy().ravel())
    return out


def _placement(name: str) -> dict:
    """{op: policy} for every op of both autocast tables: ops autocast runs low or promotes under their
    table's policy (the CUDA one where both place them), ops it runs in float32 under ``pure_<name>``."""
    import fpemu
    placed = {}
    for device in ("cuda", "cpu"):
        for op, category in fpemu.emulate.op_table(f"{device}_autocast_{name}")["ops"].items():
            if category in ("low", "promote"):
                placed.setdefault(op, f"{device}_autocast_{name}")
    for device in ("cuda", "cpu"):
        for op in fpemu.emulate.op_table(f"{device}_autocast_{name}")["ops"]:
            placed.setdefault(op, f"pure_{name}")
    return placed


def _placed_ops(torch, name: str, low) -> tuple:
    """([(op, policy, emulated values, torch's low kernel's values)], [ops with no CPU kernel in ``low``])."""
    import warnings

    import fpemu
    from fpemu.emulate._autocast_table import resolve
    from fpemu.emulate._op_samples import CPU_LESS, arguments, samples
    compared, lacking = [], []
    for op_name, policy in sorted(_placement(name).items()):
        if op_name in CPU_LESS:
            continue
        op, (wide, narrow) = resolve(op_name), arguments(samples()[op_name], low)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated ops say so
            try:
                expected = _floating(op(*narrow), torch)
            except RuntimeError:  # torch has no CPU kernel in the low format
                lacking.append(op_name)
                continue
            with fpemu.emulate_torch(policy):
                got = _floating(op(*wide), torch)
        compared.append((op_name, policy, np.concatenate(got), np.concatenate(expected)))
    return compared, lacking


def main() -> dict:
    import torch

    import fpemu
    torch.set_num_threads(1)
    rows, lacking = [], {}
    for name, dtype, policy in (("fp16", torch.float16, "pure_fp16"), ("bf16", torch.bfloat16, "pure_bf16")):
        fmt = fpemu.get_format(name)
        for label, (op, shapes) in _ops(torch).items():
            generator = torch.Generator().manual_seed(0)
            a, b = (torch.randn(shape, generator=generator).to(dtype) for shape in shapes)
            expected = op(a, b).float().numpy().ravel()
            wide_a, wide_b = a.float(), b.float()
            with fpemu.emulate_torch(policy):
                got = op(wide_a, wide_b).numpy().ravel()
            rows.append({"format": name, "op": label, "values": expected.size, **histogram(expected, got, fmt)})

        compared, lacking[name] = _placed_ops(torch, name, dtype)
        for op_name, placed_by, got, expected in compared:
            rows.append({"format": name, "op": f"{op_name} ({placed_by.removesuffix('_' + name)})",
                         "values": expected.size, **histogram(expected, got, fmt)})
    result = {"torch": torch.__version__, "rows": rows, "no_cpu_low_kernel": lacking}
    columns = [("format", "format"), ("op", "op"), ("values", "values")] + [(b, f"{b} ulp" if b[0].isdigit() else b)
                                                                           for b in BUCKETS] + [("max", "max ulp"),
                                                                           ("normwise", "max abs diff / max abs")]
    write_report("emulate_ops", "Emulated ops vs torch CPU's low-precision kernels (ulp histogram)", result, rows,
                 columns, [f"torch {torch.__version__}, CPU, one thread ({_tiers()}); inputs: seeded normal values of the format.",
                           "The rows named by an aten op (and a policy) are every op of torch's AutocastCPU and "
                           "AutocastCUDA tables, called as fpemu/emulate/_op_samples.py says (small shapes): ops "
                           "autocast runs low or promotes under their table's policy, ops it runs in float32 under "
                           "the pure policy (computed in the low format); tests/test_emulate_ops.py asserts the "
                           "bit-exact ones bit for bit.  No CPU kernel in the low format (not compared): "
                           + ", ".join(sorted(set(lacking.get("fp16", [])) | set(lacking.get("bf16", []))))
                           + "; CUDA-only: " + ", ".join(sorted(_cpu_less())) + ".",
                           "A row with every value at 0 ulp agrees bit for bit on these inputs (the elementwise ops "
                           "are asserted bit for bit by tests/test_emulate_torch.py).",
                           "Matmuls, convolutions, layer_norm: torch's CPU low-precision kernels accumulate in another "
                           "order than its float32 ones (at most 2 ulp here); the emulation models CUDA's float32 "
                           "accumulation rounded once.  log_softmax: 1 ulp on about a fifth of the values, the CPU "
                           "low-precision kernel rounding somewhere the float32 one does not (measured; not traced "
                           "to its source).",
                           "addbmm, addr, conv_transpose1d, scaled_dot_product_attention, mse_loss, bf16 pow: "
                           "further apart: many ulp only where a result cancels to near zero, the normwise "
                           "difference (last column) within about one epsilon of the format (fp16 2^-10, bf16 2^-7): "
                           "what rounding an intermediate result gives, where the emulation rounds once (measured; "
                           "not traced to the kernels' source).",
                           "Ops autocast runs in float32, here computed in the low format (the '(pure)' rows): the "
                           "reductions and losses (prod, logsumexp, mse_loss, nll_loss, rms_norm, renorm) 1 ulp where "
                           "the CPU kernel accumulates otherwise; grid samplers and linear, bicubic and trilinear "
                           "upsampling further apart where the CPU low kernels compute their interpolation weights "
                           "in the low format (measured; autocast keeps these ops in float32, so its policies never "
                           "compute them low).",
                           "gelu (erf): float32 gives +0 where the low kernels give -0 (x << 0): counted as 0 ulp "
                           "here (the sign of zero is tested separately); gelu_backward: the low kernels evaluate "
                           "erf and exp with other code."])
    return result


def _cpu_less() -> dict:
    from fpemu.emulate._op_samples import CPU_LESS
    return CPU_LESS


if __name__ == "__main__":
    main()

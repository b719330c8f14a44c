"""What a framework really computes in a mixed-precision step, as one frozen value.

Every way in which JAX (XLA on the CPU) and torch eager compute something other
than the literal float32/bf16 reading of a training step is a field of
:class:`StepSemantics`; the named presets in :data:`SEMANTICS` reproduce a real
implementation bit for bit (see ``docs/steps.md`` for what each field models and
how it was found).
"""

from __future__ import annotations

import dataclasses

DOT_ORDERS = ("xla_cpu", "torch_cpu", "sequential", "blas")
REDUCE_ORDERS = ("xla_cpu", "torch_cpu", "inductor_cpu", "sequential", "pairwise")
FITTED_ORDERS = ("xla_cpu", "torch_cpu", "inductor_cpu")
FITTED_MAX_DIM = 4  # the fitted orders were probed for B, D, K in 1..4 only
# The compute formats each fitted order was checked for against its framework (torch has no fp8
# arithmetic on the CPU; torch.compile's tests run bf16).
FITTED_COMPUTE = {"xla_cpu": ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"), "torch_cpu": ("bf16", "fp16"),
                  "inductor_cpu": ("bf16",)}


@dataclasses.dataclass(frozen=True)
class StepSemantics:
    """The rounding behaviour of one implementation of the step.

    Attributes:
      name: preset name, recorded in traces and reports.
      excess_precision: XLA's ``--xla_allow_excess_precision`` (true by default): inside a
        fusion, f32 -> bf16 -> f32 convert pairs are dropped, so the bias add's result is not
        rounded to the compute format, nor is the weight gradient of a 1x1 weight (fused
        with the unscale).  False: every low-precision op rounds its result.  It concerns
        bf16 only: XLA:CPU computes f16 ops natively, each rounded, in both modes.
      fp8_ops_in_fp16: XLA:CPU computes an fp8 op (dot, add, reduction step) in f16 and
        converts the f16 result to fp8, so op results are rounded twice, float32 -> fp16 ->
        fp8, while the program's own converts (``astype``) round once.
      fp16_fma: the CPU has AVX512-FP16, so LLVM computes f16 ops natively and contracts an f16
        multiply and the f16 add it feeds into one f16 FMA (XLA sets ``AllowFPOpFusion=Fast``).
        In the step that is the fp16 prediction ``x * w + b`` with D == 1, where XLA turns the
        dot into a multiply fused with the bias add: rounded once, not twice.  fp8 rounds the
        product to fp8 before the add and bf16 ops are float32 ops, so only fp16 changes.
        ``--xla_cpu_max_isa`` below AVX512_FP16 turns it off.
      avx512_sgemm: XLA:CPU computes every low-precision dot as a float32 dot of the upcast
        operands, run by Eigen's contraction, which calls oneDNN's sgemm; oneDNN picks its kernel
        from the CPU at run time (``ONEDNN_MAX_CPU_ISA`` caps it; ``--xla_cpu_max_isa`` does not).
        The AVX2 kernel (False) pairs even and odd terms for a contraction of 4 with 4 rows or
        columns (``dot="xla_cpu"``); the AVX-512 kernel (True) accumulates every matrix-matrix dot
        as one FMA chain from +0.  Matrix-vector dots are Eigen's own GEMV: the same on both.
      flush_subnormals: every float32 op runs with x86 FTZ + DAZ (XLA:CPU sets MXCSR):
        subnormal operands read as signed zero and results tiny after rounding become
        signed zero.  Casts to the compute format are not affected.
      fma: contract ``p - lr * g`` (and the ``sequential`` reduce accumulation) into fused
        multiply-adds with one rounding.
      dot: accumulation of the low-precision matmuls (exact products, float32 sums, one
        rounding to the compute format): ``xla_cpu`` (XLA/Eigen's shape-dependent fused and
        unfused chains), ``torch_cpu`` (ATen's bf16 matmul: unfused forward, fused
        transposed weight gradient), ``sequential`` (from +0 over the contraction), ``blas`` (numpy's
        float32 matmul, order unspecified: for traces, not for bit-exact checks).
      reduce: order of the loss's sum and of the bias gradient's batch sum: ``xla_cpu``
        (LLVM's reassociated, FMA-contracted loops; with fp8 converts in the fusion the loss is
        summed row by row in 4-lane vectors), ``torch_cpu`` (ATen's 4-way ILP and
        8-lane vector sum), ``inductor_cpu`` (torch.compile's generated C++: the loss is one
        masked 16-lane vector reduced by a butterfly ``i + (i ^ 8)``, ``^ 4``, ``^ 2``, ``^ 1``;
        the bias gradient's batch sum is unrolled as ``((r0 + r1) + r2) + r3``, no +0 start),
        ``sequential``, ``pairwise`` (numpy's sum).
      mean_by_reciprocal: the mean multiplies by float32(1/n) (XLA folds the divide);
        False divides by n (torch).
      folded_cotangent: the loss cotangent is ``sub * f32(S * f32(2/n))`` (XLA folds the
        constants; ``S * (sub * 2)`` when n == 1); False: ``(S / n) * (2 * sub)`` as
        autograd's MeanBackward and PowBackward chain it (torch).
      bias_grad_rounds_partials: the bias gradient's batch sum rounds every partial sum to
        the compute format (XLA keeps the bf16 reducer); False accumulates in float32 and
        rounds once (torch).
      fused_bias_add: the bias is added to the float32 matmul accumulator before the one
        rounding to the compute format (ATen's bf16 ``addmm``, which torch.compile forms from
        ``x @ w + b``); False rounds the product, adds the bias and rounds again (eager).
      bias_grad_rounded: the bias gradient is rounded to the compute format.  False: kept in
        float32 (torch.compile's unrolled batch sum elides the bf16 -> float32 convert pair).
      inductor_decompositions: the linear step is computed as torch.compile's generated CPU code
        for every shape (``fpemu.steps.model.inductor_forward_backward``): where B, D or K is 1,
        inductor decomposes ``addmm``/``mm`` (``torch/_inductor/decomposition.py``) into fused
        pointwise code whose bf16 casts depend on the shape class (docs/steps.md).  Needs
        ``reduce="inductor_cpu"``; one dense layer only.
      unscale_by_reciprocal: unscale as ``g * f32(1/S)`` (torch's GradScaler); False
        divides ``g / S`` (the seed, and both frameworks' literal ``grad / S``).
    """

    name: str
    excess_precision: bool = False
    fp8_ops_in_fp16: bool = False
    fp16_fma: bool = False
    avx512_sgemm: bool = False
    flush_subnormals: bool = False
    fma: bool = False
    dot: str = "sequential"
    reduce: str = "sequential"
    mean_by_reciprocal: bool = False
    folded_cotangent: bool = False
    bias_grad_rounds_partials: bool = False
    unscale_by_reciprocal: bool = False
    fused_bias_add: bool = False
    bias_grad_rounded: bool = True
    inductor_decompositions: bool = False

    def __post_init__(self):
        if self.dot not in DOT_ORDERS:
            raise ValueError(f"dot must be one of {DOT_ORDERS}, got {self.dot!r}")
        if self.reduce not in REDUCE_ORDERS:
            raise ValueError(f"reduce must be one of {REDUCE_ORDERS}, got {self.reduce!r}")
        if not self.bias_grad_rounded and self.bias_grad_rounds_partials:
            raise ValueError("bias_grad_rounds_partials contradicts bias_grad_rounded=False")
        if self.inductor_decompositions and self.reduce != "inductor_cpu":
            raise ValueError("inductor_decompositions needs reduce='inductor_cpu'")
        if self.reduce == "pairwise" and self.bias_grad_rounds_partials:
            raise ValueError("bias_grad_rounds_partials needs an ordered reduce, not 'pairwise'")

    @property
    def fitted(self) -> bool:
        """Whether an order was fitted to one implementation for small shapes only."""
        return self.dot in FITTED_ORDERS or self.reduce in FITTED_ORDERS



_XLA = dict(fp8_ops_in_fp16=True, flush_subnormals=True, fma=True, dot="xla_cpu", reduce="xla_cpu", mean_by_reciprocal=True,
            folded_cotangent=True, bias_grad_rounds_partials=True)

# XLA:CPU's CPU tiers (docs/steps.md): the preset suffix, and what that tier computes differently.
XLA_CPU_TIERS = {
    "avx2": ("", {}),                                                  # oneDNN's AVX2 sgemm
    "avx512": ("_avx512", {"avx512_sgemm": True}),                    # AVX-512 without AVX512-FP16
    "avx512fp16": ("_avx512fp16", {"avx512_sgemm": True, "fp16_fma": True}),  # Sapphire Rapids and later
}


def _xla_presets() -> dict:
    """jax.jit on XLA:CPU (jax 0.10, x86-64) on each CPU tier: with default flags (``jax_cpu``: bf16
    adds kept in float32) and with XLA_FLAGS=--xla_allow_excess_precision=false (``jax_cpu_strict``,
    the flags that give the seed's outputs)."""
    presets = {}
    for mode, excess in (("jax_cpu", True), ("jax_cpu_strict", False)):
        for suffix, fields in XLA_CPU_TIERS.values():
            presets[mode + suffix] = StepSemantics(mode + suffix, excess_precision=excess, **fields, **_XLA)
    return presets


SEMANTICS = {
    # The seed's text read literally: IEEE float32 ops in program order, every bf16 op rounded.
    "seed": StepSemantics("seed"),
    **_xla_presets(),
    # torch eager on the CPU (torch 2.13): no FTZ, no FMA, ATen's sum order.
    "torch_cpu": StepSemantics("torch_cpu", dot="torch_cpu", reduce="torch_cpu"),
    # torch's optimizer-side unscale: GradScaler multiplies by float32(1/S).
    "torch_cpu_grad_scaler": StepSemantics("torch_cpu_grad_scaler", dot="torch_cpu", reduce="torch_cpu",
                                           unscale_by_reciprocal=True),
    # torch.compile (inductor, CPU, torch 2.13) of the same bf16 step, B, D, K in 1..4
    # (docs/steps.md): with B, D, K >= 2 inductor calls ATen's addmm and mm (fused bias add,
    # butterfly loss sum, unrounded float32 bias gradient); with a dimension of 1 it decomposes
    # them into pointwise code that skips casts shape class by shape class.
    "torch_cpu_compiled": StepSemantics("torch_cpu_compiled", dot="torch_cpu", reduce="inductor_cpu",
                                        fused_bias_add=True, bias_grad_rounded=False,
                                        inductor_decompositions=True),
    # Fast, shape-independent semantics for model-driven traces (BLAS matmul, numpy sums).
    "numpy": StepSemantics("numpy", dot="blas", reduce="pairwise"),
}

DEFAULT_SEMANTICS = "jax_cpu_strict"


def get_semantics(mode) -> StepSemantics:
    """A preset by name, or a :class:`StepSemantics` passed through.

    Raises:
      ValueError: unknown preset name (the message lists them).
      TypeError: neither a name nor a StepSemantics.
    """
    if isinstance(mode, StepSemantics):
        return mode
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a preset name or a StepSemantics, got {type(mode).__name__}")
    if mode not in SEMANTICS:
        raise ValueError(f"mode: unknown semantics {mode!r}; presets: {', '.join(SEMANTICS)}")
    return SEMANTICS[mode]

"""Adapters drive real implementations through the same scenarios as the reference models.

Every adapter is one row of :data:`ADAPTERS`: an :class:`Adapter` descriptor says what
it drives, which packages it needs, on which devices it runs, which profile its
traces are compared with and against which versions that comparison was made.
Adding a framework is one adapter module, one profile and one row here.

Each adapter module imports its framework on first use, so ``import fpemu`` never
needs torch or JAX.  ``unavailable_reason(name, device)`` says why an adapter
cannot run here (None when it can).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Optional

from fpemu.host import installed_versions
from fpemu.ranks import LAYOUTS
from fpemu.traces.fields import OBSERVED_FIELDS

SCALER, STEP, RECIPE, RANKS = "scaler", "step", "recipe", "ranks"
BLOCKS = "blocks"  # a block quantizer, compared with fpemu.block_quantize by tests/test_real_torchao_blocks.py
FP8_TRAINING = "fp8_training"  # a model trained for real under an fp8 recipe ([fp8_training] specs)
ADAPTER_KINDS = (SCALER, STEP, RECIPE, RANKS, BLOCKS, FP8_TRAINING)
IN_VERSION_SET = "FPEMU_IN_VERSION_SET"  # "1": this process runs in a matrix's environment (Adapter.isolated_in)
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One real implementation fpemu can drive.

    Attributes:
      name: the adapter's name in specs (``[implementations.NAME]``), ``--impl`` and traces.
      kind: ``"scaler"`` (driven through a scenario's overflow flags, compared with a scaler
        profile), ``"step"`` (runs seed 002's mixed-precision step on a [step] scenario's data),
        ``"recipe"`` (an fp8 scaling recipe driven through a [recipe] scenario's amaxes),
        ``"ranks"`` (a data-parallel layout run on several ranks, fpemu.ranks) or
        ``"blocks"`` (a block quantizer taking ``(x, element_format, scale_rule)``, compared with
        :func:`fpemu.block_quantize`; no scenario drives it) or ``"fp8_training"`` (a model trained
        for real under an fp8 recipe, an [fp8_training] scenario: fpemu.kinds.fp8_training).
      entry: ``"module:function"``.  Scaler entries take ``(overflows, params, device)`` and
        return a :class:`~fpemu.scalers.ScalerTrace`; step entries take ``(compute, device,
        params)`` and return a function of one step's arguments; recipe entries take ``(amaxes,
        params, device)`` and return ``{"amax", "amax_used", "scale", "scale_inv"}`` lists; ranks
        entries take ``(cases, world_size, device)`` and return a CaseResult per case
        (fpemu.adapters.torch_ranks); fp8 training entries take ``(recipe, steps, seed, sizes, batch,
        lr)`` and return (loss, casts) per step.
      packages: the distributions it imports (their versions go into every trace it records).
      modules: the top-level modules it imports, checked before it runs.
      devices: where it can run.
      profile: scaler adapters: the profile whose parameters it takes and whose model its
        traces are compared with; recipe adapters: the recipe it runs (fpemu.scalers.fp8_recipes.RECIPES).
      params: step adapters: each parameter it takes and the values it accepts, the default
        first (a [step] scenario whose own field of that name holds an accepted value uses it).
      verified: the package versions its comparison with fpemu's model was made on.
      environment: the isolated environment it runs in (``fpemu.environments``) when its
        packages cannot share the project's; None to run in this process.
      check: ``"module:function"`` returning why it cannot run beyond missing modules (a package
        tree outside site-packages that is absent, ...), or None when it can; None for no check.
      versions: ``"module:function"`` returning the versions of what it runs that ``packages``
        cannot see here (a tree outside site-packages), merged into its traces' provenance.
      fields: scaler and recipe adapters: the step-record fields its traces hold.
      by_default: a scaler spec without [implementations] runs it when it is its profile's adapter;
        False for heavy drivers that take only some of the profile's parameters (the DeepSpeed
        engine takes a power-of-two initial scale), which run where a spec names them.
    """

    name: str
    kind: str
    entry: str
    packages: tuple
    modules: tuple
    devices: tuple = ("cpu",)
    profile: Optional[str] = None
    params: dict = dataclasses.field(default_factory=dict)
    verified: tuple = ()
    environment: Optional[str] = None
    check: Optional[str] = None
    versions: Optional[str] = None
    fields: tuple = OBSERVED_FIELDS
    by_default: bool = True

    def __post_init__(self):
        if self.kind not in ADAPTER_KINDS:
            raise ValueError(f"adapter {self.name!r}: kind must be one of {ADAPTER_KINDS}, got {self.kind!r}")
        if (self.kind in (SCALER, RECIPE)) != (self.profile is not None):
            raise ValueError(f"adapter {self.name!r}: a scaler (recipe) adapter names its profile (recipe), "
                             "a step adapter none")
        unknown = set(self.devices) - set(DEVICES)
        if unknown:
            raise ValueError(f"adapter {self.name!r}: unknown devices {sorted(unknown)}; devices: {DEVICES}")

    def function(self):
        """The entry point, imported now."""
        return _imported(self.entry)

    @property
    def isolated_in(self) -> Optional[str]:
        """The environment its calls go to, or None to run here: an adapter with an ``environment``
        runs here when this process is itself a version set's environment (``fpemu matrix`` sets
        :data:`IN_VERSION_SET`), whose packages are the ones to drive."""
        return None if os.environ.get(IN_VERSION_SET) == "1" else self.environment

    def extra_versions(self) -> dict:
        """What its ``versions`` hook reports ({} without one)."""
        return _imported(self.versions)() if self.versions else {}


def _imported(entry: str):
    module, _, attribute = entry.partition(":")
    return getattr(importlib.import_module(module), attribute)



_TORCH_VERIFIED = ("torch 2.13.0+cpu",)
_DS_0_17 = "fpemu.adapters.deepspeed_scaler:"  # the 0.17.0 tree: outside site-packages, checked by hooks
_WITH_HYSTERESIS = OBSERVED_FIELDS + ("hysteresis",)  # DeepSpeed and megatron expose their budget
_JAX_VERIFIED = ("jax 0.10.2", "jaxlib 0.10.2")
_TE = "fpemu.adapters.te_recipes:"
_TE_VERIFIED = ("transformer_engine (source) d0067d0da6cb", "pydantic 2.13.4") + _TORCH_VERIFIED
_RECIPE_FIELDS = ("scale", "amax", "amax_used", "scale_inv")  # scale_inv: only where the real code computes it

ADAPTERS = {adapter.name: adapter for adapter in [
    Adapter("torch", SCALER, "fpemu.adapters.torch_amp:record_torch", ("torch",), ("torch",),
            devices=DEVICES, profile="torch", verified=_TORCH_VERIFIED),
    Adapter("torch_sharded", SCALER, "fpemu.adapters.torch_amp:record_torch_sharded", ("torch",), ("torch",),
            devices=DEVICES, profile="torch_sharded", verified=_TORCH_VERIFIED),
    Adapter("jmp", SCALER, "fpemu.adapters.jax_scalers:record_jmp", ("jax", "jaxlib", "jmp"), ("jax", "jmp"),
            profile="jmp", verified=_JAX_VERIFIED + ("jmp 0.0.4",)),
    Adapter("jmp_eager", SCALER, "fpemu.adapters.jax_scalers:record_jmp_eager", ("jax", "jaxlib", "jmp"),
            ("jax", "jmp"), profile="jmp_eager", verified=_JAX_VERIFIED + ("jmp 0.0.4",)),
    Adapter("flax", SCALER, "fpemu.adapters.jax_scalers:record_flax", ("jax", "jaxlib", "flax"), ("jax", "flax"),
            profile="flax", verified=_JAX_VERIFIED + ("flax 0.12.8",)),
    Adapter("keras", SCALER, "fpemu.adapters.keras_scaler:record_keras", ("jax", "jaxlib", "keras"),
            ("jax", "keras"), profile="keras", verified=_JAX_VERIFIED + ("keras 3.15.1",)),
    # API-level behaviour across Keras releases (matrices/keras3.toml): what the public
    # ``iterations`` counts, and whether ``clipnorm=`` is accepted and what it clips.
    Adapter("keras_iterations", SCALER, "fpemu.adapters.keras_scaler:record_keras_iterations",
            ("jax", "jaxlib", "keras"), ("jax", "keras"), profile="keras", verified=_JAX_VERIFIED + ("keras 3.15.1",),
            by_default=False),
    Adapter("keras_clipnorm", SCALER, "fpemu.adapters.keras_scaler:record_keras_clipnorm",
            ("jax", "jaxlib", "keras"), ("jax", "keras"), profile="keras", verified=_JAX_VERIFIED + ("keras 3.8.0",),
            fields=OBSERVED_FIELDS + ("update_ratio",), by_default=False),
    Adapter("optax", SCALER, "fpemu.adapters.jax_scalers:record_optax", ("jax", "jaxlib", "optax"),
            ("jax", "optax"), profile="optax", verified=_JAX_VERIFIED + ("optax 0.2.8",)),
    Adapter("paddle_cpu", SCALER, "fpemu.adapters.paddle_scaler:record_paddle", ("paddlepaddle", "numpy"), ("paddle",),
            profile="paddle_cpu", verified=("paddlepaddle 3.3.1", "numpy 2.3.5"), environment="paddle"),
    Adapter("tf_keras", SCALER, "fpemu.adapters.tf_keras_scaler:record_tf_keras", ("tf_keras", "tensorflow"),
            ("tf_keras", "tensorflow"), profile="tf_keras", verified=("tf_keras 2.21.0", "tensorflow 2.21.0"),
            environment="tf_keras"),
    Adapter("tf_keras_legacy", SCALER, "fpemu.adapters.tf_keras_scaler:record_tf_keras_legacy",
            ("tf_keras", "tensorflow"), ("tf_keras", "tensorflow"), profile="tf_keras",
            verified=("tf_keras 2.21.0", "tensorflow 2.21.0"), environment="tf_keras"),
    # DeepSpeed runs in worker processes (one per DeepSpeed); the *_0_17 rows drive the 0.17.0 tree
    # (deepspeed_scaler.tree_0_17()), so their only distribution visible here is torch.
    Adapter("deepspeed", SCALER, "fpemu.adapters.deepspeed_scaler:record_deepspeed", ("deepspeed", "torch"),
            ("deepspeed", "torch"), profile="deepspeed", verified=("deepspeed 0.19.8",) + _TORCH_VERIFIED, fields=_WITH_HYSTERESIS),
    Adapter("deepspeed_0_17", SCALER, "fpemu.adapters.deepspeed_scaler:record_deepspeed_0_17", ("torch",),
            ("torch",), profile="deepspeed_0_17", verified=("deepspeed 0.17.0",) + _TORCH_VERIFIED,
            check=_DS_0_17 + "tree_0_17_unavailable", versions=_DS_0_17 + "tree_0_17_versions", fields=_WITH_HYSTERESIS),
    Adapter("deepspeed_legacy", SCALER, "fpemu.adapters.deepspeed_scaler:record_deepspeed_legacy", ("torch",),
            ("torch",), profile="deepspeed_legacy", verified=("deepspeed 0.17.0",) + _TORCH_VERIFIED,
            check=_DS_0_17 + "tree_0_17_unavailable", versions=_DS_0_17 + "tree_0_17_versions", fields=_WITH_HYSTERESIS),
    Adapter("deepspeed_fp16_optimizer", SCALER, "fpemu.adapters.deepspeed_scaler:record_deepspeed_fp16_optimizer",
            ("deepspeed", "torch"), ("deepspeed", "torch"), profile="deepspeed_fp16_optimizer",
            verified=("deepspeed 0.19.8",) + _TORCH_VERIFIED),
    Adapter("deepspeed_fp16_optimizer_0_17", SCALER,
            "fpemu.adapters.deepspeed_scaler:record_deepspeed_fp16_optimizer_0_17", ("torch",), ("torch",),
            profile="deepspeed_fp16_optimizer", verified=("deepspeed 0.17.0",) + _TORCH_VERIFIED,
            check=_DS_0_17 + "tree_0_17_unavailable", versions=_DS_0_17 + "tree_0_17_versions"),
    # The engine at ZeRO 0, 1 and 2: ZeRO-0 wraps the optimizer in FP16_UnfusedOptimizer, whose scale
    # rule is FP16_Optimizer's; ZeRO-1/2 keep a DynamicLossScaler.
    *(Adapter(f"deepspeed_zero{stage}", SCALER, f"fpemu.adapters.deepspeed_scaler:record_deepspeed_zero{stage}",
              ("deepspeed", "torch"), ("deepspeed", "torch"),
              profile="deepspeed_fp16_optimizer" if stage == 0 else "deepspeed",
              verified=("deepspeed 0.19.8",) + _TORCH_VERIFIED, fields=("scale", "overflow", "applied", "update_ratio"),
              by_default=False)
      for stage in (0, 1, 2)),
    Adapter("megatron", SCALER, "fpemu.adapters.megatron_scaler:record_megatron", ("megatron-core", "torch"),
            ("megatron", "torch"), devices=DEVICES, profile="megatron",
            verified=("megatron-core 0.16.1",) + _TORCH_VERIFIED, fields=_WITH_HYSTERESIS),
    Adapter("megatron_constant", SCALER, "fpemu.adapters.megatron_scaler:record_megatron_constant",
            ("megatron-core", "torch"), ("megatron", "torch"), devices=DEVICES, profile="megatron_constant",
            verified=("megatron-core 0.16.1",) + _TORCH_VERIFIED),
    # Multi-rank runs (fpemu.ranks): one row per layout; the entry forks the ranks of a batch of cases.
    *(Adapter(layout.adapter, RANKS, "fpemu.adapters.torch_ranks:run_cases", layout.packages,
              tuple(name.partition("-")[0] for name in layout.packages),
              devices=layout.devices,
              verified=layout.verified + _TORCH_VERIFIED) for layout in LAYOUTS.values()),
    Adapter("jax_step", STEP, "fpemu.adapters.jax_step:step_function", ("jax", "jaxlib"), ("jax",),
            params={"mode": ("jax_cpu_strict", "jax_cpu")}, verified=_JAX_VERIFIED),
    Adapter("torch_step", STEP, "fpemu.adapters.torch_step:step_function", ("torch",), ("torch",),
            devices=DEVICES, params={"unscale": ("divide", "reciprocal")}, verified=_TORCH_VERIFIED),
    Adapter("torch_compile_step", STEP, "fpemu.adapters.torch_step:compiled_step_function", ("torch",), ("torch",),
            devices=DEVICES, params={"unscale": ("divide", "reciprocal")}, verified=_TORCH_VERIFIED),
    # fp8 recipes: TE's own Python recipe code run from its source tree (fpemu.adapters.te_recipes), torchao's casts
    Adapter("te_unfused", RECIPE, _TE + "record_delayed_unfused", ("torch", "pydantic"), ("torch", "pydantic"),
            profile="te_delayed_unfused", verified=_TE_VERIFIED, check=_TE + "te_source_unavailable",
            versions=_TE + "te_source_versions", fields=_RECIPE_FIELDS[:3]),
    Adapter("te_reference", RECIPE, _TE + "record_reference_current", ("torch", "pydantic"), ("torch", "pydantic"),
            profile="te_current_reference", verified=_TE_VERIFIED, check=_TE + "te_source_unavailable",
            versions=_TE + "te_source_versions", fields=_RECIPE_FIELDS),
    Adapter("torchao_float8", RECIPE, "fpemu.adapters.torchao_float8:record_amax_to_scale", ("torchao", "torch"),
            ("torchao", "torch"), profile="torchao_tensorwise", verified=("torchao 0.18.0",) + _TORCH_VERIFIED,
            fields=_RECIPE_FIELDS[:3]),
    Adapter("torchao_float8_rowwise", RECIPE, "fpemu.adapters.torchao_float8:record_rowwise_amax_to_scale",
            ("torchao", "torch"), ("torchao", "torch"), profile="torchao_rowwise",
            verified=("torchao 0.18.0",) + _TORCH_VERIFIED, fields=_RECIPE_FIELDS[:3]),
    Adapter("torchao_float8_linear", FP8_TRAINING, "fpemu.adapters.torchao_float8:train_float8_mlp",
            ("torchao", "torch"), ("torchao", "torch"), verified=("torchao 0.18.0",) + _TORCH_VERIFIED),
    Adapter("torchao_blocks", BLOCKS, "fpemu.adapters.torchao_blocks:torchao_block_quantize", ("torchao", "torch"),
            ("torchao", "torch"), devices=DEVICES, verified=("torchao 0.18.0",) + _TORCH_VERIFIED),
    Adapter("te_block_reference", BLOCKS, "fpemu.adapters.te_block_reference:te_block_quantize", ("torch",),
            ("torch",), devices=DEVICES, verified=_TE_VERIFIED[:1] + _TORCH_VERIFIED,
            check="fpemu.adapters.te_block_reference:te_reference_unavailable",
            versions="fpemu.adapters.te_block_reference:te_reference_versions"),
]}


def adapters_of_kind(kind: str) -> dict:
    """The rows of one kind, by name."""
    return {name: adapter for name, adapter in ADAPTERS.items() if adapter.kind == kind}


def get_adapter(name: str) -> Adapter:
    """The adapter called ``name``; the error lists the known ones."""
    if name not in ADAPTERS:
        raise ValueError(f"no adapter named {name!r}; adapters: {', '.join(ADAPTERS)}")
    return ADAPTERS[name]


def resolve(name: str, kind: Optional[str] = None) -> tuple:
    """``torch@cuda`` -> ("torch", "cuda"): an adapter (of ``kind``, if given) and a device it runs on
    (cpu when none is named); ValueError says what is wrong with the name.

    Example:
      >>> resolve("torch@cuda"), resolve("flax")
      (('torch', 'cuda'), ('flax', 'cpu'))
    """
    adapter, _, device = name.partition("@")
    known = ADAPTERS if kind is None else adapters_of_kind(kind)
    if adapter not in known:
        what = "implementation" if kind is None else f"implementation for a {kind} spec"
        raise ValueError(f"unknown {what}; known: {', '.join(known)}")
    device = device or "cpu"
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; devices: {', '.join(DEVICES)}")
    if device not in known[adapter].devices:
        raise ValueError(f"{adapter} runs on {', '.join(known[adapter].devices)} only")
    return adapter, device


def unavailable_reason(name: str, device: str = "cpu"):
    """None if adapter ``name`` can run here on ``device``, else the reason it cannot."""
    if name not in ADAPTERS:
        return f"no adapter named {name!r}; adapters: {', '.join(ADAPTERS)}"
    adapter = ADAPTERS[name]
    if device not in adapter.devices:
        return f"{name} runs on {', '.join(adapter.devices)}, not {device}"
    if adapter.isolated_in is not None:
        from fpemu.environments import environment_python
        if environment_python(adapter.environment) is None:
            return (f"its environment {adapter.environment!r} is not built "
                    f"(run `fpemu env build {adapter.environment}`)")
        return None
    missing = [module for module in adapter.modules if importlib.util.find_spec(module) is None]
    # every missing part at once: "pydantic not installed" alone hid that TE's source is missing too
    reasons = [f"{', '.join(missing)} not installed"] if missing else []
    if adapter.check is not None:
        reasons += filter(None, [_check_reason(adapter.check, missing)])
    if reasons:
        return "; ".join(reasons)
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine"
    return None


def _check_reason(check: str, missing) -> str:
    """What an adapter's ``check`` says is missing; nothing where the check itself needs a module that is
    missing (that module is named already)."""
    try:
        return _imported(check)() or ""
    except ImportError:
        if missing:
            return ""
        raise


def available(name: str, device: str = "cpu") -> bool:
    return unavailable_reason(name, device) is None


def package_versions(packages, environment=None) -> dict:
    """Each package's installed version, here or in an isolated environment (from its build manifest)."""
    if environment is not None:
        from fpemu.environments import environment_manifest
        installed = (environment_manifest(environment) or {}).get("packages", {})
        return {package: installed.get(package, "not installed") for package in packages}
    return installed_versions(packages)


def adapter_versions(adapter: Adapter) -> dict:
    """The versions of everything ``adapter`` runs: its packages (in its environment, if it has one)
    and what its ``versions`` hook reports (a DeepSpeed tree outside site-packages)."""
    return {**package_versions(adapter.packages, adapter.isolated_in), **adapter.extra_versions()}


def _runnable(name: str, kind: str, device: str) -> Adapter:
    adapter = get_adapter(name)
    if adapter.kind != kind:
        raise ValueError(f"adapter {name!r} is a {adapter.kind} adapter, not a {kind} adapter")
    reason = unavailable_reason(name, device)
    if reason:
        raise RuntimeError(f"adapter {name!r} cannot run: {reason}")
    return adapter


def record_scaler(name: str, overflows, device: str = "cpu", **params):
    """Drive the real scaler ``name`` through ``overflows``; returns a ScalerTrace."""
    adapter = _runnable(name, SCALER, device)
    args = ([bool(o) for o in overflows], params, device)
    if adapter.isolated_in is not None:
        from fpemu.environments import call_in_environment
        return call_in_environment(adapter.environment, adapter.entry, *args)
    return adapter.function()(*args)


def record_recipe(name: str, amaxes, device: str = "cpu", **params) -> dict:
    """Drive the real recipe code ``name`` through one amax per step: its per-step lists."""
    return _runnable(name, RECIPE, device).function()([float(a) for a in amaxes], params, device)


def train_fp8(name: str, recipe: str, device: str = "cpu", **settings) -> list:
    """Train the real fp8 model ``name`` under ``recipe``: per step, (its loss, its casts in call order)
    (``settings``: steps, seed, sizes, batch, lr; see fpemu.adapters.torchao_float8.train_float8_mlp)."""
    return _runnable(name, FP8_TRAINING, device).function()(recipe, **settings)


def step_function(name: str, compute: str, device: str = "cpu", **params):
    """The real step ``name`` as a function of one step's arguments (see mixed_precision_step)."""
    return _runnable(name, STEP, device).function()(compute, device, params)


def driven_rules(name: str) -> tuple:
    """The scale rules (fpemu.blocks.SCALE_RULES keys) the blocks adapter ``name`` runs: its module's
    ``DRIVEN_RULES`` (read without importing its framework).

    Example:
      >>> driven_rules("te_block_reference")
      ('te_nvfp4_reference', 'te_mxfp8_reference')
    """
    adapter = get_adapter(name)
    if adapter.kind != BLOCKS:
        raise ValueError(f"adapter {name!r} is a {adapter.kind} adapter, not a {BLOCKS} adapter")
    return importlib.import_module(adapter.entry.partition(":")[0]).DRIVEN_RULES


def quantize_blocks(name: str, x, element_format: str, scale_rule: str, device: str = "cpu"):
    """The real block quantizer ``name`` run on ``x`` under ``scale_rule``: a fpemu.blocks.BlockQuantized."""
    return _runnable(name, BLOCKS, device).function()(x, element_format, scale_rule, device)

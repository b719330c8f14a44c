"""torchao.float8 dynamic scaling, driven for real on the CPU: its cast functions and Float8Linear.

The casts are torchao's own ``hp_tensor_to_float8_dynamic`` and ``amax_to_scale``.  Float8Linear is
trained for real; :func:`watching_casts` records each cast it makes (the high-precision tensor,
the arguments, torchao's scale and fp8 codes) by wrapping that function for the duration of a
``with`` block, calling through to it unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

FP8_DTYPES = {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# The casts Float8Linear makes per step, in call order (float8_linear.py, matmul_with_hp_or_float8_args).
LINEAR_CASTS = ("input", "weight", "grad_output", "weight_for_grad_input", "grad_output_for_grad_weight",
                "input_for_grad_weight")


def linear_cast_names(layers: int) -> tuple:
    """The name of every cast a stack of ``layers`` Float8Linear layers makes in one step, in call order:
    each layer's forward casts in layer order, then each layer's backward casts in reverse layer order.

    Example:
      >>> linear_cast_names(2)[:3], linear_cast_names(2)[4]
      (('layer0.input', 'layer0.weight', 'layer1.input'), 'layer1.grad_output')
    """
    forward = [f"layer{layer}.{name}" for layer in range(layers) for name in LINEAR_CASTS[:2]]
    backward = [f"layer{layer}.{name}" for layer in reversed(range(layers)) for name in LINEAR_CASTS[2:]]
    return tuple(forward + backward)


def _torch_dtype(fp8_format: str):
    import torch
    return getattr(torch, FP8_DTYPES[fp8_format])


def _format_name(dtype) -> str:
    return next(name for name, torch_name in FP8_DTYPES.items() if str(dtype).endswith(torch_name))


def _granularity(scaling_granularity) -> str:
    return "tensorwise" if scaling_granularity.value == "tensorwise" else "rowwise"


def amax_to_scale(amaxes, fp8_format: str = "fp8_e4m3fn", power_of_2: bool = False) -> np.ndarray:
    """torchao's ``amax_to_scale`` on float32 amaxes: the float32 scales."""
    import torch
    from torchao.float8.float8_utils import amax_to_scale as real
    amax = torch.as_tensor(np.asarray(amaxes, dtype=np.float32))
    return real(amax, _torch_dtype(fp8_format), round_scales_to_power_of_2=power_of_2).numpy()


def record_amax_to_scale(amaxes, params, device) -> dict:
    """The recipe adapter ``torchao_float8``: torchao's ``amax_to_scale`` of each step's amax (a tensorwise
    tensor per step; ``params``: ``fp8_format``, ``power_of_2``)."""
    held = np.asarray(amaxes, dtype=np.float32)
    scales = amax_to_scale(held, params.get("fp8_format", "fp8_e4m3fn"), params.get("power_of_2", False))
    return {"amax": held.tolist(), "amax_used": held.tolist(), "scale": scales.tolist()}


def record_rowwise_amax_to_scale(amaxes, params, device) -> dict:
    """The recipe adapter ``torchao_float8_rowwise``: torchao's rowwise (axiswise) cast of one tensor
    whose row t is ``[amax_t, 0]``, so its own ``tensor_to_amax`` along the rows gives each step's
    amax and its ``amax_to_scale`` each step's scale, as a Float8Linear rowwise recipe computes the
    scales of a tensor's rows (``params``: ``fp8_format``, ``power_of_2``).

    Example:
      >>> record_rowwise_amax_to_scale([2.0, 448.0], {}, "cpu")["scale"]  # doctest: +SKIP
      [224.0, 1.0]
    """
    held = np.asarray(amaxes, dtype=np.float32)
    rows = np.stack([held, np.zeros_like(held)], axis=1)
    scales, _ = quantize(rows, params.get("fp8_format", "fp8_e4m3fn"), granularity="rowwise", axis=-1,
                         power_of_2=params.get("power_of_2", False))
    return {"amax": held.tolist(), "amax_used": held.tolist(), "scale": scales.reshape(-1).tolist()}


def quantize(x, fp8_format: str = "fp8_e4m3fn", granularity: str = "tensorwise", axis: int = -1,
             power_of_2: bool = False, dtype: str = "float32") -> tuple:
    """torchao's ``hp_tensor_to_float8_dynamic`` on ``x`` (held as torch ``dtype``): (scale, fp8 codes)."""
    import torch
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    tensor = torch.as_tensor(np.asarray(x, dtype=np.float32)).to(getattr(torch, dtype))
    level = ScalingGranularity.TENSORWISE if granularity == "tensorwise" else ScalingGranularity.AXISWISE
    fp8 = hp_tensor_to_float8_dynamic(tensor, _torch_dtype(fp8_format), LinearMMConfig(), scaling_granularity=level,
                                      axiswise_dim=None if granularity == "tensorwise" else axis,
                                      round_scales_to_power_of_2=power_of_2)
    return fp8._scale.float().numpy(), fp8._data.view(torch.uint8).numpy()


@dataclasses.dataclass(frozen=True)
class ObservedCast:
    """One cast torchao made: its input, how it was asked to scale, and what it produced.

    Attributes:
      tensor: the high-precision input (float32 numpy).
      fp8_format, granularity, axis, power_of_2: the arguments (``axis`` None when tensorwise).
      amax: torchao's ``tensor_to_amax`` of the input, as its scale was computed from.
      scale: torchao's float32 scale; codes: its fp8 bit patterns.
    """

    tensor: np.ndarray
    amax: np.ndarray
    fp8_format: str
    granularity: str
    axis: object
    power_of_2: bool
    scale: np.ndarray
    codes: np.ndarray


@contextlib.contextmanager
def watching_casts():
    """Within the block, every cast Float8Linear makes is appended to the yielded list."""
    import torch
    from torchao.float8 import float8_linear
    from torchao.float8.float8_utils import tensor_to_amax
    real = float8_linear.hp_tensor_to_float8_dynamic
    seen = []

    def watched(hp_tensor, float8_dtype, linear_mm_config, **kwargs):
        out = real(hp_tensor, float8_dtype, linear_mm_config, **kwargs)
        amax = tensor_to_amax(hp_tensor.detach(), scaling_granularity=kwargs["scaling_granularity"],
                              axiswise_dim=kwargs.get("axiswise_dim"))
        seen.append(ObservedCast(hp_tensor.detach().float().numpy().copy(), amax.float().numpy().copy(),
                                 _format_name(float8_dtype),
                                 _granularity(kwargs["scaling_granularity"]), kwargs.get("axiswise_dim"),
                                 bool(kwargs.get("round_scales_to_power_of_2", False)),
                                 out._scale.detach().float().numpy().copy(),
                                 out._data.detach().view(torch.uint8).numpy().copy()))
        return out

    float8_linear.hp_tensor_to_float8_dynamic = watched
    try:
        yield seen
    finally:
        float8_linear.hp_tensor_to_float8_dynamic = real


def train_float8_mlp(recipe: str = "tensorwise", steps: int = 20, seed: int = 0, sizes=(16, 32, 16),
                     batch: int = 8, lr: float = 0.05) -> list:
    """Train a Linear-ReLU-Linear MLP converted to Float8Linear (torchao recipe ``recipe``) with SGD on
    seeded data; returns, per step, (the loss, the casts it made: :class:`ObservedCast` in call order,
    named by :func:`linear_cast_names`).  ``sizes``: each layer's input features, then the output's."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(seed)
    layers = []
    for inputs, outputs in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(inputs, outputs, bias=False), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    per_step = []
    for _ in range(steps):
        x = torch.randn(batch, sizes[0], generator=generator)
        y = torch.randn(batch, sizes[-1], generator=generator)
        with watching_casts() as casts:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if len(casts) != len(linear_cast_names(len(sizes) - 1)):  # torchao casts another set of tensors
            raise RuntimeError(f"Float8Linear ({recipe}) made {len(casts)} fp8 casts in a step of {len(sizes) - 1} "
                               f"layers; expected 6 per layer ({', '.join(LINEAR_CASTS)})")
        per_step.append((float(loss.item()), list(casts)))
    return per_step

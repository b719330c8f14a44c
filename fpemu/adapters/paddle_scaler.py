"""paddle.amp.GradScaler (dygraph), driven for real on the CPU.

Runs inside the isolated environment ``paddle`` (see :mod:`fpemu.environments`):
Paddle 3.3.1 with numpy 2.4 crashes in ``GradScaler._update()`` on its first backoff
(``float()`` of a shape-[1] tensor), so it gets numpy 2.3.5 there.  Call it as
``call_in_environment("paddle", "fpemu.adapters.paddle_scaler:record_paddle", overflows,
params, "cpu")``; the trace it returns is built from plain Python values.

On the CPU GradScaler switches itself off (its place check accepts only GPU, XPU and
custom places) unless ``grad_scaler.in_dynamic_mode`` answers False while it is
constructed, and ``scale()`` switches dynamic scaling off unless it runs under
``paddle.amp.auto_cast(dtype="float16")``.  Both are done here, nothing else is patched.
"""

from __future__ import annotations

from fpemu.adapters.observed import observed_trace


def _enabled_on_cpu(paddle, params):
    """A GradScaler that stays enabled on the CPU: its place check is skipped during __init__ only."""
    from paddle.amp import grad_scaler
    real_mode = grad_scaler.in_dynamic_mode
    grad_scaler.in_dynamic_mode = lambda: False
    try:
        return paddle.amp.GradScaler(**params)
    finally:
        grad_scaler.in_dynamic_mode = real_mode


def _count_updates(optimizer) -> list:
    """One entry per parameter update the optimizer really applies (wraps its bound method)."""
    updates = []
    real_update = optimizer._append_optimize_op
    optimizer._append_optimize_op = lambda *args, **kwargs: (updates.append(True), real_update(*args, **kwargs))[1]
    return updates


def record_paddle(overflows, params, device):
    """Drive GradScaler through ``overflows``: each step's scaled gradient is inf or 1.0.

    Returns a ScalerTrace of profile ``paddle_cpu`` (the CPU kernel's semantics).
    """
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' (the paddlepaddle CPU build; the GPU kernel is the "
                         f"source-derived profile 'paddle'), got {device!r}")
    import numpy as np
    import paddle
    paddle.set_device("cpu")
    scaler = _enabled_on_cpu(paddle, params)
    param = paddle.create_parameter([1], "float32", default_initializer=paddle.nn.initializer.Constant(0.0))
    optimizer = paddle.optimizer.SGD(learning_rate=1.0, parameters=[param])
    updates = _count_updates(optimizer)
    scales, applied, counters = [], [], []
    for overflow in overflows:
        with paddle.amp.auto_cast(dtype="float16"):
            scaler.scale(paddle.ones([1]))
        scales.append(float(scaler._scale.numpy()[0]))
        param._set_grad_ivar(paddle.to_tensor(np.array([np.inf if overflow else 1.0], np.float32)))
        before = len(updates)
        scaler.step(optimizer)
        scaler.update()
        applied.append(len(updates) > before)
        counters.append(int(scaler._incr_count))
    return observed_trace("paddle_cpu", params, overflows, scales, applied, counters,
                          float(scaler._scale.numpy()[0]))


def unscale_paddle(scaled_grads, scale):
    """GradScaler.unscale_ on the CPU: (the unscaled float32 gradients, whether it found a non-finite one)."""
    import numpy as np
    import paddle
    paddle.set_device("cpu")
    values = np.asarray(scaled_grads, np.float32)
    scaler = _enabled_on_cpu(paddle, {"init_loss_scaling": scale})
    param = paddle.create_parameter(list(values.shape), "float32")
    optimizer = paddle.optimizer.SGD(learning_rate=1.0, parameters=[param])
    param._set_grad_ivar(paddle.to_tensor(values))
    scaler.unscale_(optimizer)
    return param.grad.numpy(), bool(scaler._found_inf.numpy()[0])

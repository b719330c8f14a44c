"""tf_keras.mixed_precision.LossScaleOptimizer (dynamic), driven for real on the CPU.

Runs inside the isolated environment ``tf_keras`` (see :mod:`fpemu.environments`):
``pip install tf-keras==2.21.0`` pulls tensorflow 2.21.0, which pins h5py < 3.15 and so
would downgrade the h5py of the project's Keras.  Call it as
``call_in_environment("tf_keras", "fpemu.adapters.tf_keras_scaler:record_tf_keras", overflows,
params, "cpu")``, or ``record_tf_keras_legacy`` for the LossScaleOptimizer that wraps a
legacy (OptimizerV2) optimizer.  Both run eagerly.
"""

from __future__ import annotations

import os

from fpemu.adapters.observed import observed_trace


def _import_tf_keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import tf_keras
    return tf, tf_keras


def _check_device(device) -> None:
    if device != "cpu":
        raise ValueError(f"device must be 'cpu' (TensorFlow's CPU build), got {device!r}")


def _drive(tf, optimizer, overflows, params):
    """Each step hands apply_gradients an (unscaled) gradient of inf or 1.0 for one variable;
    the update ran when the variable moved (SGD, learning rate 1)."""
    variable = tf.Variable(0.0)
    scales, applied, counters = [], [], []
    for overflow in overflows:
        scales.append(float(optimizer.loss_scale.numpy()))
        before = float(variable.numpy())
        optimizer.apply_gradients([(tf.constant(float("inf") if overflow else 1.0, tf.float32), variable)])
        applied.append(float(variable.numpy()) != before)
        counters.append(int(optimizer.dynamic_counter.numpy()))
    return observed_trace("tf_keras", params, overflows, scales, applied, counters,
                          float(optimizer.loss_scale.numpy()))


def record_tf_keras(overflows, params, device):
    """LossScaleOptimizer around a tf_keras.optimizers.SGD (the V3 class)."""
    _check_device(device)
    tf, tf_keras = _import_tf_keras()
    optimizer = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(learning_rate=1.0), **params)
    return _drive(tf, optimizer, overflows, params)


def record_tf_keras_legacy(overflows, params, device):
    """LossScaleOptimizer around a tf_keras.optimizers.legacy.SGD (the OptimizerV2 class)."""
    _check_device(device)
    tf, tf_keras = _import_tf_keras()
    inner = tf_keras.optimizers.legacy.SGD(learning_rate=1.0)
    optimizer = tf_keras.mixed_precision.LossScaleOptimizer(inner, **params)
    return _drive(tf, optimizer, overflows, params)


def unscale_tf_keras(scaled_grads, scale):
    """LossScaleOptimizer.get_unscaled_gradients at loss scale ``scale``: the float32 values."""
    import numpy as np
    tf, tf_keras = _import_tf_keras()
    optimizer = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(), initial_scale=scale)
    grads = tf.constant(np.asarray(scaled_grads, np.float32))
    return optimizer.get_unscaled_gradients([grads])[0].numpy()

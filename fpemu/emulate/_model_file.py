"""Loading a user's model file for ``fpemu emulate`` and running it: the contract, checked.

A model file is a Python file; its framework is what it declares in ``FRAMEWORK`` (``CONTRACTS``'
keys; ``torch`` where it declares none).  A torch model file defines

* ``build(seed: int)`` returning ``(model, optimizer)``: a ``torch.nn.Module`` and its optimizer;
* ``step(model, optimizer, scaler, index: int)`` running training step ``index`` through the
  ``torch.amp.GradScaler`` interface (``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
  ``scaler.update()``) and returning the loss.

It must not enable autocast itself: the policy places the ops.  A JAX model file (``FRAMEWORK = "jax"``)
defines

* ``build(seed: int)`` returning the training state (a pytree of arrays: parameters, optimizer state);
* ``grads(state, scale, index)`` returning ``(loss, grads)``: the loss and the gradients of
  ``scale * loss`` (a JAX function, emulated; its dtypes are the program's: cast where it computes low);
* ``update(state, grads, index)`` returning the next state from the unscaled gradients.

Every way the contract can fail is an FpemuInputError naming the file (and the function, step or module).
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib

from fpemu.errors import FpemuInputError, raised, shown
from fpemu.fileio import read_text

# framework -> (the functions a model file of it defines, the contract in words)
CONTRACTS = {
    "torch": (("build", "step"), "build(seed) -> (model, optimizer) and step(model, optimizer, scaler, index) -> "
              "loss, the step using the torch.amp.GradScaler interface"),
    "jax": (("build", "grads", "update"), "FRAMEWORK = 'jax', build(seed) -> state, grads(state, scale, index) -> "
            "(loss, grads of scale * loss) and update(state, grads, index) -> state"),
}
CONTRACT = CONTRACTS["torch"][1]


def model_file_text(path) -> str:
    """The text of the model file at ``path``: FpemuInputError naming it where it is no .py file or cannot
    be read (checked before a child process starts: a missing file fails at once)."""
    path = pathlib.Path(path)
    if path.suffix != ".py":
        raise FpemuInputError(f"{path}: a model file is a Python file (.py) defining {CONTRACT}")
    return read_text(path, FpemuInputError)


def load_model_file(path) -> tuple:
    """(module, text) of the model file; its import errors are FpemuInputError naming it."""
    path = pathlib.Path(path)
    text = model_file_text(path)
    name = "fpemu_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: whatever it raises is bad input, named
        raise FpemuInputError(f"{path}: importing it raised {raised(error)}") from error
    functions, contract = CONTRACTS[framework_of(module, path)]
    for function in functions:
        if not callable(getattr(module, function, None)):
            raise FpemuInputError(f"{path}: defines no function {function}(); a model file defines {contract}")
    return module, text


def framework_of(module, path) -> str:
    """The framework the model file declares (``FRAMEWORK``), torch where it declares none."""
    framework = getattr(module, "FRAMEWORK", "torch")
    if not isinstance(framework, str) or framework not in CONTRACTS:
        known = ", ".join(map(repr, CONTRACTS))
        raise FpemuInputError(f"{path}: FRAMEWORK = {shown(framework)}; fpemu emulate runs {known}")
    return framework


def build_model(module, path, seed: int) -> tuple:
    """``module.build(seed)``, checked: a Module and an optimizer."""
    import torch
    try:
        built = module.build(seed)
    except Exception as error:
        raise FpemuInputError(f"{path}: build({seed}) raised {raised(error)}") from error
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)
            and isinstance(built[1], torch.optim.Optimizer)):
        raise FpemuInputError(f"{path}: build() returned {type(built).__name__}; it returns (model, optimizer): "
                              "a torch.nn.Module and a torch.optim.Optimizer")
    return built

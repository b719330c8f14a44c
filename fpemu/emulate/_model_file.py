"""Loading a user's model file for ``fpemu emulate`` and running it: the contract, checked.

A model file is a Python file that defines

* ``build(seed: int)`` returning ``(model, optimizer)``: a ``torch.nn.Module`` and its optimizer;
* ``step(model, optimizer, scaler, index: int)`` running training step ``index`` through the
  ``torch.amp.GradScaler`` interface (``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
  ``scaler.update()``) and returning the loss.

It must not enable autocast itself: the policy places the ops.  Every way the contract can fail is an
FpemuInputError naming the file (and the function, step or module).
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib

from fpemu.errors import FpemuInputError
from fpemu.fileio import read_text

CONTRACT = ("build(seed) -> (model, optimizer) and step(model, optimizer, scaler, index) -> loss, "
            "the step using the torch.amp.GradScaler interface")


def load_model_file(path) -> tuple:
    """(module, text) of the model file; its import errors are FpemuInputError naming it."""
    path = pathlib.Path(path)
    if path.suffix != ".py":
        raise FpemuInputError(f"{path}: a model file is a Python file (.py) defining {CONTRACT}")
    text = read_text(path, FpemuInputError)
    name = "fpemu_model_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: whatever it raises is bad input, named
        raise FpemuInputError(f"{path}: importing it raised {type(error).__name__}: {error}") from error
    for function in ("build", "step"):
        if not callable(getattr(module, function, None)):
            raise FpemuInputError(f"{path}: defines no function {function}(); a model file defines {CONTRACT}")
    return module, text


def build_model(module, path, seed: int) -> tuple:
    """``module.build(seed)``, checked: a Module and an optimizer."""
    import torch
    try:
        built = module.build(seed)
    except Exception as error:
        raise FpemuInputError(f"{path}: build({seed}) raised {type(error).__name__}: {error}") from error
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)
            and isinstance(built[1], torch.optim.Optimizer)):
        raise FpemuInputError(f"{path}: build() returned {type(built).__name__}; it returns (model, optimizer): "
                              "a torch.nn.Module and a torch.optim.Optimizer")
    return built

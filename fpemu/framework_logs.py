"""Noise the installed frameworks log on import, dropped in every fpemu process that may import them.

The CLI's own process, a job pool's workers (:mod:`fpemu.harness.pool`) and a model file's child
(:mod:`fpemu.emulate.isolated`) each call :func:`quiet_framework_logs` first: each is a fresh interpreter,
so a filter installed in one does not reach the others.
"""

from __future__ import annotations

import logging


def cuda_extension_noise(record: logging.LogRecord) -> bool:
    """False for torchao's warning that one of its CUDA extensions (``_C*.so``) does not load: on a CPU build
    of torch it is logged for each of them on every import, and none of fpemu's paths uses them."""
    message = record.getMessage()
    return not (message.startswith("Failed to load ") and "/_C" in message and ".so" in message)


def enum_registration_noise(record: logging.LogRecord) -> bool:
    """False for torch 2.13's warning that a library (torchao, on import) registers an Enum as a pytree
    constant, which torch.compile now supports natively: printed on every import, about no fpemu path."""
    return "is an Enum subclass and is now natively supported by torch.compile" not in record.getMessage()


# logger -> its filter
NOISE_FILTERS = {"torchao": cuda_extension_noise, "torch.utils._pytree": enum_registration_noise}


def quiet_framework_logs() -> None:
    """Install :data:`NOISE_FILTERS` in this process (again: a no-op, logging keeps one of each filter)."""
    for logger, keep in NOISE_FILTERS.items():
        logging.getLogger(logger).addFilter(keep)

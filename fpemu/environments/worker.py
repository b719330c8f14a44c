"""The worker side of :func:`fpemu.environments.call_in_environment`.

Run as a script by an environment's Python, it imports nothing of fpemu's own (only
the modules the calls name), so a call costs no more imports than its entry needs.
Requests and replies are pickles, each after an 8-byte big-endian length.
"""

import importlib
import os
import pickle
import struct
import sys
import traceback

FRAME = struct.Struct("!Q")


def split_entry(entry):
    """("module", "function") from "module:function"; anything else is a ValueError naming it."""
    module, sep, function = entry.partition(":") if isinstance(entry, str) else ("", "", "")
    if not (sep and module and function):
        raise ValueError(f"entry must be 'module:function', got {entry!r}")
    return module, function


def _answer(entry, args):
    try:
        module, function = split_entry(entry)
        return ("ok", getattr(importlib.import_module(module), function)(*args), "")
    except Exception as error:  # sent back; the caller raises EnvironmentCallError
        return ("error", f"{type(error).__name__}: {error}", traceback.format_exc())


def _reply_bytes(reply):
    try:
        return pickle.dumps(reply)
    except Exception as error:
        return pickle.dumps(("error", f"the result cannot be pickled: {type(error).__name__}: {error}", ""))


def serve():
    """Answer framed (entry, args) requests on stdin until it closes.

    Replies go out on the process's original stdout; file descriptor 1 is pointed at
    stderr, so whatever the called code prints (Python or C) cannot corrupt a reply.
    """
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        header = requests.read(FRAME.size)
        if len(header) < FRAME.size:
            return
        data = _reply_bytes(_answer(*pickle.loads(requests.read(FRAME.unpack(header)[0]))))
        replies.write(FRAME.pack(len(data)) + data)
        replies.flush()


if __name__ == "__main__":
    del sys.path[0]  # this script's folder: fpemu/environments' modules must not shadow top-level ones
    serve()

"""Which stack frame is the user's? A warning points at the user's line, past however many frames
of overlapddp, torch or the standard library lie between it and the call that warns."""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

PACKAGE = os.path.dirname(__file__) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
# Where site-packages lies inside the standard library's folder (no virtual environment), this
# prefix holds the installed frameworks too.
STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


def stacklevel_outside(prefixes: tuple[str, ...]) -> int:
    """The ``stacklevel``, for a ``warnings.warn`` in the caller, of the first frame whose file lies
    under none of ``prefixes`` (the outermost frame if every one does)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level

"""A warning's frame: the first one outside the given folders, however deep they go."""

from __future__ import annotations

import warnings

from overlapddp import frames


def _warn_from_inside(depth: int, prefixes: tuple[str, ...]) -> None:
    if depth:
        return _warn_from_inside(depth - 1, prefixes)
    warnings.warn("here", UserWarning, stacklevel=frames.stacklevel_outside(prefixes))


def test_the_level_passes_every_frame_under_the_prefixes() -> None:
    for depth in (0, 3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _warn_from_inside(depth, (frames.PACKAGE,))  # this file is outside the package: itself
            _warn_from_inside(depth, (__file__,))  # this file's frames passed: pytest's caller
        assert [w.filename for w in caught][0] == __file__
        assert caught[1].filename != __file__ and "pytest" in caught[1].filename


def test_the_outermost_frame_when_every_frame_is_inside() -> None:
    import sys

    depth = 0
    frame = sys._getframe()
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    assert frames.stacklevel_outside(("",)) == depth  # every file name starts with ''


def test_the_prefixes_are_folders() -> None:
    assert frames.PACKAGE.endswith("/overlapddp/") and frames.TORCH.endswith("/torch/")
    assert frames.STDLIB.endswith("/") and warnings.__file__.startswith(frames.STDLIB)

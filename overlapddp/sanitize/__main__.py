"""Run a training script, unchanged, under the race detector, as it is launched for training::

    torchrun --nproc-per-node 2 -m overlapddp.sanitize [--report-dir DIR] [--force] train.py [ARGS...]

Each rank runs ``train.py`` as ``__main__`` with ``ARGS`` in ``sys.argv`` inside
:func:`overlapddp.sanitize.detect`. Findings go to stderr as they happen and, with ``--report-dir``,
to ``DIR/rank{R}.json``. The exit status is the script's own when it failed, else 0 when nothing was
found and ``FOUND`` (3) when something was.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from overlapddp.sanitize.detector import detect

FOUND = 3


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m overlapddp.sanitize",
        description="Run SCRIPT as __main__ and report every read, write or free of an asynchronous "
                    "collective's tensors before this rank observed its completion.")
    parser.add_argument("--report-dir", metavar="DIR", help="write each rank's findings to DIR/rank{R}.json")
    parser.add_argument("--force", action="store_true",
                        help="delay each collective's result until it is observed, NaN meanwhile, so a read "
                             "the detector cannot see shows in the numbers")
    parser.add_argument("script", metavar="SCRIPT", help="the training script, run unchanged")
    parser.add_argument("args", metavar="ARGS", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    script = Path(options.script)
    if not script.is_file():
        raise SystemExit(f"python -m overlapddp.sanitize: no such script: {script}")
    sys.argv = [str(script), *options.args]
    sys.path.insert(0, str(script.resolve().parent))
    end = f"{script}:{len(script.read_text().splitlines())}"  # "the script's end": its last line
    status: int | str | None = 0
    with detect(force=options.force, report_dir=options.report_dir, end_site=end) as findings:
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit:
            status = exit.code
    if status not in (0, None):
        return status if isinstance(status, int) else 1
    return FOUND if findings else 0


if __name__ == "__main__":
    sys.exit(main())

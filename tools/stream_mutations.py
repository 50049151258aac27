"""The stream mutation matrix: each named wait, and each ``record_stream`` call site, left out in turn.

Every wait of ``overlapddp.device_streams.WAITS`` and every ``record_stream`` the package calls
through its CUDA kit is removed, one at a time, and the stream race detector's scenarios
(``tests/streams/scenarios.py``) run on the CUDA path under the NCCL model. A mutant is caught
when some scenario that is clean on the unmutated code reports a finding. Nothing is timed, so the
outcome is the same on every run. The last line is ``K/N caught``; the exit status is 0 only when
every mutant was caught.

    PYTHONPATH=$PWD python3 tools/stream_mutations.py
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overlapddp.device_streams import WAITS  # noqa: E402
from tests.streams import scenarios  # noqa: E402
from tests.streams.sim import Sim  # noqa: E402

CALL = re.compile(r"kit\.record_stream\(")


def record_sites() -> list[str]:
    """``path:line`` of every ``record_stream`` the package makes through its kit."""
    sites = []
    for path in sorted((ROOT / "overlapddp").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if CALL.search(line) and not line.lstrip().startswith("#"):
                sites.append(f"{path.relative_to(ROOT)}:{number}")
    return sites


def main() -> int:
    scenarios.one_rank_group()
    names = [n for n, (_, backend) in scenarios.SCENARIOS.items() if backend == "nccl"]
    baseline = Sim()
    clean = []
    ran: set[str] = set()
    for name in names:
        sim = Sim()
        if not scenarios.run(name, sim):
            clean.append(name)
        ran |= sim.record_sites
    print(f"{len(clean)}/{len(names)} CUDA scenarios clean without mutation")
    del baseline
    mutants = [("wait", w) for w in WAITS] + [("record_stream", s) for s in record_sites()]
    caught = 0
    for kind, target in mutants:
        if kind == "record_stream" and target not in ran:
            print(f"MISSED {kind} {target}: no scenario reaches it")
            continue
        options = {"skip_waits": frozenset({target})} if kind == "wait" else {"skip_records": frozenset({target})}
        by = next((name for name in clean if scenarios.run(name, Sim(**options))), None)
        if by is None:
            print(f"MISSED {kind} {target}")
        else:
            caught += 1
            print(f"caught {kind} {target}, by '{by}'")
    print(f"{caught}/{len(mutants)} caught")
    return 0 if caught == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())

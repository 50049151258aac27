"""The stream mutation matrix: every wait, record_stream, event record and host read of the package,
changed one call site at a time.

The call sites come from an AST walk over ``overlapddp/`` (``tests/support/streams/sites.py``): every wait
(through the CUDA kit or not: ``future.wait``, ``work.wait``, ``event.synchronize``, ...), every
``record_stream``, every event ``record`` (left out, and recorded before the last work queued on its
stream) and every host read (``.item()``, ``.tolist()``, ``float``/``int``/``bool`` of a tensor)
made without its host wait; and every event record that has a statement before it in its block,
moved above that statement in the source (with the statements that make its event). Each mutant runs
the stream race detector's scenarios (``tests/support/streams/scenarios.py``, CUDA under the NCCL model and
the CPU path under gloo's) that reach its call; it is caught when one of them, clean on the
unmutated code, reports a finding. A mutant no scenario can catch is listed with its reason in
docs/cuda.md ("Mutants argued equivalent"), which this tool reads; any other is MISSED. Nothing is
timed, so the outcome is the same on every run. The last line is ``K/N caught, A argued``; the exit
status is 0 only when none was missed.

    PYTHONPATH=$PWD python3 tools/stream_mutations.py
"""

from __future__ import annotations

import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.streams import scenarios  # noqa: E402
from tests.support.streams.sim import Mutant, Sim  # noqa: E402
from tests.support.streams.sites import call_sites, is_cast, moved, moved_records  # noqa: E402

KINDS = "wait|record_stream|record|record earlier|record moved|host sync"
ARGUED = re.compile(rf"^\| ({KINDS}) \| `([^`]+)` \| `([^`]+)` \| (.+) \|$")


def argued() -> dict[tuple[str, str, str], str]:
    """(kind, path, call) -> why the mutant changes nothing, from docs/cuda.md's table."""
    table = {}
    for line in (ROOT / "docs" / "cuda.md").read_text().splitlines():
        found = ARGUED.match(line.strip())
        if found:
            kind, path, call, why = found.groups()
            table[(kind, path, call)] = why
    return table


def reaches(mutant: Mutant, sites: set[tuple[str, str, int]]) -> bool:
    wanted = "record" if mutant.kind == "record moved" else mutant.kind
    return any(kind == wanted and path == mutant.path and mutant.first <= line <= mutant.last
               for kind, path, line in sites)


def finds(name: str, mutant: Mutant) -> bool:
    """Whether scenario ``name`` reports a finding with ``mutant`` applied."""
    if mutant.kind == "record moved":
        with moved(mutant):
            return bool(scenarios.run(name, Sim()))
    return bool(scenarios.run(name, Sim(mutant=mutant)))


def main() -> int:
    started = time.perf_counter()
    scenarios.one_rank_group()
    names = list(scenarios.SCENARIOS)
    clean: list[str] = []
    hits: dict[str, set[tuple[str, str, int]]] = {}
    for name in names:
        sim = Sim()
        if not scenarios.run(name, sim):
            clean.append(name)
        hits[name] = sim.sites
    print(f"{len(clean)}/{len(names)} scenarios clean without mutation")
    reasons = argued()
    every = call_sites() + moved_records()
    reached = {m: [n for n in clean if reaches(m, hits[n])] for m in every}
    casts = [m for m in every if is_cast(m) and not reached[m]]
    mutants = [m for m in every if m not in casts]
    print(f"{len(every)} call sites found; {len(casts)} float/int/bool calls read no tensor in any scenario "
          f"(not host reads): {', '.join(f'{m.path}:{m.first}' for m in casts)}")
    caught = argued_count = 0
    missed = []
    for mutant in mutants:
        why = reasons.get((mutant.kind, mutant.path, mutant.text))
        by = next((name for name in reached[mutant] if finds(name, mutant)), None)
        if by is not None:
            caught += 1
            print(f"caught {mutant}, by '{by}'" + (" (also argued: drop its row)" if why else ""))
        elif why is not None:
            argued_count += 1
            print(f"argued {mutant}: {why}")
        else:
            missed.append(mutant)
            print(f"MISSED {mutant}" + ("" if reached[mutant] else ": no clean scenario reaches it"))
    print(f"{time.perf_counter() - started:.0f} s")
    print(f"{caught}/{len(mutants)} caught, {argued_count} argued")
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())

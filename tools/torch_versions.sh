#!/usr/bin/env bash
# Run the parity and comm-hook tests against another torch, in a throwaway venv (not CI).
#
#   tools/torch_versions.sh 2.11.0            # torch 2.11.0 + torchvision 0.26.*, tests below
#   tools/torch_versions.sh 2.15.0 tests/test_pickling.py   # other test files instead
#
# The venv is /tmp/tv-<version>; it is reused when it already holds that torch. torchvision is the
# release paired with torch (0.<minor + 15>.*); when none is published yet it is left out and the
# scenarios that need it (resnet18) are skipped, which the summary says. PIP_CONFIG_FILE=/dev/null
# lifts this machine's global cap (/etc/xdg/pip: torch<=2.14.1) for the venv only; Linux wheels from
# PyPI bring CUDA libraries (a few GB in /tmp).
set -euo pipefail
version=${1:?usage: tools/torch_versions.sh TORCH_VERSION [TEST_FILES...]}
shift
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_parity.py tests/bucket/test_comm_hooks.py)
checkout=$(cd "$(dirname "$0")/.." && pwd)
venv=/tmp/tv-$version
minor=$(echo "$version" | cut -d. -f2)
vision="torchvision==0.$((minor + 15)).*"

export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "torch==$version" pytest numpy  # numpy: all_gather_object needs it
    "$venv/bin/pip" install -q "torch==$version" "$vision" \
        || echo "torch_versions: no $vision for torch $version; continuing without torchvision"
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
cd "$checkout"
# setup.cfg adds -q; -rs lists what was skipped and why (arguments or torchvision this torch lacks).
PYTHONPATH="$checkout" "$venv/bin/python" -m pytest -rs "${tests[@]}"

#!/usr/bin/env bash
# The Hugging Face integration (tune_trainer, split_on_oom) and the exports on transformers 4.x.
#
# The project's .venv holds transformers 5.x; this builds a throwaway virtual environment OUTSIDE
# the repository with transformers 4.4x–4.5x (and the same torch, pinned by constraints.txt), then
# runs the tests that touch transformers there: tests/integrations/test_hf*.py and
# tests/show/test_export.py. Not part of CI: it downloads packages (about 1–2 minutes the first
# time; the tests themselves take about 10 s on 2 cores).
#
# Usage: bench/check_transformers4.sh                      # transformers>=4.45,<4.50 in /tmp/tf4
#        TRANSFORMERS='transformers==4.57.6' VENV=/tmp/tf457 bench/check_transformers4.sh
# Results go in BENCHMARKS.md, "## In the loop".
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-/tmp/tf4}
TRANSFORMERS=${TRANSFORMERS:-'transformers>=4.45,<4.50'}
PY=${PY:-python3.11}

case "$VENV" in
  "$ROOT"|"$ROOT"/*) echo "VENV=$VENV is inside the repository; give a path outside it" >&2; exit 2 ;;
esac
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# every install step uses constraints.txt, so torch stays 2.13.0 (the CPU build where it lies on disk)
"$VENV/bin/python" -m pip install -q -c "$ROOT/constraints.txt" "$TRANSFORMERS" -e "$ROOT[dev]" 2>&1 \
  | grep -v "^WARNING: Location" || true
"$VENV/bin/python" - "$TRANSFORMERS" <<'EOF'
import sys

import accelerate
import torch
import transformers
from packaging.requirements import Requirement

spec = Requirement(sys.argv[1])
assert transformers.__version__ in spec.specifier, f"transformers {transformers.__version__} is not {spec}"
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: constraints.txt pins 2.13.0"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}")
EOF
cd "$ROOT"
exec timeout 600 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/integrations/test_hf.py tests/integrations/test_hf_oom.py tests/show/test_export.py

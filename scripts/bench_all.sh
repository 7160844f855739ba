#!/usr/bin/env bash
# Run both benchmarks: accuracy (benchmarks/accuracy.md, .json) and speed (benchmarks/speed.md, .json).
# Usage: scripts/bench_all.sh [--quick]
#   --quick: bench_speed.py --quick (fewer reps, no MemTracker) and bench_accuracy.py --skip-memtracker.
# Extra environment: PEERS (default /tmp/peers), where torchinfo is installed apart from memest.
# On a 2-core machine the full run takes a good while (MemTracker on 7B-class steps takes minutes).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -f .venv/bin/activate ]]; then
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi

PEERS="${PEERS:-/tmp/peers}"
speed_args=()
accuracy_args=()
for arg in "$@"; do
    case "$arg" in
        --quick) speed_args+=(--quick); accuracy_args+=(--skip-memtracker) ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "bench_all.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

# torchinfo is not a memest dependency: bench_accuracy.py imports it from $PEERS.
if ! PYTHONPATH="$PEERS" python -c "import torchinfo" >/dev/null 2>&1; then
    echo "installing torchinfo into $PEERS" >&2
    python -m pip install --quiet --target "$PEERS" torchinfo
fi

echo "== accuracy: python scripts/bench_accuracy.py ${accuracy_args[*]:-}" >&2
python scripts/bench_accuracy.py --peers "$PEERS" --out benchmarks/accuracy.md ${accuracy_args[@]+"${accuracy_args[@]}"}

echo "== speed: python scripts/bench_speed.py ${speed_args[*]:-}" >&2
python scripts/bench_speed.py --out benchmarks/speed.md ${speed_args[@]+"${speed_args[@]}"}

echo "wrote benchmarks/accuracy.md, benchmarks/accuracy.json, benchmarks/speed.md, benchmarks/speed.json" >&2

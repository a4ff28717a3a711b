#!/usr/bin/env bash
# Tessera's main job on a fresh machine (sets up .venv first): the tiny VL recipe (RADIO-tiny ViT + tiny
# Nemotron-H, colocated heterogeneous layout) trained for 20 steps on 4 local CPU ranks (gloo) with the
# synthetic data set, launched through nemo-run's CLI exactly as the README shows; then checks the run.
#   bash scripts/main.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_venv.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
run_dir="$root/runs/main"
rm -rf "$run_dir"
# nemo exits non-zero when the job fails, after printing the failing rank's last lines
if ! .venv/bin/nemo tessera finetune --factory nemotron_vl_tiny trainer.max_steps=20 trainer.resume=false \
    "trainer.run_dir=$run_dir" run.executor=local --yes; then
  echo "main: FAIL (the training job failed, see above) run_dir=$run_dir"
  exit 1
fi
# the job succeeded: summarise it, and check that it learned
.venv/bin/python - "$run_dir" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l]
rows, val = [r for r in records if "val" not in r], [r["val"]["synthetic"]["loss"] for r in records if "val" in r]
ok = (len(rows) == 20 and rows[-1]["loss"] < rows[0]["loss"] and (run / "loss.png").exists()
      and len(val) == 2 and val[1] < val[0])
print(f"main: {'PASS' if ok else 'FAIL'} steps={len(rows)} loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} "
      f"val loss {' -> '.join(f'{v:.4f}' for v in val)} run_dir={run}")
sys.exit(0 if ok else 1)
PY

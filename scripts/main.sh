#!/usr/bin/env bash
# Tessera's main job on a fresh machine (sets up .venv first): for now, `hetero.verify` on a colocated and a
# non-colocated layout on 4 local gloo ranks (CPU, no GPU needed).
#   bash scripts/main.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_venv.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
for layout in "vision=dp4@0-3;audio=dp4@0-3;language=tp2,cp2@0-3" \
              "vision=cp2@0-1;language=tp2,dp1@2-3"; do
  .venv/bin/torchrun --nproc-per-node 4 --standalone -m hetero.verify --layout "$layout" 2>&1 \
    | grep -v -E "^(W|I)[0-9]{4} |OMP_NUM_THREADS|^\*+$"
done

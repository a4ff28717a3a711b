#!/usr/bin/env bash
# Creates .venv at the repo root if missing and installs Tessera into it (editable), reusing it when
# pyproject.toml has not changed since the last install. Sourced by scripts/main.sh and scripts/test.sh.
#   bash scripts/setup_venv.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.tessera-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing Tessera and its dependencies into $venv (a few minutes the first time)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch first, alone: the CPU wheel; a resolver that sees torch already satisfied keeps it.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -e "$root[test]"
  echo "$want" > "$stamp"
fi

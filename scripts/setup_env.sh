#!/usr/bin/env bash
# Sets up a fresh machine for kroquant-jax: Debian packages the tests use (if we can install them), then a virtual
# environment in .venv with the package and all its extras (CPU torch 2.13.0, diffusers 0.42.1, test tools).
set -euo pipefail
cd "$(dirname "$0")/.."

if { [ ! -f /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf ] || [ ! -d /usr/share/iso-codes ]; } && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # The emoji testbed's dataset builder reads this font (tests build a few glyphs from it) and names flags from iso-codes.
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-noto-color-emoji iso-codes >/dev/null
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[all]"

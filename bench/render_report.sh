#!/usr/bin/env bash
# Render a report.html in headless Chromium (Debian: apt-get install -y chromium) to a PNG, to look at.
# Usage: bench/render_report.sh jobs/gpt2/report.html [out.png] [width] [height]
# Not part of the test suite: CI has no browser. The pytest tests check the HTML's content instead.
set -euo pipefail
html="$(realpath "$1")"
png="${2:-${1%.html}.png}"
width="${3:-1300}"
height="${4:-2600}"
profile_dir="$(mktemp -d)"
trap 'rm -rf "$profile_dir"' EXIT
# No network, no sync, no first-run pages: the page must render from the file alone.
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --user-data-dir="$profile_dir" --hide-scrollbars \
  --window-size="$width,$height" --screenshot="$(realpath -m "$png")" "file://$html" 2>/dev/null
echo "$png"

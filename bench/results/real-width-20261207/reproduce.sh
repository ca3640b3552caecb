#!/usr/bin/env bash
# The real-width figures (results.json, README.md here): build the pair if needed, then measure each server in turn.
# Needs about 16 GiB free; run alone (the heavy lock keeps other heavy jobs out).
set -euo pipefail
cd "$(dirname "$0")/../../.."
flock /tmp/kimi-eagle-heavy.lock .venv/bin/kimi-eagle fixtures --real-width
flock /tmp/kimi-eagle-heavy.lock .venv/bin/python bench/results/real-width-20261207/measure.py

#!/usr/bin/env bash
# The benchmarks moved to bench/ (opacus installs a top-level Python package named `benchmarks`); this wrapper keeps
# the documented command `bash benchmarks/gpu.sh` working: it runs bench/gpu.sh with the same arguments.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../bench/gpu.sh" "$@"

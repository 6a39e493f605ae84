#!/usr/bin/env bash
# Make one tree for scripts/gpu_backward_ab.sh from a revision of this repository: ab/NAME with the revision's
# mok_jax/, configs/, tests/, README.md and its native library, built here (the GPU machine cannot build it), so
# that the tree can be carried to the GPU machine by name (ab/ is for such trees; keep it out of git).
# Usage: bash scripts/ab_tree.sh NAME REV    (REV: a branch, tag or commit; the tree replaces ab/NAME)
# The build runs in a temporary worktree of REV. SASS differs between build directories (compare SASS only between
# libraries built in one directory); the bits and the speed do not.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: bash scripts/ab_tree.sh NAME REV" >&2; exit 2; }
name=$1 rev=$2
case $name in */* | . | .. | "") echo "NAME must be a plain directory name, got '$name'" >&2; exit 2 ;; esac
commit=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "not a revision of this repository: $rev" >&2; exit 2; }
src=$(mktemp -d "${TMPDIR:-/tmp}/ab-tree-$name.XXXXXX")
trap 'git worktree remove --force "$src" >/dev/null 2>&1 || true; rm -rf "$src"' EXIT
git worktree add --detach --quiet "$src" "$commit"
PYTHON=${PYTHON:-$PWD/.venv/bin/python} bash "$src/scripts/build_native.sh" > "$src/build.log" 2>&1 ||
  { tail -20 "$src/build.log" >&2; echo "ab_tree.sh: the build of $rev failed" >&2; exit 1; }
rm -rf "ab/$name"
mkdir -p "ab/$name/build/native"
cp "$src/build/native/libmok_ffi.so" "ab/$name/build/native/"
git archive "$commit" mok_jax configs tests README.md | tar -x -C "ab/$name"  # README.md: the tests of its API
echo "ab/$name: $(git log --oneline -1 "$commit")"

#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) the wheels tools/gpu_check.sh installs on the GPU machine,
# which cannot reach a package registry: jax-privacy (the peer the ghost-gpu suite times) and
# dp-accounting, with what they need beyond the machine's jax, jaxlib, numpy, scipy, optax,
# chex and absl-py, for its Python (3.12) and platform (manylinux x86_64). Pass the folder
# to the device run's carry (`.whl`). Usage: bash tools/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-3.12}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
get() { python3 -m pip download -q --dest "$TMP/$1" --python-version "$PY" \
        --platform manylinux2014_x86_64 --only-binary=:all: "${@:2}"; }
# no dependencies: they would bring a jax older than the machine's and shadow it
get plain --no-deps jax-privacy==2.0.0 "dp-accounting>=0.5.1" dm-tree mpmath attrs
# pydantic with its resolved dependencies (pydantic-core is pinned to it), then only those
get pydantic pydantic
mkdir -p .whl
rm -f .whl/*.whl
cp "$TMP"/plain/*.whl .whl/
for w in "$TMP"/pydantic/*.whl; do
    case $(basename "$w") in pydantic*|annotated_types*|typing_inspection*|typing_extensions*) cp "$w" .whl/ ;; esac
done
ls -l .whl

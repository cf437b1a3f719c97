#!/usr/bin/env bash
# Every GPU measurement of the project in one command, for a GPU lent only now and then:
#   bash tools/gpu_check.sh OUT_DIR [SECONDS] [PARTS]
# PARTS (comma-separated, default bench,compile,profile,noise,tests), each with its own time limit
# so that what was measured comes back even when the whole call runs out of time:
#   bench    the DP training steps of the ghost-gpu suite (GPT-2 small B=8 for GPT2_S seconds,
#            WRN-16-4 B=256 for WRN_S; steps GPT2_STEPS / WRN_STEPS, else GHOST_GPU_STEPS, default
#            ghost,vmap,jax_privacy besides the non-private one, in that order; nonprivate_noise and
#            ghost_noise_unstored weigh the noise and what storing it saves; ghost_noise_leaves the
#            GPU's default draw once per leaf shape against one draw per leaf): ratios,
#            temporaries, compile times (with GHOST_GPU_COMPILE_SPLIT=1 also each step's compile
#            time without XLA's autotuning); then, for EXTRA_S seconds (default 0: none), the configs
#            of EXTRA_MODELS (default gpt2-b32,gpt2-bf16-b8) with EXTRA_STEPS (default ghost,vmap);
#            then, for LLAMA_S seconds (default 0: none), the Llama configs (0.42B, bfloat16, T=1024,
#            full and LoRA: ghost and vmap step times and the largest batch each step fits);
#   compile  the compile breakdown of the DP steps (benchmarks.bench_compile, COMPILE_S, default
#            120): trace, lower and compile (on a GPU with its autotuning) of the non-private,
#            hand-written, vmap and ghost steps, and their HLO instructions by source; the
#            small transformer alone unless COMPILE_LARGER=1 (then also the Llama decoder,
#            GPT-2 with 2 blocks and WRN-16-4: give COMPILE_S=400 or more);
#   profile  the kernel-category profile of the non-private step and PROFILE_GPU_STEPS (default
#            ghost,vmap) of the configs PROFILE_MODELS (default gpt2-b8,wrn-b256)
#            (benchmarks.profile_gpu, PROFILE_S), reusing the programs the bench part
#            compiled through JAX's persistent compilation cache;
#   noise    the noise draw of a GPT-2-small tree, threefry against Philox, and its parts (memory
#            floor, pairs, bits, uniforms, Box-Muller, one draw, JAX's threefry kernel) (bench_noise,
#            NOISE_S; what would run past it less 45 s is left out);
#   tests    the test suite on the GPU backend (the README's GPU command, with workers) for
#            the time left, or the tests named in TESTS; stopped with SIGINT at the limit, so
#            pytest still prints its summary and the failures' tracebacks (OUT_DIR/pytest.log).
# Wheels in .whl/ (made by tools/gpu_wheels.sh: jax-privacy, dp-accounting and what they need, where the machine lacks
# them) are installed first into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: tools/gpu_check.sh OUT_DIR [SECONDS] [PARTS]}
TOTAL=${2:-540}
PARTS=,${3:-bench,compile,profile,noise,tests},
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
want() { [[ $PARTS == *,$1,* ]]; }
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
LOG="$OUT/bench.log"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import jax, jaxlib, optax, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, \
'optax', optax.__version__, 'flax', flax.__version__, jax.devices())"
} > "$LOG" 2>&1
if want bench; then
    DEFAULT_STEPS=${GHOST_GPU_STEPS:-ghost,vmap,jax_privacy}
    SPECS="gpt2-b8:${GPT2_S:-160}:${GPT2_STEPS:-$DEFAULT_STEPS} wrn-b256:${WRN_S:-90}:${WRN_STEPS:-$DEFAULT_STEPS}"
    if [ "${EXTRA_S:-0}" -gt 0 ]; then
        SPECS="$SPECS ${EXTRA_MODELS:-gpt2-b32,gpt2-bf16-b8}:$EXTRA_S:${EXTRA_STEPS:-ghost,vmap}"
    fi
    if [ "${LLAMA_S:-0}" -gt 0 ]; then
        SPECS="$SPECS llama-b8,llama-lora-b8:$LLAMA_S:ghost,vmap"
    fi
    for spec in $SPECS; do
        model=${spec%%:*}; rest=${spec#*:}; secs=${rest%%:*}; steps=${rest#*:}
        [ "$secs" -gt 0 ] || continue  # GPT2_S=0 or WRN_S=0: that config is not run
        GHOST_GPU_STEPS=$steps GHOST_GPU_BUDGET_S=$((secs - 30)) \
            timeout "$((secs + 60))" python3 -m benchmarks --only ghost-gpu --models "$model" --out "$OUT" >> "$LOG" 2>&1
        echo "== ghost-gpu $model: exit $?, $(left) s left" >> "$LOG"
    done
fi
if want compile; then
    QUICK=--quick
    [ "${COMPILE_LARGER:-0}" = 1 ] && QUICK=
    timeout "${COMPILE_S:-120}" python3 -m benchmarks $QUICK --only compile --out "$OUT/compile" >> "$LOG" 2>&1
    echo "== compile: exit $?, $(left) s left" >> "$LOG"
fi
if want profile; then
    PROFILE_GPU_BUDGET_S=${PROFILE_S:-100} timeout $(( ${PROFILE_S:-100} + 60 )) \
        python3 -m benchmarks --only profile-gpu --models "${PROFILE_MODELS:-gpt2-b8,wrn-b256}" --out "$OUT" >> "$LOG" 2>&1
    echo "== profile-gpu: exit $?, $(left) s left" >> "$LOG"
fi
if want noise; then
    # each row is printed as it is measured; NOISE_BUDGET_S leaves out what would not finish
    # (on an H200 the whole part took over 150 s: each draw of the tree compiles for tens of seconds)
    NOISE_BUDGET_S=$(( ${NOISE_S:-150} - 45 )) timeout "${NOISE_S:-150}" \
        python3 -m benchmarks --only noise --out "$OUT/noise" >> "$LOG" 2>&1
    echo "== noise: exit $?, $(left) s left" >> "$LOG"
fi
T=$(( $(left) - 15 ))
if want tests && [ "$T" -gt 30 ]; then
    # shellcheck disable=SC2086
    JAX_PLATFORMS=cuda timeout -s INT -k 15 "$T" python3 -m pytest -n "${WORKERS:-8}" -v --tb=short \
        -p no:randomly ${TESTS:-tests/per_example tests/_core tests} > "$OUT/pytest.log" 2>&1
    echo "== pytest: exit $? (124 or 2: stopped at its time limit)" >> "$OUT/pytest.log"
fi

# Stage timing for .ci/run (sourced): `stage NAME BUDGET_S` starts a stage and ends
# the one before it; `end_stage STATUS` ends the last. On exit (a failing stage
# included) the EXIT trap prints each stage's time beside its budget, the total
# against BUDGET_TOTAL, and what the JAX compilation cache holds. A stage over its
# budget is flagged, not failed. Tested by tests/test_ci_stages.py.
BUDGET_TOTAL=${BUDGET_TOTAL:-2400}
declare -a STAGE_ROWS=()
STAGE=""
STAGE_BUDGET=0
STAGE_START=$SECONDS

stage_row() {  # name, seconds, budget, status
    local flag=""
    if (($2 > $3)); then flag="  over budget"; fi
    STAGE_ROWS+=("$(printf '%-44s %6d s %6d s  %s%s' "$1" "$2" "$3" "$4" "$flag")")
}

end_stage() {  # status
    if [[ -n $STAGE ]]; then
        stage_row "$STAGE" $((SECONDS - STAGE_START)) "$STAGE_BUDGET" "$1"
    fi
    STAGE=""
}

# stage NAME BUDGET_SECONDS: ends the stage before it and starts this one
stage() {
    end_stage ok
    STAGE=$1
    STAGE_BUDGET=$2
    STAGE_START=$SECONDS
    echo "== $STAGE"
}

stage_table() {
    local rc=$?
    end_stage "$( ((rc == 0)) && echo ok || echo "FAILED (exit $rc)")"
    echo
    echo "== CI stages"
    printf '%-44s %8s %8s  %s\n' stage time budget status
    printf '%s\n' "${STAGE_ROWS[@]}"
    printf '%-44s %6d s %6d s\n' total "$SECONDS" "$BUDGET_TOTAL"
    if ((SECONDS > BUDGET_TOTAL)); then
        echo "WARNING: this run took ${SECONDS} s, over its ${BUDGET_TOTAL} s budget (CI stops at 5400 s)"
    fi
    if [[ -d ${JAX_COMPILATION_CACHE_DIR:-} ]]; then
        echo "compilation cache: $(find "$JAX_COMPILATION_CACHE_DIR" -type f | wc -l) programs," \
            "$(du -sh "$JAX_COMPILATION_CACHE_DIR" | cut -f1)"
    fi
    exit "$rc"
}
trap stage_table EXIT


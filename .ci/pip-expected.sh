# Sourced by .ci/install: run one pip command whose output holds a message we expect, print one line
# that says what it means instead, and show everything else pip printed. A failed pip shows all of
# its output and its exit status stands.
#
# pip_expecting REGEX EXPLANATION -- PIP ARGS...
#   REGEX        lines that are expected (grep -E); they are hidden, and EXPLANATION is printed once
#                in their place. pip's "dependency resolver does not currently take into account"
#                header goes with them when every conflict line under it is expected.
#   EXPLANATION  one line for the user.
pip_expecting() {
    local expected=$1 explanation=$2
    shift 3
    local log status=0
    log=$(mktemp)
    pip "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        cat "$log" >&2
        rm -f "$log"
        return "$status"
    fi
    local header="^ERROR: pip's dependency resolver does not currently take into account"
    local rest
    rest=$(grep -Ev -- "$expected" "$log" || true)
    if grep -Eq -- "$expected" "$log"; then
        echo "$explanation"
        # no other conflict line left under the resolver's header: the header goes too
        if ! grep -Eq ' (requires|has requirement) ' <<<"$rest"; then
            rest=$(grep -Ev -- "$header" <<<"$rest" || true)
        fi
    fi
    [ -z "$rest" ] || printf '%s\n' "$rest" >&2
    rm -f "$log"
}

# Sourced by the run_*.sh scripts beside it, each having set `usage`: answers -h/--help, takes OUT_DIR (the first
# argument when it is not a flag; default: this folder), and sets what they share. "$@" is left holding the FLAGs.
case "${1:-}" in -h|--help) echo "$usage"; exit 0 ;; esac
out="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ $# -gt 0 && "$1" != -* ]]; then out="$1"; shift; fi
mkdir -p "$out"
sk="${SPARSEKV:-sparsekv}"
tag="${TAG:-h100}"

need_text() {  # need_text PATH VARIABLE: one line and exit 2 when the text the run reads is missing
    [[ -f "$1" ]] || { echo "error: no text at $1 (apt install jargon-text, or set $2)" >&2; exit 2; }
}

work_folder() {  # sets `work`: $WORK, or a new temporary folder removed when the script exits
    if [[ -n "${WORK:-}" ]]; then work="$WORK"; else work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT; fi
}

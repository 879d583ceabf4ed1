#!/usr/bin/env bash
# Builds what a GPU script runs on a machine without Rust:
#
#   scripts/bundle.sh DIR [TEST...] # the release binaries of the integration
#                                   # tests named (tests/TEST.rs) as DIR/bin/test-TEST,
#                                   # and `upipe` as DIR/bin/upipe, stripped
#   OLD=COMMIT scripts/bundle.sh ...  # also that commit's `upipe` as DIR/bin/upipe-old
#                                   # (built in a worktree), for A/B runs
#
# With no TEST named only `upipe` is built. The liger_kernel wheel that
# scripts/hf_peer_step.py --liger needs on a GPU machine without internet is
# copied into DIR/wheels when WHEELS (a folder, default /tmp/wheels) has one.
#
# Test binaries are located from cargo's JSON messages (`--message-format=json`).
set -eu
dest="${1:?usage: bundle.sh DIR [TEST...]}"
shift
mkdir -p "$dest/bin"
rm -f "$dest"/bin/*
args=()
for t in "$@"; do args+=(--test "$t"); done
if [ $# -gt 0 ]; then
    cargo test --release --no-run "${args[@]}" --message-format=json 2>/dev/null |
        WANT="$*" python3 -c '
import json, os, sys
want = set(os.environ["WANT"].split())
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        print(m["target"]["name"] + "\t" + m["executable"])
' | while IFS=$'\t' read -r name exe; do cp "$exe" "$dest/bin/test-$name"; done
    for t in "$@"; do
        [ -x "$dest/bin/test-$t" ] || { echo "bundle.sh: no test binary for $t" >&2; exit 1; }
    done
fi
cargo build --release --bin upipe
cp target/release/upipe "$dest/bin/upipe"
if [ -n "${OLD:-}" ]; then
    tree="${TMPDIR:-/tmp}/upipe-old-src"
    git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
    git worktree add --detach "$tree" "$OLD"
    (cd "$tree" && cargo build --release --bin upipe)
    cp "$tree/target/release/upipe" "$dest/bin/upipe-old"
    git worktree remove --force "$tree"
fi
strip "$dest"/bin/* || true
for w in "${WHEELS:-/tmp/wheels}"/liger_kernel-*.whl; do
    [ -f "$w" ] || continue
    mkdir -p "$dest/wheels"
    cp "$w" "$dest/wheels/"
done

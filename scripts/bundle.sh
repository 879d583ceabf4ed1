#!/usr/bin/env bash
# Builds what a GPU script runs on a machine without Rust:
#
#   scripts/bundle.sh DIR [TEST...] # the integration tests of each module named
#                                   # (tests/integration/TEST.rs) as DIR/bin/test-TEST,
#                                   # and `upipe` as DIR/bin/upipe, stripped
#   OLD=COMMIT scripts/bundle.sh ...  # also that commit's `upipe` as DIR/bin/upipe-old
#                                   # (built in a worktree), for A/B runs
#
# Every integration test lives in one binary, DIR/bin/test-integration;
# DIR/bin/test-TEST is a small script that runs that binary on module TEST's
# tests alone, passing libtest's flags through and keeping, of the module's
# tests, those whose names contain one of the filters given (all if none).
# With no TEST named only `upipe` is built. The liger_kernel wheel that
# scripts/hf_peer_step.py --liger needs on a GPU machine without internet is
# copied into DIR/wheels when WHEELS (a folder, default /tmp/wheels) has one.
#
# The test binary is located from cargo's JSON messages (`--message-format=json`).
set -eu
dest="${1:?usage: bundle.sh DIR [TEST...]}"
shift
mkdir -p "$dest/bin"
rm -f "$dest"/bin/*
# Writes DIR/bin/test-$1: module $1's tests of DIR/bin/test-integration.
module_runner() {
    cat > "$dest/bin/test-$1" <<RUNNER
#!/usr/bin/env bash
# module $1 of the integration tests (tests/integration/$1.rs)
bin="\$(dirname "\$0")/test-integration"
flags=(); filters=()
while [ \$# -gt 0 ]; do
    case "\$1" in
        --test-threads|--skip|--format|--color|--logfile|-Z) flags+=("\$1" "\$2"); shift 2 ;;
        -*) flags+=("\$1"); shift ;;
        *) filters+=(-e "\$1"); shift ;;
    esac
done
names=\$("\$bin" --list --format terse 2>/dev/null | sed -n 's/: test\$//p' | grep '^$1::')
[ \${#filters[@]} -gt 0 ] && names=\$(printf '%s\n' \$names | grep -F "\${filters[@]}")
[ -n "\$names" ] || { echo "test-$1: no test matches"; exit 0; }
exec "\$bin" "\${flags[@]}" --exact \$names
RUNNER
    chmod +x "$dest/bin/test-$1"
}
if [ $# -gt 0 ]; then
    exe=$(cargo test --release --no-run --test integration --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "integration":
        print(m["executable"])
')
    [ -x "$exe" ] || { echo "bundle.sh: the integration test binary did not build" >&2; exit 1; }
    cp "$exe" "$dest/bin/test-integration"
    for t in "$@"; do
        [ -f "tests/integration/$t.rs" ] || { echo "bundle.sh: no test module tests/integration/$t.rs" >&2; exit 1; }
        module_runner "$t"
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
strip "$dest"/bin/upipe* "$dest"/bin/test-integration 2>/dev/null || true
for w in "${WHEELS:-/tmp/wheels}"/liger_kernel-*.whl; do
    [ -f "$w" ] || continue
    mkdir -p "$dest/wheels"
    cp "$w" "$dest/wheels/"
done

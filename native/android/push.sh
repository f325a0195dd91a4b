#!/usr/bin/env bash
# Push sakura-edge (the whole edit as one arm64 executable), every library it loads and,
# optionally, a device-bundle cache to an arm64 device over adb, then run one edit there
# against an origin URL and pull the image back.
#
#   native/android/push.sh [--stage-only DIR] BINARY ORIGIN TEMPLATE [CACHE_DIR]
#
# BINARY: the arm64 sakura-edge (native/README.md, "arm64"; e.g.
#   native/build/sakura-edge-arm64/sakura-edge). ORIGIN: where the packs are, as the device
#   reaches it (sakura serve, nginx, a CDN). TEMPLATE: a template of its catalog. CACHE_DIR:
#   a sakura-edge --cache-dir already holding the template's bundle (any arch's run fills
#   it; the .pte files are arch-independent), so that the device's first edit does not
#   download 126 MB; without it the device downloads the bundle once.
#
# The staged folder is self-contained: bin/sakura-edge, lib/ with the glibc loader and the
# whole closure of the binary's shared libraries (resolved through its RUNPATH and the
# arm64 multiarch folders), cache/, and run.sh, which starts the binary through the staged
# loader with --library-path lib, so nothing of the device's own libraries is used (an
# Android phone has no glibc; its kernel runs this glibc program as any Linux kernel does).
# --stage-only DIR writes that folder and stops before adb: tests/native/test_sakura_edge_arm64.py
# runs the staged run.sh under qemu-aarch64 (SAKURA_EXEC) and checks, from qemu's system
# call trace, that every library came from the staged lib/.
# Verified here: the staging and the staged edit under qemu-aarch64. Not verified: adb and a
# real phone (none here). Environment: ANDROID_SERIAL picks the device; DEVICE_DIR
# (default /data/local/tmp/sakura) where it goes; PROMPT and SEED the edit's.
set -euo pipefail
usage() { echo "usage: $0 [--stage-only DIR] BINARY ORIGIN TEMPLATE [CACHE_DIR]" >&2; exit 2; }
stage=""
if [ "${1:-}" = "--stage-only" ]; then
  [ $# -ge 2 ] || usage
  stage="$2"; shift 2
fi
[ $# -ge 3 ] && [ $# -le 4 ] || usage
bin="$1"; origin="$2"; template="$3"; cache="${4:-}"
err() { echo "push.sh: error: $*" >&2; exit 1; }
[ -x "$bin" ] || err "$bin is not an executable"
command -v readelf >/dev/null || err "readelf is not on PATH (binutils)"
readelf -h "$bin" 2>/dev/null | grep -q "AArch64" || err "$bin is not an arm64 executable"
[ -z "$cache" ] || [ -d "$cache" ] || err "$cache is not a folder"
case "$origin" in http://*|https://*) ;; *) err "ORIGIN must be an http(s) URL, got $origin" ;; esac

only_stage=1
if [ -z "$stage" ]; then
  only_stage=0
  command -v adb >/dev/null || err "adb is not on PATH (or give --stage-only DIR)"
  stage="$(mktemp -d)"
  trap 'rm -rf "$stage"' EXIT
fi
[ ! -e "$stage" ] || [ -z "$(ls -A "$stage")" ] || err "$stage exists and is not empty"
mkdir -p "$stage/bin" "$stage/lib" "$stage/cache" "$stage/state"
cp "$bin" "$stage/bin/sakura-edge"

# where the libraries are: the binary's RUNPATH, then Debian's arm64 multiarch folders
dyn() { readelf -d "$1" 2>/dev/null | sed -n "s/.*($2).*\[\(.*\)\]/\1/p"; }
dirs=()
for d in $(dyn "$bin" RUNPATH | tr ':' ' '); do dirs+=("$d"); done
dirs+=(/usr/lib/aarch64-linux-gnu /lib/aarch64-linux-gnu)
queue=("$bin")
declare -A seen=()
while [ ${#queue[@]} -gt 0 ]; do
  f="${queue[0]}"; queue=("${queue[@]:1}")
  for name in $(dyn "$f" NEEDED); do
    [ -z "${seen[$name]:-}" ] || continue
    seen[$name]=1
    found=""
    for d in "$(dirname "$f")" "${dirs[@]}"; do
      if [ -e "$d/$name" ]; then found="$d/$name"; break; fi
    done
    [ -n "$found" ] || err "library $name (needed by $(basename "$f")) not found in ${dirs[*]}"
    cp -L "$found" "$stage/lib/$name"
    queue+=("$found")
  done
done
loader="$(readelf -l "$bin" | sed -n 's/.*interpreter: \(.*\)\]/\1/p')"
[ -n "$loader" ] || err "$bin names no program interpreter"
loader_file="$loader"
[ -e "$loader_file" ] || loader_file="/usr/lib/aarch64-linux-gnu/$(basename "$loader")"
[ -e "$loader_file" ] || err "the arm64 loader $loader is not installed (libc6:arm64)"
cp -L "$loader_file" "$stage/lib/$(basename "$loader")"
if [ -n "$cache" ]; then cp -r "$cache/." "$stage/cache/"; fi

cat > "$stage/run.sh" <<EOF
# sakura-edge through the staged loader and libraries (native/android/push.sh);
# arguments after the script's name are passed on (e.g. --policy, --timeline).
# SAKURA_EXEC, if set, prefixes the command (qemu-aarch64 on an x86 host).
d=\$(cd "\$(dirname "\$0")" && pwd)
exec \${SAKURA_EXEC:-} "\$d/lib/$(basename "$loader")" --library-path "\$d/lib" \\
  "\$d/bin/sakura-edge" edit --origin "$origin" --template "$template" \\
  --cache-dir "\$d/cache" --state-dir "\$d/state" "\$@"
EOF
echo "staged $(ls "$stage/lib" | wc -l) libraries, $(du -sh "$stage" | cut -f1) in $stage"
[ "$only_stage" = 0 ] || exit 0

dest="${DEVICE_DIR:-/data/local/tmp/sakura}"
prompt="${PROMPT:-a pirate captain}"
seed="${SEED:-0}"
adb shell "rm -rf '$dest' && mkdir -p '$dest'"
adb push "$stage/." "$dest/"
adb shell "chmod 755 '$dest/bin/sakura-edge' '$dest/lib/$(basename "$loader")'"
adb shell "sh '$dest/run.sh' --prompt '$prompt' --seed '$seed' --out '$dest/edit.png' \
  --timeline '$dest/edit.timeline.json'"
adb pull "$dest/edit.png" ./edit.png
adb pull "$dest/edit.timeline.json" ./edit.timeline.json
echo "wrote ./edit.png and ./edit.timeline.json"

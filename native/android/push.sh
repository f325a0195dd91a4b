#!/usr/bin/env bash
# Push the standalone native runtime and the shards of a test edit to an Android phone
# over adb, then run its self-test and the shard stream there.
#
#   native/android/push.sh BINARY SHARDS_DIR [DEVICE_DIR]
#
# BINARY: sakura-native built with the NDK (native/README.md, "Android"); SHARDS_DIR: written
# by `sakura bench native --export SHARDS_DIR` (configuration bytes, RoPE table, expected
# tensors). Untested here (no NDK, no phone); needs `adb` and one device (or ANDROID_SERIAL).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BINARY SHARDS_DIR [DEVICE_DIR]" >&2
  exit 2
fi
bin="$1"
shards="$2"
dest="${3:-/data/local/tmp/sakura}"
[ -x "$bin" ] || { echo "error: $bin is not an executable" >&2; exit 1; }
[ -f "$shards/shards.txt" ] || { echo "error: $shards/shards.txt not found" >&2; exit 1; }
command -v adb >/dev/null || { echo "error: adb is not on PATH" >&2; exit 1; }

adb shell "mkdir -p '$dest/shards'"
adb push "$bin" "$dest/sakura-native"
adb push "$shards/." "$dest/shards/"
adb shell "chmod 755 '$dest/sakura-native'"
adb shell "cd '$dest' && ./sakura-native selftest"
adb shell "cd '$dest' && ./sakura-native run shards --threads 2 --capacity 2"

# shellcheck shell=bash
# tests/machine_cache.sh - a test tier's environment built once per machine, shared by every checkout on it.
#
#   source tests/machine_cache.sh
#   machine_cache_build NAME KEY BUILD_FN CHECKOUT_CACHE   # sets CACHE_ENTRY (the entry) and CACHE_BUILT (0 or 1)
#   link_atomically TARGET LINK              # LINK (in the checkout) becomes a symlink to TARGET
#
# As the SmolLM2 conversion (src/pipeline/env/assets.py): the entry lives in the machine's cache,
# $PIPELINE_MACHINE_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/pipeline-suite (PIPELINE_MACHINE_CACHE=off:
# CHECKOUT_CACHE/machine, so nothing is shared), at NAME/KEY: KEY is the hash of everything that decides the
# build (the lock files, the build script, the Python), so a changed lock builds a new entry and the old one is
# never used again. An entry is complete once NAME/KEY/.complete exists (written last); BUILD_FN DIR runs under an
# exclusive flock on NAME/KEY.lock, so two runs at once build it once (the second waits, then reuses it); an entry
# a killed build left without .complete is removed and rebuilt. Entries of NAME unused for
# PIPELINE_MACHINE_CACHE_DAYS (14) days are removed after a build, each under its own lock (never one in use
# by a build). A venv cannot move (its scripts name its path), so a checkout links to the entry, never copies it.

machine_cache_root() {
  local fallback="$1" value="${PIPELINE_MACHINE_CACHE:-}"
  if [[ "$value" == off ]]; then echo "$fallback"; return; fi
  echo "${value:-${XDG_CACHE_HOME:-$HOME/.cache}/pipeline-suite}"
}

machine_cache_build() {
  local name="$1" key="$2" build="$3" base fd
  base="$(machine_cache_root "$4/machine")/$name"
  CACHE_ENTRY="$base/$key"
  export CACHE_BUILT=0
  if [[ -f "$CACHE_ENTRY/.complete" ]]; then
    touch "$CACHE_ENTRY/.complete"   # last used: what the pruning below reads
    return 0
  fi
  mkdir -p "$base"
  exec {fd}>>"$base/$key.lock"
  if ! flock -n "$fd"; then
    echo "[machine cache] another run is building $CACHE_ENTRY; waiting for its lock" >&2
    flock -w 7200 "$fd" || { echo "error: the lock $base/$key.lock was not released within 2 hours" >&2; return 3; }
  fi
  if [[ ! -f "$CACHE_ENTRY/.complete" ]]; then
    rm -rf "$CACHE_ENTRY"   # nothing, or what a killed build left
    mkdir -p "$CACHE_ENTRY"
    "$build" "$CACHE_ENTRY"   # under set -e a failure ends the script here: no .complete, the lock goes with it
    date -u +%Y-%m-%dT%H:%M:%SZ > "$CACHE_ENTRY/.complete.tmp"
    mv -f "$CACHE_ENTRY/.complete.tmp" "$CACHE_ENTRY/.complete"
    CACHE_BUILT=1
  fi
  exec {fd}>&-
  _machine_cache_prune "$base" "$key"
}

_machine_cache_prune() {
  local base="$1" keep="$2" days="${PIPELINE_MACHINE_CACHE_DAYS:-14}" entry fd
  for entry in "$base"/*/; do
    entry="${entry%/}"
    [[ -d "$entry" && "$(basename "$entry")" != "$keep" && -f "$entry/.complete" ]] || continue
    [[ -n "$(find "$entry/.complete" -mtime +"$days" 2>/dev/null)" ]] || continue
    exec {fd}>>"$entry.lock"
    if flock -n "$fd"; then
      echo "[machine cache] removing $entry (unused for more than $days days)" >&2
      rm -rf "$entry"
    fi
    exec {fd}>&-
  done
}

link_atomically() {
  local target="$1" link="$2" tmp
  tmp="$link.tmp.$$"
  mkdir -p "$(dirname "$link")"
  rm -rf "$tmp"
  ln -s "$target" "$tmp"
  if [[ -d "$link" && ! -L "$link" ]]; then rm -rf "$link"; fi   # a checkout's own build from before the cache
  mv -Tf "$tmp" "$link"
}

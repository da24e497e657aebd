#!/usr/bin/env bash
# Build the graphkeeper image without Docker and load it into the local node's containerd.
#
#   deploy/docker/build-images.sh            build (cached steps are skipped) and load
#   deploy/docker/build-images.sh --no-load  build only
#
# Everything comes from Debian's packages and PyPI:
#   1. a Debian bookworm root filesystem with python3 (debootstrap --variant=minbase), cached;
#   2. a wheelhouse: graphkeeper's wheel and its runtime dependencies, at the versions of this
#      checkout's .venv, from PyPI (pip's cache answers when it has them). torch is the PyPI wheel
#      without its nvidia-* / triton dependencies: on a CPU node the worker runs eagerly
#      (`--device cpu`); for GPU nodes build from deploy/docker/Dockerfile with its default base;
#   3. `buildah bud -f deploy/docker/Dockerfile` on that base, as docker.io/graphkeeper/graphkeeper:TAG
#      (the name the kubelet normalises to), then `ctr -n k8s.io images import`.
# Also builds the pause image containerd's CRI needs for every pod sandbox (no registry here).
#
# With GRAPHKEEPER_NO_BUILD=1 (how .ci/run and `make test-e2e` run the tests) it builds nothing: it
# loads the archives an earlier `build-images.sh --no-load` (`make images`) left in the cache and
# fails at once when one is missing.
#
# Environment: GRAPHKEEPER_CACHE (~/.cache/graphkeeper), GRAPHKEEPER_IMAGE (docker.io/graphkeeper/graphkeeper),
# GRAPHKEEPER_IMAGE_TAG (dev), GRAPHKEEPER_CONTAINERD_SOCK (the local node's containerd socket).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${GRAPHKEEPER_CACHE:-$HOME/.cache/graphkeeper}
images=$cache/images
image=${GRAPHKEEPER_IMAGE:-docker.io/graphkeeper/graphkeeper}
tag=${GRAPHKEEPER_IMAGE_TAG:-dev}
sock=${GRAPHKEEPER_CONTAINERD_SOCK:-$cache/cluster/node/containerd/containerd.sock}
python=${PYTHON:-$root/.venv/bin/python}
suite=bookworm
base_tar=$images/debian-$suite-python.tar
base_image=localhost/graphkeeper/debian-python:$suite
pause_image=registry.k8s.io/pause:3.6
load=1
[ "${1:-}" = --no-load ] && load=0
mkdir -p "$images"
log() { echo "build-images: $*" >&2; }

# Builds use chroot isolation and a private storage root, so nothing touches a system Docker or Podman.
export BUILDAH_ISOLATION=chroot
store=(--root "$images/storage" --runroot "$images/run" --storage-driver vfs)
bah() { buildah "${store[@]}" "$@"; }

base() {
  [ -f "$base_tar" ] && return
  log "debootstrap $suite (minbase + python3) into a cached root filesystem (a few minutes, once)"
  local tmp
  tmp=$(mktemp -d "$images/.rootfs.XXXXXX")
  trap 'rm -rf "$tmp"' RETURN
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$suite" "$tmp/rootfs" http://deb.debian.org/debian >"$images/debootstrap.log" 2>&1 \
    || { tail -n 30 "$images/debootstrap.log" >&2; return 1; }
  # Slim it: no apt lists, caches, docs or man pages in the image.
  rm -rf "$tmp"/rootfs/var/lib/apt/lists/* "$tmp"/rootfs/var/cache/apt/* \
    "$tmp"/rootfs/usr/share/doc/* "$tmp"/rootfs/usr/share/man/* "$tmp"/rootfs/usr/share/locale/*
  tar -C "$tmp/rootfs" --numeric-owner -cf "$base_tar.part" .
  mv "$base_tar.part" "$base_tar"
}

base_image() {
  bah inspect --type image "$base_image" >/dev/null 2>&1 && return
  local c
  c=$(bah from scratch)
  bah add "$c" "$base_tar" /
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
  bah commit -q "$c" "$base_image" >/dev/null
  bah rm "$c" >/dev/null
}

pause() {
  # A static Go binary that sleeps until signalled, as containerd's sandbox_image.
  [ -f "$images/pause.tar" ] && return
  log "pause image ($pause_image)"
  local c tmp
  tmp=$(mktemp -d "$images/.pause.XXXXXX")
  (cd "$here/pause" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod \
    go build -trimpath -ldflags "-s -w" -o "$tmp/pause" .)
  c=$(bah from scratch)
  bah copy --chmod 0755 "$c" "$tmp/pause" /pause
  bah config --entrypoint '["/pause"]' --cmd '[]' --user 65535:65535 "$c"
  bah commit -q "$c" "$pause_image" >/dev/null
  bah rm "$c" >/dev/null
  rm -f "$images/pause.tar.part"
  bah push -q "$pause_image" "docker-archive:$images/pause.tar.part:$pause_image"
  mv "$images/pause.tar.part" "$images/pause.tar"
  rm -rf "$tmp"
}

graphkeeper_image() {
  local stamp
  "$here/wheelhouse.sh" >/dev/null 2>"$images/wheelhouse.log" || { cat "$images/wheelhouse.log" >&2; return 1; }
  # Rebuild when the wheelhouse or the Dockerfile changed (the wheel carries the source).
  # (the wheel's contents, not its bytes: a rebuilt wheel carries new timestamps)
  stamp=$( (cat "$here/Dockerfile" "$root/.wheelhouse/requirements.txt"; \
            "$python" -c 'import sys, zipfile, hashlib; z = zipfile.ZipFile(sys.argv[1]); print(hashlib.sha256(b"".join(n.encode() + z.read(n) for n in sorted(z.namelist()))).hexdigest())' \
              "$root"/.wheelhouse/graphkeeper-*.whl) | sha256sum | cut -c1-16)
  if [ -f "$images/graphkeeper.tar" ] && [ "$(cat "$images/graphkeeper.stamp" 2>/dev/null)" = "$stamp" ]; then
    return
  fi
  log "buildah bud -f deploy/docker/Dockerfile -> $image:$tag (a few minutes: torch and its CUDA wheels)"
  bah bud -q --layers=false --network host --build-arg "BASE=$base_image" \
    -f "$here/Dockerfile" -t "$image:$tag" "$root" >/dev/null
  rm -f "$images/graphkeeper.tar.part"
  bah push -q "$image:$tag" "docker-archive:$images/graphkeeper.tar.part:$image:$tag"
  mv "$images/graphkeeper.tar.part" "$images/graphkeeper.tar"
  echo "$stamp" >"$images/graphkeeper.stamp"
  # The archive is what gets loaded; the build's own copy (GBs) goes, the base image stays.
  bah rmi "$image:$tag" >/dev/null 2>&1 || true
  bah rmi --prune >/dev/null 2>&1 || true
}

import() { # import TAR NAME: once per archive and containerd store
  [ -S "$sock" ] || { log "no containerd at $sock: deploy/local/cluster.sh up --node first"; exit 1; }
  local marker key
  marker=$(dirname "$sock")/imported
  key="$2 $(stat -c %Y-%s "$1")"
  if grep -qxF "$key" "$marker" 2>/dev/null && ctr --address "$sock" -n k8s.io images ls -q | grep -qxF "$2"; then
    return
  fi
  log "loading $2 into the node's containerd"
  ctr --address "$sock" -n k8s.io images import "$1" >/dev/null
  echo "$key" >>"$marker"
}

built() { # built ARCHIVE...: under GRAPHKEEPER_NO_BUILD=1, each archive must be in the cache already
  local f
  for f in "$@"; do
    [ -f "$images/$f" ] || { log "$images/$f is not built and GRAPHKEEPER_NO_BUILD=1 (tests build nothing):" \
      "run deploy/docker/build-images.sh --no-load first (make images; .ci/run and make test-e2e do)"; exit 1; }
  done
}

no_build=${GRAPHKEEPER_NO_BUILD:-0}
case "${1:-}" in
  --base-only) base; base_image; exit 0 ;;
  --pause) if [ "$no_build" = 1 ]; then built pause.tar; else pause; fi; exit 0 ;;
esac

if [ "$no_build" = 1 ]; then
  built pause.tar graphkeeper.tar
else
  base
  base_image
  pause
  graphkeeper_image
fi
if [ "$load" = 1 ]; then
  import "$images/pause.tar" "$pause_image"
  import "$images/graphkeeper.tar" "$image:$tag"
fi
echo "$image:$tag"

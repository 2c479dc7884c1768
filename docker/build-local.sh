#!/usr/bin/env bash
# Build the CPU image (docker/Dockerfile.cpu) on a host that may have no registry and sits
# behind a TLS-intercepting proxy, in one command:
#
#   sudo docker/build-local.sh            # from anywhere; builds dlrm-vrgd:cpu
#
# With Docker Hub and PyTorch's index reachable, it is the published recipe plus nothing:
#   DOCKER_BUILDKIT=1 docker build -f docker/Dockerfile.cpu -t dlrm-vrgd:cpu .
# Elsewhere it fills in what the host lacks, each step only where needed:
#   1. a Docker client that builds with BuildKit (docker buildx, or a 20.10 client with
#      DOCKER_BUILDKIT=1: the Dockerfile's RUN --mount lines need BuildKit);
#   2. the base image: PYTHON_IMAGE if set; else the Dockerfile's pinned python image, when
#      it is here or can be pulled; else a Debian bookworm made by debootstrap from this
#      host's own Debian mirror (its apt sources) and imported with `docker import` (kept
#      and reused; python3 3.11 from Debian);
#   3. the CA bundle pip's `cert` setting names (PIP_CERT, else `pip config`): passed as the
#      build secret `pip-ca`, so pip trusts the same roots as on the host and the bundle is
#      in no layer and no history entry;
#   4. the local wheels pip's `find-links` names (PIP_FIND_LINKS, else `pip config`), e.g. the
#      torch CPU wheel: put in a wheels-only image (FROM scratch) that the build mounts as
#      its `wheels` stage (dockerd 20.10 has no `--build-context`); when it holds torch, the
#      build does not ask PyTorch's index at all (PIP_EXTRA_INDEX_URL empty);
#   5. the build itself, on the host network (`--network host`: works with dockerd started
#      with --bridge=none, and sends nothing through Docker's bridge);
#   6. removal of the dangling images earlier runs of this script left (the build cache
#      stays, so an unchanged stack is not reinstalled).
#
# Settings (environment): DLRM_VRGD_IMAGE (tag, default dlrm-vrgd:cpu), PYTHON_IMAGE,
# DLRM_VRGD_PULL=0 (do not try to pull the base), DLRM_VRGD_BASE_TAG (default
# dlrm-vrgd-base:bookworm), DEBIAN_MIRROR (default: from /etc/apt/sources.list*),
# DLRM_VRGD_REBUILD_BASE=1, PIP_CERT, PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL, DOCKER (client).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${DLRM_VRGD_IMAGE:-dlrm-vrgd:cpu}"
BASE_TAG="${DLRM_VRGD_BASE_TAG:-dlrm-vrgd-base:bookworm}"
WHEELS_TAG="dlrm-vrgd-wheels:local"
# Every image this script creates carries this label: step 6 prunes only those.
LABEL="org.dlrm-vrgd.build=local"
# What the base must hold for Dockerfile.cpu: `python` (3.11) with venv; passwd (useradd)
# comes with debootstrap's minbase.
BASE_PACKAGES="python3,python3-venv,python-is-python3"

log() { printf '\n== build-local: %s\n' "$*" >&2; }
die() { printf 'build-local: error: %s\n' "$*" >&2; exit 1; }
started=$SECONDS

# ------------------------------------------------------------------ 1. a BuildKit client
BUILD=()
for cli in ${DOCKER:-} docker /usr/bin/docker; do
  command -v "$cli" >/dev/null 2>&1 || continue
  if "$cli" buildx version >/dev/null 2>&1; then
    DOCKER_CLI="$cli"; BUILD=("$cli" buildx build --load); break
  fi
  # A 20.10 client builds with its own BuildKit session; a newer one without buildx cannot.
  if DOCKER_BUILDKIT=1 "$cli" build --help 2>/dev/null | grep -q -- '--secret'; then
    DOCKER_CLI="$cli"; BUILD=(env DOCKER_BUILDKIT=1 "$cli" build); break
  fi
done
[ ${#BUILD[@]} -gt 0 ] || die "no Docker client that builds with BuildKit (install docker buildx, or Debian's docker.io)"
"$DOCKER_CLI" info >/dev/null 2>&1 || die "the Docker daemon does not answer ($DOCKER_CLI info)"
log "client: ${BUILD[*]}"

# ------------------------------------------------------------------------ 2. base image
pinned="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$ROOT/docker/Dockerfile.cpu")"
[ -n "$pinned" ] || die "no ARG PYTHON_IMAGE= in docker/Dockerfile.cpu"

debian_mirror() {
  # The first Debian archive of this host's apt sources that serves bookworm/main
  # (one-line .list entries and deb822 .sources stanzas).
  python3 - <<'PY'
import glob, re, sys
found = []
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
        if len(line) >= 4 and line[0] == "deb" and line[2] == "bookworm" and "main" in line[3:]:
            found.append(line[1])
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.split()
        if fields.get("enabled", ["yes"])[0] == "no":
            continue
        if "deb" in fields.get("types", []) and "bookworm" in fields.get("suites", []) \
                and "main" in fields.get("components", []):
            found.extend(fields.get("uris", []))
if not found:
    sys.exit("no apt source serves bookworm main")
print(found[0])
PY
}

rootfs=""
make_base() {
  local packages mirror
  packages="$BASE_PACKAGES"
  if [ "${DLRM_VRGD_REBUILD_BASE:-0}" != 1 ] &&
     [ "$("$DOCKER_CLI" image inspect -f '{{index .Config.Labels "org.dlrm-vrgd.packages"}}' "$BASE_TAG" 2>/dev/null)" = "$packages" ]; then
    log "base: $BASE_TAG (made earlier, reused)"
    return
  fi
  command -v debootstrap >/dev/null 2>&1 || die "no registry base image, and no debootstrap to make one (apt-get install debootstrap)"
  [ "$(id -u)" = 0 ] || die "debootstrap needs root"
  mirror="${DEBIAN_MIRROR:-$(debian_mirror)}"
  rootfs="$(mktemp -d /tmp/dlrm-vrgd-rootfs.XXXXXX)"
  trap '[ -z "$rootfs" ] || rm -rf "$rootfs"' EXIT
  log "base: debootstrap bookworm (minbase + $packages) from the host's Debian mirror"
  debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" >&2 ||
    { tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2 || true; die "debootstrap failed"; }
  # Nothing of the download is kept: packages, apt lists.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
  tar -C "$rootfs" --numeric-owner -c . |
    "$DOCKER_CLI" import \
      --change 'ENV LANG=C.UTF-8' \
      --change "LABEL $LABEL org.dlrm-vrgd.packages=$packages" \
      --change 'CMD ["python3"]' \
      - "$BASE_TAG" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  log "base: $BASE_TAG imported ($(( SECONDS - started )) s so far)"
}

if [ -n "${PYTHON_IMAGE:-}" ]; then
  base="$PYTHON_IMAGE"
  log "base: $base (PYTHON_IMAGE)"
elif "$DOCKER_CLI" image inspect "$pinned" >/dev/null 2>&1; then
  base="$pinned"
  log "base: $base (present)"
elif [ "${DLRM_VRGD_PULL:-1}" != 0 ] && timeout 300 "$DOCKER_CLI" pull "$pinned" >&2; then
  base="$pinned"
  log "base: $base (pulled)"
else
  log "base: $pinned cannot be pulled here; making a local base instead"
  make_base
  base="$BASE_TAG"
fi

# ------------------------------------------------------------------ 3./4. pip's settings
pip_setting() {  # the host pip's value of a setting: its PIP_* variable, else `pip config`
  local env="$1" key="$2"
  if [ -n "${!env:-}" ]; then printf '%s\n' "${!env}"; return; fi
  python3 -m pip config list 2>/dev/null |
    sed -n "s/^[a-z:]*\.$key='\(.*\)'\$/\1/p" | head -n 1
}

args=(--network host --label "$LABEL" --build-arg "PYTHON_IMAGE=$base")

cert="$(pip_setting PIP_CERT cert)"
if [ -n "$cert" ]; then
  [ -r "$cert" ] || die "pip's cert setting names $cert, which cannot be read"
  args+=(--secret "id=pip-ca,src=$cert")
  log "CA bundle: $cert (build secret pip-ca)"
fi

wheels=""
for link in $(pip_setting PIP_FIND_LINKS find-links); do
  link="${link#file://}"
  if [ -d "$link" ] && compgen -G "$link/*.whl" >/dev/null; then wheels="$link"; break; fi
done
if [ -n "$wheels" ]; then
  log "wheels: $wheels -> $WHEELS_TAG ($(find "$wheels" -maxdepth 1 -name "*.whl" | wc -l) wheel(s))"
  printf 'FROM scratch\nCOPY *.whl /\n' |
    "${BUILD[@]}" --quiet --label "$LABEL" -t "$WHEELS_TAG" -f - "$wheels" >/dev/null
  args+=(--build-arg "WHEELS_IMAGE=$WHEELS_TAG")
  torch="$(sed -n 's/^\(torch==.*\)$/\1/p' "$ROOT/requirements/cpu-stack.txt")"
  wheel_name="torch-${torch#torch==}-"
  if [ -z "${PIP_EXTRA_INDEX_URL+set}" ] && compgen -G "$wheels/${wheel_name}*.whl" >/dev/null; then
    args+=(--build-arg "PIP_EXTRA_INDEX_URL=")
    log "wheels: ${torch} is local; PyTorch's index is not asked"
  fi
fi
if [ -n "${PIP_EXTRA_INDEX_URL+set}" ]; then
  args+=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
fi

# -------------------------------------------------------------------------- 5. the build
log "build: $IMAGE from docker/Dockerfile.cpu"
"${BUILD[@]}" --progress=plain "${args[@]}" -f "$ROOT/docker/Dockerfile.cpu" -t "$IMAGE" "$ROOT"

# ----------------------------------------------------------------------- 6. tidy images
"$DOCKER_CLI" image prune --force --filter "label=$LABEL" >/dev/null
log "done: $IMAGE in $(( SECONDS - started )) s"

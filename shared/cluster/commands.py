"""The shell commands that start, stop and inspect a role on a host, built as strings (and tested
as such): ``dynamoctl cluster`` and the planner's SSH connector both run these.

Two ways to run a role, chosen per host:

- ``systemd``: a transient unit ``dynamod-<name>`` via ``systemd-run`` (``--user`` when not root),
  restarted on failure, logs in the journal.
- ``process``: a supervised background process: ``setsid`` starts a small ``sh`` loop that runs
  the role and restarts it if it exits, unless a stop file exists; its pid (the process group) is
  in ``<workdir>/run/<name>.pid``, its start time (``/proc/<pid>/stat`` field 22, clock ticks since
  boot) in ``<workdir>/run/<name>.started``, and its output in ``<workdir>/logs/<name>.log``.
  A pid file alone proves nothing once the process is gone: the kernel hands the number out again.
  So the role counts as running, and its group is signalled, only while the pid's start time is
  the recorded one (``_OWNED``); a reused pid, or a pid file without a start time, reads as not
  running and is never signalled.

Every value that reaches the shell goes through ``shlex.quote``.
"""

from __future__ import annotations

import shlex

from dynamod.shared.cluster.inventory import ClusterSpec, HostSpec, RoleSpec

MODE_SYSTEM = "systemd"
MODE_USER = "systemd-user"
MODE_PROCESS = "process"
STOP_TIMEOUT_S = 30

DETECT_SUPERVISOR = (
    "if [ -d /run/systemd/system ] && command -v systemd-run >/dev/null 2>&1; then "
    'if [ "$(id -u)" = 0 ]; then echo systemd; '
    "elif systemctl --user show-environment >/dev/null 2>&1; then echo systemd-user; "
    "else echo process; fi; else echo process; fi"
)


def q(value: str) -> str:
    return shlex.quote(value)


def dynamod_argv(cluster: ClusterSpec, role: RoleSpec, host: HostSpec | None = None) -> list[str]:
    """The command line of one role: the ``dynamod`` entry point, the cluster's connection flags,
    the host's address, then the role's own args (which win: argparse keeps the last value).

    With ``host`` every listener of the role binds and advertises the host's cluster address
    (``--host``; the frontend's ``--http-host``; ``--system-host`` with a ``system_port``), so the
    other hosts can dial what discovery names. Without it (a single host) they stay on loopback."""
    argv = [cluster.dynamod]
    if role.role == "up":
        return [*argv, "up", *role.args]
    argv += ["--role", role.role, "--namespace", cluster.namespace, "--discovery-backend", cluster.discovery]
    if host is not None:
        argv += ["--host", host.listen_address]
        if role.role == "frontend":
            argv += ["--http-host", host.listen_address]
    if cluster.etcd_endpoints:
        argv += ["--etcd-endpoints", ",".join(cluster.etcd_endpoints)]
    if cluster.nats_server:
        argv += ["--nats-server", cluster.nats_server]
    if cluster.file_kv:
        argv += ["--file-kv", cluster.file_kv]
    if cluster.event_plane:
        argv += ["--event-plane", cluster.event_plane]
    if role.system_port is not None:
        argv += ["--system-port", str(role.system_port), "--system-host", system_host(role, host)]
    return [*argv, *role.args]


def system_host(role: RoleSpec, host: HostSpec | None) -> str:
    """Where a role's status server listens: the host's cluster address (Prometheus and the console
    scrape it from elsewhere, and discovery advertises it), loopback on a single host."""
    return host.listen_address if host is not None and role.role != "up" else "127.0.0.1"


def role_env(cluster: ClusterSpec, role: RoleSpec) -> dict[str, str]:
    """The role's environment: paths of the uploaded secret files (never a secret itself: these
    variables end up on the host's command lines), then the inventory's env, the role's last."""
    return {"PYTHONUNBUFFERED": "1", **secret_file_env(cluster), **cluster.env, **role.env}


def secret_file_env(cluster: ClusterSpec) -> dict[str, str]:
    """``DYN_*_FILE`` -> where ``upload_secret_command`` puts that file on the hosts."""
    return {var: f"{cluster.workdir}/secrets/{var}" for var in cluster.secret_files}


def upload_secret_command(cluster: ClusterSpec, var: str) -> str:
    """Writes stdin to the secret file of ``var`` (mode 0600 from the first byte: umask 077, then
    an atomic rename, so a role never reads half a certificate)."""
    path = secret_file_env(cluster)[var]
    tmp = f"{path}.tmp"
    return f"umask 077 && mkdir -p {q(cluster.workdir)}/secrets && cat > {q(tmp)} && mv -f {q(tmp)} {q(path)}"


def _paths(cluster: ClusterSpec, role: RoleSpec) -> dict[str, str]:
    w = cluster.workdir.rstrip("/") or "/"
    return {
        "workdir": w,
        "pid": f"{w}/run/{role.name}.pid",
        "started": f"{w}/run/{role.name}.started",
        "child": f"{w}/run/{role.name}.child",
        "stop": f"{w}/run/{role.name}.stop",
        "mode": f"{w}/run/{role.name}.mode",
        "log": f"{w}/logs/{role.name}.log",
    }


def _start_time(pid: str) -> str:
    """Shell printing the start time of ``pid`` (a shell word): field 22 of ``/proc/<pid>/stat``,
    counted after the command name, which may itself hold spaces and parentheses. Prints nothing
    without ``/proc`` (the record and the check are then both empty and only ``kill -0`` decides)."""
    return f"sed 's/.*) //' /proc/{pid}/stat 2>/dev/null | cut -d' ' -f20"


def _owned(p: dict[str, str]) -> str:
    """Shell condition: the pid file names a live process that is the one started here (same start
    time). Sets ``$pg`` to that pid."""
    return (
        f"[ -f {q(p['pid'])} ] && pg=$(cat {q(p['pid'])}) && [ -n \"$pg\" ] && kill -0 \"$pg\" 2>/dev/null && "
        f"[ \"$({_start_time('$pg')})\" = \"$(cat {q(p['started'])} 2>/dev/null)\" ]"
    )


def _systemctl(mode: str) -> str:
    return "systemctl --user" if mode == MODE_USER else "systemctl"


def start_command(cluster: ClusterSpec, role: RoleSpec, mode: str, host: HostSpec | None = None) -> str:
    """Starts the role unless it already runs; prints ``started <pid>`` or ``already running <pid>``.
    ``host``: the inventory host it runs on (its address goes on the command line)."""
    p = _paths(cluster, role)
    argv = dynamod_argv(cluster, role, host)
    env = role_env(cluster, role)
    prep = f"mkdir -p {q(p['workdir'])}/run {q(p['workdir'])}/logs && printf %s {q(mode)} > {q(p['mode'])}"
    if mode in (MODE_SYSTEM, MODE_USER):
        ctl = _systemctl(mode)
        run = "systemd-run --user" if mode == MODE_USER else "systemd-run"
        setenv = " ".join(f"--setenv={q(f'{k}={v}')}" for k, v in env.items())
        return (
            f"{prep} && if {ctl} is-active --quiet {q(role.unit)}; then "
            f"echo already running $({ctl} show -p MainPID --value {q(role.unit)}); else "
            f"{ctl} reset-failed {q(role.unit)} >/dev/null 2>&1; "
            f"{run} --quiet --collect --unit={q(role.unit)} --description={q(f'dynamod {role.role} ({role.name})')} "
            f"--property=Restart=on-failure --property=RestartSec=2 --property=KillSignal=SIGTERM "
            f"--property=TimeoutStopSec={STOP_TIMEOUT_S} --working-directory={q(p['workdir'])} {setenv} "
            f"-- {' '.join(q(a) for a in argv)} && echo started $({ctl} show -p MainPID --value {q(role.unit)}); fi"
        )
    env_prefix = " ".join(q(f"{k}={v}") for k, v in env.items())
    cmd = f"env {env_prefix} {' '.join(q(a) for a in argv)}"
    loop = (
        f"while :; do {cmd} & child=$!; echo $child > {q(p['child'])}; wait $child; rc=$?; "
        f"if [ -f {q(p['stop'])} ]; then exit 0; fi; "
        f'echo "dynamod-supervisor: {role.name} exited rc=$rc; restarting in 2s"; sleep 2; done'
    )
    # The start time is recorded before the pid: a pid file is never there without it.
    return (
        f"{prep} && cd {q(p['workdir'])} && "
        f"if {_owned(p)}; then "
        f"echo already running $pg; else rm -f {q(p['stop'])}; "
        f"nohup setsid sh -c {q(loop)} >> {q(p['log'])} 2>&1 < /dev/null & pg=$!; "
        f"{_start_time('$pg')} > {q(p['started'])}; echo $pg > {q(p['pid'])}; "
        f"echo started $pg; fi"
    )


def stop_command(cluster: ClusterSpec, role: RoleSpec, mode: str) -> str:
    """Stops the role: SIGTERM (graceful drain), then SIGKILL after the stop timeout.

    Prints ``stopped``, ``not running`` or ``killed``.
    """
    p = _paths(cluster, role)
    if mode in (MODE_SYSTEM, MODE_USER):
        ctl = _systemctl(mode)
        return (
            f"if {ctl} is-active --quiet {q(role.unit)}; then {ctl} stop {q(role.unit)} && echo stopped; "
            f"else echo not running; fi; {ctl} reset-failed {q(role.unit)} >/dev/null 2>&1; true"
        )
    return (
        f"if {_owned(p)}; then "
        f"touch {q(p['stop'])}; kill -TERM -$pg 2>/dev/null; i=0; "
        f"while kill -0 -$pg 2>/dev/null && [ $i -lt {STOP_TIMEOUT_S * 10} ]; do sleep 0.1; i=$((i+1)); done; "
        f"if kill -0 -$pg 2>/dev/null; then kill -KILL -$pg 2>/dev/null; echo killed; else echo stopped; fi; "
        f"else echo not running; fi; rm -f {q(p['pid'])} {q(p['started'])} {q(p['child'])}"
    )


def status_command(cluster: ClusterSpec, role: RoleSpec, mode: str) -> str:
    """Prints ``<state> <pid>``: running, stopped or failed."""
    p = _paths(cluster, role)
    if mode in (MODE_SYSTEM, MODE_USER):
        ctl = _systemctl(mode)
        return (
            f"s=$({ctl} is-active {q(role.unit)} 2>/dev/null); "
            f'case "$s" in active|activating|reloading) echo running $({ctl} show -p MainPID --value {q(role.unit)});; '
            f"failed) echo failed 0;; *) echo stopped 0;; esac"
        )
    return (
        f"if {_owned(p)}; then "
        f"echo running $(cat {q(p['child'])} 2>/dev/null || echo $pg); else echo stopped 0; fi"
    )


def logs_command(cluster: ClusterSpec, role: RoleSpec, mode: str, lines: int) -> str:
    p = _paths(cluster, role)
    if mode in (MODE_SYSTEM, MODE_USER):
        user = " --user" if mode == MODE_USER else ""
        return f"journalctl{user} -u {q(role.unit)} -n {int(lines)} --no-pager -o short-iso 2>&1"
    return f"if [ -f {q(p['log'])} ]; then tail -n {int(lines)} {q(p['log'])}; else echo '(no log yet: {role.name} never started here)'; fi"


def mode_command(cluster: ClusterSpec, role: RoleSpec) -> str:
    """How the role was started here (from its mode file), or how it would be (detection)."""
    p = _paths(cluster, role)
    return f"if [ -f {q(p['mode'])} ]; then cat {q(p['mode'])}; else {DETECT_SUPERVISOR}; fi"


def health_command(cluster: ClusterSpec, role: RoleSpec, host: HostSpec | None = None) -> str:
    """Asks the role's /health on the host itself, so no port has to be reachable from here."""
    assert role.system_port is not None
    address = system_host(role, host)
    url = f"http://{f'[{address}]' if ':' in address else address}:{role.system_port}/health"
    script = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    r = urllib.request.urlopen({url!r}, timeout=3)\n"
        "    sys.stdout.write(r.read().decode()[:500])\n"
        "except urllib.error.HTTPError as e:\n"
        "    sys.stdout.write(e.read().decode()[:500]); sys.exit(1)\n"
        "except OSError as e:\n"
        "    sys.stdout.write(str(e)); sys.exit(2)\n"
    )
    return f"{q(cluster.python)} -c {q(script)}"

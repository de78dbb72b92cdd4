"""The shell commands ``dynamoctl cluster`` runs on a host: they live in
``shared/cluster/commands.py`` (the planner's SSH connector runs the same ones); this name stays
for dynamoctl's callers."""

from dynamod.shared.cluster.commands import (
    DETECT_SUPERVISOR,
    MODE_PROCESS,
    MODE_SYSTEM,
    MODE_USER,
    STOP_TIMEOUT_S,
    dynamod_argv,
    health_command,
    logs_command,
    mode_command,
    q,
    role_env,
    start_command,
    status_command,
    stop_command,
)

__all__ = [
    "DETECT_SUPERVISOR", "MODE_PROCESS", "MODE_SYSTEM", "MODE_USER", "STOP_TIMEOUT_S", "dynamod_argv",
    "health_command", "logs_command", "mode_command", "q", "role_env", "start_command", "status_command",
    "stop_command",
]

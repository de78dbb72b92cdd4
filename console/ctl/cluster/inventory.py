"""The SSH inventory, for ``dynamoctl cluster``: it lives in ``shared/cluster/inventory.py``, where
the planner's SSH connector reads the same file; this name stays for dynamoctl's callers."""

from dynamod.shared.cluster.inventory import (
    ROLES,
    SUPERVISORS,
    ClusterSpec,
    HostSpec,
    Inventory,
    RoleSpec,
    SshSettings,
    load_inventory,
    parse_inventory,
)

__all__ = [
    "ROLES", "SUPERVISORS", "ClusterSpec", "HostSpec", "Inventory", "RoleSpec", "SshSettings", "load_inventory",
    "parse_inventory",
]

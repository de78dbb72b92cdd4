"""Which Kubernetes namespace the planner scales in: the flag, else the pod's own.

Below both the connector chooser (``factory.py``, whose ``--help`` names the file) and the
Kubernetes connector (``kubernetes.py``, which reads it at start), and free of lightkube.
"""

from __future__ import annotations

# Where a pod finds its own namespace (the service-account volume every pod gets).
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def k8s_namespace(flag: str, sa_file: str = SA_NAMESPACE_FILE) -> str | None:
    """The flag, else the pod's namespace from the service-account file, else None (the
    kubeconfig's context decides)."""
    if flag:
        return flag
    try:
        with open(sa_file, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError:
        return None
    return text or None

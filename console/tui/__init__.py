"""The Textual app: screens that render ClusterState and bind the operator actions to keys."""

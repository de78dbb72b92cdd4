"""Who may talk to whom: TLS contexts, the cluster token and the security settings of every role.

The request plane, etcd and NATS are the cluster's trust root (a forged instance record redirects
users' prompts; an open request plane lets anyone drain a worker or read its KV dump), so each door
can require TLS and credentials. Everything is opt-in: with no flags a loopback ``dynamod up`` runs
as before; the shipped deploy configs turn it all on.
"""

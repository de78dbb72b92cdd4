"""Fixtures of the integration layer beyond the root conftest: certificates and TLS/auth-enabled
etcd and NATS for the security tests (defined in tests/fixtures/tls.py)."""

from tests.fixtures.tls import cluster_certs, secure_etcd, secure_nats  # noqa: F401 - registered as fixtures

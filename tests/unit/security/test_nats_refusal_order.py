"""Which connect error explains a failing first NATS connect (``says_more``): over TLS the server
sends its authorization error and closes, and a retry can then see only the TLS close; the
credentials refusal must not be replaced by it (a clean-clone run reported "TLS failed")."""

from __future__ import annotations

import ssl

from dynamod.shared.security.nats import refusal_hint, says_more


class AuthorizationError(Exception):
    pass


AUTH = AuthorizationError("nats: 'Authorization Violation'")
TLS_CLOSE = ssl.SSLError("[SSL: APPLICATION_DATA_AFTER_CLOSE_NOTIFY] application data after close notify")
PIPE = BrokenPipeError("broken pipe")


def test_a_tls_close_after_a_credentials_refusal_keeps_the_refusal() -> None:
    assert not says_more(TLS_CLOSE, AUTH)
    assert refusal_hint(AUTH).startswith("NATS refused the credentials")


def test_refusals_replace_plain_errors_and_not_the_other_way() -> None:
    assert says_more(AUTH, TLS_CLOSE) and says_more(AUTH, PIPE) and says_more(TLS_CLOSE, PIPE)
    assert not says_more(PIPE, TLS_CLOSE) and not says_more(PIPE, AUTH)
    assert says_more(PIPE, None) and says_more(PIPE, PIPE) and says_more(TLS_CLOSE, TLS_CLOSE)

"""The request plane: ``plane`` (the Protocol), ``factory`` (choose by name), ``tcp_server`` /
``tcp_client`` over ``framing`` (the default), ``nats_server`` / ``nats_client`` over ``nats_wire`` (the same contract over NATS), and the
stream machinery both share (``client_stream``, ``server_stream``)."""

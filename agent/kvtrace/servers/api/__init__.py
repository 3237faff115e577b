"""The kvtrace.v1 gRPC server: AgentService, grpc health and (on the Unix sockets only) reflection.

Secure by default and fail closed:
- the Unix sockets are created 0600 (umask) and only then opened to 0660 owner:group; the agent
  refuses to start if a path holds anything but a stale socket, or if ownership or permissions
  cannot be set;
- TCP is served only with mutual TLS (client certificates required), never in plaintext, and
  without reflection: it is a separate grpc.Server so that reflection cannot leak onto it.

Who sees what (gRPC Python cannot read SO_PEERCRED, so the kernel's file permissions decide):
- the socket (--socket, 0660 root:--group) serves VIEW_REDACTED: titles with secrets redacted as
  /metrics redacts them, no Python stacks or native callers, no addresses, no vLLM request ids; a
  member of the group learns no more than /metrics tells anyone on the host;
- the admin socket (--admin-socket, by default next to it; 0600 root, or 0660 with --admin-group)
  and TCP with mTLS serve VIEW_FULL. All share one hub; the group socket has stream slots of its own
  (the admin socket never waits behind it), and each user a share of its connections (peers.py reads
  the accepted sockets' SO_PEERCRED underneath gRPC).

Untrusted input stays bounded: title regexes run in RE2 (linear time) on at most 4096 characters,
once per title; without RE2 a title regex is refused, never run in Python's backtracking `re`.
A stream that does not read costs its bounded queue and no work per event (the hub parks it); when
all of a socket's stream slots are taken, a stream that does not read is ended for a new one: blocked in
its send, or, on a quiet host, found by a probe of filler more than gRPC's windows absorb (slots.py).

Which module holds what (each imports only those above it in this list):
- requests.py   requests -> model filters: the bounds on requests, InvalidArgument, the title regex
                in RE2, stream_filter; ServerLimits
- redaction.py  the redacted view: VIEW_FULL/VIEW_REDACTED, TitleRedactor, redact_*
- peers.py      who is connected to a Unix socket (SO_PEERCRED): peers_of, ConnectionShares
- slots.py      stream slots: StreamSlots, one per socket; the probe of streams that do not read
- servicer.py   the service: AgentServicer (one per view), printable_reason
- listeners.py  the Unix sockets and TLS: ServerSetupError, socket_group_id, prepare_socket_path,
                the mutual TLS credentials
- server.py     AgentServer: the endpoints, health, start and stop; SERVICE_NAME

This file imports none of them: import each name from the module that holds it.

Usage (the agent command):

    from kvtrace.servers.api.listeners import ServerSetupError
    from kvtrace.servers.api.server import AgentServer

    server = AgentServer(session, analyzer, config)   # config: kvtrace.config.ApiConfig
    session.add_sink(server.hub)            # events reach the streams
    server.hub.on_readers_changed = session.refresh_block_readers  # streams that read every block come and go
    server.start()                          # raises ServerSetupError with one clear line
    ...
    server.stop(grace_seconds=5)            # on SIGTERM
"""

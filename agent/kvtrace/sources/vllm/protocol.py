"""The plugin's datagrams to the agent: one JSON object per datagram, UTF-8, at most
MAX_DATAGRAM_BYTES, sent without blocking to a SOCK_DGRAM Unix socket the agent binds. The sender's pid
comes from the kernel (SO_PASSCRED), never from the message. Standard library only: the plugin imports
this inside vLLM's processes.

    {"v": 1, "type": "kv_cache", "device": 0, "tensors": [[address, size_bytes], ...], "tensors_omitted": 0,
     "num_blocks": 55344, "page_size_bytes": 524288, "block_size": 16}
    {"v": 1, "type": "scheduler", "blocks_total": 55343, "blocks_free": 55100, "running": 3,
     "waiting": 0, "allocated_total": 1234, "freed_total": 1200,
     "requests": [[request_id, state, blocks, done_age_seconds_or_null], ...], "requests_omitted": 0,
     "messages_dropped_total": 0}
    {"v": 1, "type": "sleep", "level": 1, "pools": [[tag, size_bytes, mapped_bytes], ...]}

`state` is one of REQUEST_STATES; level 0 is a wake_up().
"""
from __future__ import annotations

VERSION = 1
# Linux's default datagram limit on a Unix socket is about 208 KiB (net.core.wmem_default); stay well below.
MAX_DATAGRAM_BYTES = 64 * 1024
# A directory of its own, apart from the API sockets in /run/kvtrace: vLLM processes (and pods that mount
# it) reach this one only.
DEFAULT_SOCKET = "/run/kvtrace-vllm/vllm.sock"
SOCKET_ENV = "KVTRACE_VLLM_SOCKET"  # where the plugin sends (default DEFAULT_SOCKET)
ENABLE_ENV = "KVTRACE_VLLM_PLUGIN"  # the plugin does nothing unless this is "1" (opt-in)
REPORT_INTERVAL_SECONDS = 1.0
MAX_REQUESTS_PER_REPORT = 256
MAX_REQUEST_ID_CHARS = 128
MAX_TENSORS = 4096
MAX_POOLS = 64

TYPE_KV_CACHE = "kv_cache"
TYPE_SCHEDULER = "scheduler"
TYPE_SLEEP = "sleep"

REQUEST_STATES = ("waiting", "running", "preempted", "finished", "aborted")

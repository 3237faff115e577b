"""vLLM: the in-engine plugin (plugin.py, loaded by vLLM), the agent's listener for it (listener.py),
the scraper of the engine's own /metrics (metrics.py), and the datagram protocol between the plugin and
the agent (protocol.py). Only plugin.py knows vLLM's classes; only this package knows the wire shapes."""

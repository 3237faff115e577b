"""Command-line interface: one module per command (`kvtrace <cmd>` <-> cli/<cmd>.py <-> <Cmd>Command)."""

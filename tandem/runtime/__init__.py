"""The runtime shell: worker processes, transport, KV transfer, state store, launchers (ARCHITECTURE.md)."""

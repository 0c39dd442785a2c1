"""The daemon: the service around the core (sockets, effects, storage, recovery, metrics)."""

"""Engine processes: the `Engine` protocol, the worker loop, and the backends."""

"""Harnesses around the runtime packages: tiny random models (no hub needed), a launcher
for a local daemon plus engine processes, and the `weightsync demo` run built on both.
Tests, benchmarks and the demo import them; the daemon and engines never do."""

"""The daemon's pure core: events in, commands out. No I/O, no clock reads, no threads."""

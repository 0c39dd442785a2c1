"""`python -m bench.delta`'s summary, fed rows: its columns count what they name."""

from __future__ import annotations

from bench.delta import summarize


def row(t, chose, density, delta_s=1.0, delta_bytes=10):
    return {
        "transport": t,
        "dense_s": 2.0,
        "dense_bytes": 1000,
        "delta_s": delta_s,
        "delta_bytes": 1000 if chose == "dense" else delta_bytes,
        "density": density,
        "chose": chose,
    }


def test_the_density_column_counts_only_pushes_sent_as_deltas():
    # a push the chooser sent dense reports density 1.0 (every element it sent): left out
    rows = [row("shm", "delta", 0.002), row("shm", "dense", 1.0, 1.5), row("shm", "dense", 1.0, 1.5)]
    rows += [row("inline", "delta", 0.01), row("inline", "delta", 0.03)]
    s = summarize(rows, ["shm", "inline"])
    assert (s["shm"]["density"], s["shm"]["delta_chosen"], s["shm"]["pushes"]) == (0.002, 1, 3)
    assert s["shm"]["delta_s"] == 1.5  # time: every push as chosen
    assert s["shm"]["bytes_ratio"] == 10 / 1000  # bytes: the deltas only
    assert s["inline"]["density"] == 0.02


def test_no_push_sent_as_a_delta_has_no_density():
    s = summarize([row("shm", "dense", 1.0)], ["shm"])
    assert s["shm"]["density"] is None and s["shm"]["delta_chosen"] == 0

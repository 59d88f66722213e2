"""Side-by-side benchmarks of optax_accum against optax and hand-written loops."""

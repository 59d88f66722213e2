"""``python -m optax_accum.demo [lm | dp] [flags]``: see `optax_accum.demo`."""

from optax_accum.demo import main

if __name__ == "__main__":
  main()

"""The ``hicache-jax`` command line and the developer tools around it: the commands
(:mod:`~hicache_jax.cli.main` and one module per command), the benchmark tables, the results
schema of the device runs, and the launcher of ``jax.distributed`` processes. The top layer:
nothing in hicache_jax imports it."""

"""``python -m hicache_jax bench ...``: the same as the ``hicache-jax`` console script."""

from hicache_jax.cli.main import main

raise SystemExit(main())

"""``python -m shard_engine_api``: the ``shard-engine`` command line."""

from shard_engine_api.cli import main

raise SystemExit(main())

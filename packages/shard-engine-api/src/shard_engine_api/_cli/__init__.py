"""The parts of the ``shard-engine`` command line (its entry point is ``shard_engine_api.cli``).

common.py     argument value types, the parser and help classes, helpers every command uses
parser.py     the argument parser, one small function per subcommand
run.py        ``run``: one generation through the shards, streamed and verified
chat.py       ``run --chat``: the prompt in the model's own chat template
sessions.py   ``run --sessions N``: N sessions at once through the same shards
commands.py   ``engines``, ``bench``, ``conformance`` and the commands of missing engines
logs.py       ``-v`` and ``--log-format``: where and how the library's logs are written
"""

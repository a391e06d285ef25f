"""One module per `shardbridge` verb (see bridge/cli.py)."""

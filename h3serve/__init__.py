"""h3serve: MiniMax-H3 served on Ray Serve.

One namespace for the installed packages (docs/DESIGN.md, the map): ``h3serve.attention`` <- ``h3serve.pipelines`` <-
``h3serve.replicas`` <- ``h3serve.deploy``, and ``h3serve.demo`` (the tiny model's world, training and eval), reached
from the CLI only.
"""

"""The ``h3serve`` console script of installs made before the CLI moved to ``deploy.driver.cli`` (an editable
install keeps the entry point it was installed with until ``pip install -e .`` is run again)."""

from deploy.driver.cli import main

__all__ = ["main"]

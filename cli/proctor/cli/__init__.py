"""The ``proctor`` command line: the one place that composes the dataserver (``proctor.server``) and the trainer
side (``proctor.client``).

``proctor.cli.main`` parses the subcommands; ``proctor.cli.dataserver`` runs ``serve``, ``validate`` and
``preview``; ``proctor.cli.demo`` runs a server and trains the tiny model against it; ``proctor.cli.launcher``
starts ``proctor serve`` as a child process (for the demo, the benchmarks and the end-to-end tests). This module
imports none of them, so that importing the launcher loads nothing else.
"""

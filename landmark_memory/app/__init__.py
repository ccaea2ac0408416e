"""What users run: building memories (``build.py``, on Ray in ``distributed.py``), evaluation,
the command line (``entry.py`` parses before the heavy imports, ``cli.py`` runs), the terminal
chat, the demo, and the HTTP server (``serve*.py``)."""
